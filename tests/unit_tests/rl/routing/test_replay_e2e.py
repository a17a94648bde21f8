"""``--rl-router-replay rollout`` through train_rl's loop on two processes (torchrun, gloo), one layout each.

Every run checks that each rollout reaches the trainer with a route for every token but its last (recorded by the
engine whatever its layout: expert-parallel ranks, tensor-parallel ranks routing their sequence-parallel share,
pipeline stages holding part of the layers), that the trainer replayed them (``router_replay_routes``), and that
the per-iteration max train-inference log-prob gap stays at the dense model's level.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, needs_entry, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "replay_run.py"
MAX_GAP = 1e-5  # the dense model's fp32 train-inference bound
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--rl-router-replay", "rollout"]
# tests/unit_tests/rl/test_moe_colocated.py's short run
SHORT = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
         "--lr-decay-style", "constant", "--seed", "11", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
         "--rl-max-new-tokens", "8", "--rl-use-sequence-packing", "--log-interval", "1", "--langrl-allow-imports",
         "--train-iters", "2", "--rl-prompts-per-eval", "0", *MOE]



pytestmark = needs_entry("engine route recording")

def _run(tmp_path, flags, env_yaml: str) -> tuple[list[dict], list[int]]:
    env = tmp_path / "env.yaml"
    env.write_text(env_yaml)
    e2e = REPO_ROOT / "tests" / "unit_tests" / "rl" / "e2e"
    run_torchrun(SCRIPT, [*flags, "--langrl-env-config", env], timeout=900,
                 env={"RESULT_DIR": str(tmp_path), "PYTHONPATH": f"{e2e}:{REPO_ROOT}"})
    result = json.loads((tmp_path / "result.json").read_text())
    return result["history"], result["incomplete"]


def _check_replayed(history: list[dict], incomplete: list[int]) -> None:
    assert [(h["failed_rollouts"], h.get("skipped_update", 0.0)) for h in history] == [(0.0, 0.0)] * len(history)
    assert incomplete and not any(incomplete), f"sequences with missing routes per iteration: {incomplete}"
    assert all(h["router_replay_routes"] > 0 for h in history), [h.get("router_replay_routes") for h in history]
    gaps = [h["logprob_gap_max"] for h in history]
    assert max(gaps) < MAX_GAP, f"per-iteration max train-inference gap {gaps}"


HASH_ENV = 'environments: [{type: "tests.unit_tests.rl.rl_test_agents:HashReward", weight: 1}]\n'


@pytest.mark.multiprocess
@pytest.mark.slow  # ~40 s on the loaded 2-core machine
def test_ep2_replay_keeps_the_gap_at_the_dense_level_and_reward_rises(tmp_path):
    """The quick reward test's recipe (digits agent) on a MoE policy with EP = 2 over the two ranks."""
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "64",
             "--train-iters", "12", "--lr", "2e-2", "--lr-decay-style", "constant", "--clip-grad", "1.0",
             "--seed", "3", "--langrl-allow-imports", "--grpo-prompts-per-step", "8", "--grpo-group-size", "8",
             "--rl-max-new-tokens", "6", "--rl-use-sequence-packing", "--log-interval", "1",
             "--rl-prompts-per-eval", "0", "--expert-model-parallel-size", "2", *MOE]
    history, incomplete = _run(tmp_path, flags,
                               "imports: [digit_agents]\nenvironments:\n  - type: digits_please\n    weight: 1\n")
    assert len(history) == 12
    _check_replayed(history, incomplete)
    rewards = [h["reward_mean"] for h in history]
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2 and last > 2 * first, f"reward did not rise: {rewards}"


@pytest.mark.multiprocess
@pytest.mark.slow  # ~60 s
def test_routes_recorded_by_an_ep2_inference_copy_replay_in_a_tp2_ep1_trainer(tmp_path):
    """Separate inference layout: the TP=1 EP=2 copy records, the TP=2 (sequence-parallel) EP=1 trainer replays."""
    flags = [*SHORT, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear",
             "--rl-inference-tensor-model-parallel-size", "1", "--rl-inference-expert-model-parallel-size", "2"]
    _check_replayed(*_run(tmp_path, flags, HASH_ENV))


@pytest.mark.multiprocess
@pytest.mark.slow  # ~40 s
def test_tp2_sequence_parallel_engine_combines_its_ranks_shares_of_each_step(tmp_path):
    flags = [*SHORT, "--tensor-model-parallel-size", "2", "--sequence-parallel", "--disable-bias-linear"]
    _check_replayed(*_run(tmp_path, flags, HASH_ENV))


@pytest.mark.multiprocess
@pytest.mark.slow  # ~40 s
def test_pp2_stages_combine_their_layers_routes_and_the_trainer_replays_them_per_stage(tmp_path):
    # without biases: megatron-core 0.16.1's expert MLP adds its bias in place to a view when experts are not
    # split over ranks (a training step fails before any replay)
    flags = [*SHORT, "--pipeline-model-parallel-size", "2", "--disable-bias-linear"]
    _check_replayed(*_run(tmp_path, flags, HASH_ENV))
