"""Asynchronous rollouts in the trainer: flag validation, off-policy loss settings, staleness metrics (exact on a
scripted schedule), per-token versions from backend responses, and end-to-end runs (lag 0 == today bit for bit)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.rl.algorithms import ADVANTAGE_ESTIMATORS
from megatron.rl.algorithms.policy_loss import PolicyLossConfig, compute_token_loss
from megatron.rl.rollout.async_source import EngineControl, VersionRecorder
from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.inference.control import TrainerControl
from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.rl_utils import old_logprobs_from_training_forward
from megatron.rl.rollout.pipeline import VERSIONS_KEY, RequestGate
from megatron.rl.rollout.sequences import groups_to_sequences, staleness_metrics
from megatron.rl.training.config import ConfigError, parse_args
from megatron.rl.base.types import RolloutGroup, TokenRollout
from tests.conftest import REPO_ROOT

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", "3", "--lr", "1e-4"]


@pytest.fixture
def env_yaml(tmp_path):
    p = tmp_path / "env.yaml"
    p.write_text('environments: [{type: arithmetic, weight: 1}]\n')
    return p


def _rl(env, *extra, world_size=1):
    argv = [*BASE, "--langrl-env-config", str(env), "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "8", *map(str, extra)]
    return rl_config_from_args(parse_args(argv, extra_args_providers=[add_rl_args], world_size=world_size))


# ----------------------------------------------------------------------------------------------- flags


def test_defaults_are_the_synchronous_path(env_yaml):
    rl = _rl(env_yaml)
    assert not rl.async_rollouts.enabled and not rl.async_rollouts.off_policy
    assert not rl.loss.is_correction
    assert old_logprobs_from_training_forward(rl, 1)


@pytest.mark.parametrize("extra", [["--rl-generation-lag", "1"], ["--rl-partial-rollouts"]])
def test_off_policy_turns_on_the_trust_region_and_off_the_forward_shortcut(env_yaml, extra):
    rl = _rl(env_yaml, *extra)
    assert rl.async_rollouts.enabled and rl.async_rollouts.off_policy
    # decoupled PPO: IS weight against the behaviour (inference) log-probs, inside a trust region around it
    assert rl.loss.is_correction and rl.loss.correction == "trust_region"
    assert rl.loss.needs_entropy and rl.loss.entropy_weight == 0  # measured for the warnings, no bonus
    assert not old_logprobs_from_training_forward(rl, 1)  # proximal log-probs from their own scoring pass
    # another correction is the user's to choose
    assert _rl(env_yaml, *extra, "--rl-importance-sampling-mode", "truncated").loss.correction == "truncated"


def test_lag_zero_with_other_granularity_uses_the_pipeline_on_policy(env_yaml):
    rl = _rl(env_yaml, "--rl-consumption-granularity", "G")
    assert rl.async_rollouts.enabled and not rl.async_rollouts.off_policy and not rl.loss.is_correction
    assert rl.loss.correction is None and not rl.loss.needs_entropy


@pytest.fixture
def whole_batch_estimator():
    @ADVANTAGE_ESTIMATORS.register("test_batch_norm")
    def batch_norm(rewards, eps=1e-6):
        return (rewards - rewards.mean()) / (rewards.std() + eps)

    batch_norm.needs_whole_batches = True
    yield "test_batch_norm"
    ADVANTAGE_ESTIMATORS._entries.pop("test_batch_norm")


@pytest.mark.parametrize("extra, message", [
    (["--rl-generation-lag", "-1"], "--rl-generation-lag=-1: must be >= 0"),
    (["--rl-partial-rollouts", "--inference-backend", "openai", "--inference-server-url", "http://x:1"],
     "--rl-partial-rollouts continues in-flight requests with the updated weights, but --inference-backend=openai"),
    (["--rl-max-inflight-requests", "-2"], "--rl-max-inflight-requests=-2: must be >= 0"),
    (["--rl-generation-lag", "1", "--rl-max-inflight-requests", "3"], "is below --grpo-group-size=4"),
    (["--rl-generation-lag", "1", "--rl-max-inflight-requests", "8"], "with --rl-submission-granularity B"),
])
def test_bad_async_flags_are_named_errors(env_yaml, extra, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("+", r"\+")):
        _rl(env_yaml, *extra)


def test_g_consumption_with_model_parallelism_is_a_named_error(env_yaml):
    with pytest.raises(ConfigError, match="--rl-consumption-granularity G with model parallelism"):
        _rl(env_yaml, "--rl-generation-lag", "1", "--rl-consumption-granularity", "G",
            "--tensor-model-parallel-size", "2", world_size=2)
    _rl(env_yaml, "--rl-generation-lag", "1", "--rl-partial-rollouts", "--tensor-model-parallel-size", "2",
        world_size=2)  # B consumption is the same on every rank of the replica


def test_g_consumption_with_a_whole_batch_loss_is_a_named_error(env_yaml, whole_batch_estimator):
    with pytest.raises(ConfigError, match="--rl-consumption-granularity G .* --grpo-advantage-estimator="
                                          "test_batch_norm normalises over a whole batch"):
        _rl(env_yaml, "--rl-generation-lag", "1", "--rl-consumption-granularity", "G",
            "--grpo-advantage-estimator", whole_batch_estimator)
    _rl(env_yaml, "--rl-generation-lag", "1", "--grpo-advantage-estimator", whole_batch_estimator)  # B is fine


def test_openai_with_lag_alone_is_valid(env_yaml):
    rl = _rl(env_yaml, "--rl-generation-lag", "2", "--inference-backend", "openai", "--inference-server-url",
             "http://x:1")
    assert rl.async_rollouts.generation_lag == 2 and rl.loss.is_correction


def test_partial_rollouts_read_the_backend_s_supports_weight_updates(env_yaml):
    @InferenceInterface.register("test_weight_updating")
    class Updating(InferenceInterface, TrainerControl):
        supports_weight_updates = True

        async def agenerate(self, requests):
            return []

    try:
        rl = _rl(env_yaml, "--rl-partial-rollouts", "--inference-backend", "test_weight_updating")
        assert rl.async_rollouts.partial_rollouts  # a registered backend that sees updates: not refused by name
    finally:
        InferenceInterface._registry.pop("test_weight_updating", None)
    with pytest.raises(ConfigError, match="--inference-backend=huggingface does not see the trainer's weight"):
        _rl(env_yaml, "--rl-partial-rollouts", "--inference-backend", "huggingface")


# ----------------------------------------------------------------------------------------------- rollout bank


def test_rollout_bank_flags(env_yaml, tmp_path):
    with pytest.raises(ConfigError, match="--rl-rollout-bank-dir=.* without --rl-durable-rollout-bank"):
        _rl(env_yaml, "--rl-generation-lag", "1", "--rl-rollout-bank-dir", tmp_path)
    with pytest.raises(ConfigError, match="--rl-durable-rollout-bank without --save or --rl-rollout-bank-dir"):
        _rl(env_yaml, "--rl-generation-lag", "1", "--rl-durable-rollout-bank")
    # allowed with lag 0: rollouts go through the pipeline on the synchronous schedule, on-policy
    rl = _rl(env_yaml, "--rl-durable-rollout-bank", "--save", tmp_path)
    assert rl.async_rollouts.enabled and not rl.async_rollouts.off_policy and not rl.loss.is_correction
    rl = _rl(env_yaml, "--rl-durable-rollout-bank", "--rl-rollout-bank-dir", tmp_path / "bank")
    assert rl.async_rollouts.rollout_bank_dir == str(tmp_path / "bank")


# ----------------------------------------------------------------------------------------------- hooks


class _PausingBackend(InferenceInterface, TrainerControl):
    supports_weight_updates = True

    def __init__(self):
        self.events: list[tuple] = []

    async def agenerate(self, requests):
        return []

    def set_policy_version(self, version):
        self.events.append(("version", version))

    def pause_generation(self):
        self.events.append(("pause",))

    def resume_generation(self, version):
        self.events.append(("resume", version))

    @contextlib.contextmanager
    def rollout_phase(self):
        self.events.append(("enter",))
        yield self
        self.events.append(("exit",))


def test_a_wrapped_backend_s_hooks_are_reached_through_the_wrappers():
    inner = _PausingBackend()
    wrapped = RequestGate(VersionRecorder(inner), max_requests=4)
    assert wrapped.supports_weight_updates and not TrainerControl.supports_weight_updates
    control = EngineControl(wrapped)
    control.start(3)
    control.stop(drained=False)  # partial rollouts: paused across the update
    control.start(4)  # resumes the held requests first, then labels the phase (every phase start sets it)
    control.stop(drained=True)
    assert inner.events == [("enter",), ("version", 3), ("pause",), ("resume", 4), ("version", 4), ("exit",)]


def test_backends_without_weights_of_the_trainer_keep_the_no_op_hooks():
    from megatron.rl.inference.fake import FakeInference

    fake = FakeInference()
    control = EngineControl(fake)
    control.start(0)
    control.stop(drained=False)
    control.start(1)
    control.close()  # nothing to pause: the no-op defaults, no AttributeError
    assert FakeInference.supports_weight_updates


# ----------------------------------------------------------------------------------------------- staleness


def _tok(versions: list[int], reward: float, prompt: int = 2) -> TokenRollout:
    n = len(versions)
    return TokenRollout(prompt="p", completion="c", reward=reward, token_ids=list(range(prompt + n)),
                        generation_mask=[0] * prompt + [1] * n, prompt_length=prompt,
                        metadata={VERSIONS_KEY: [-1] * prompt + versions})


def test_staleness_metrics_are_exact_on_a_scripted_schedule():
    # Trained at iteration 5 with lag 2: group A was submitted at 3 and continued across two updates (partial
    # rollouts), group B was submitted at 4 and finished before any update, group C is on-policy.
    groups = [RolloutGroup(rollouts=[_tok([3, 3, 4, 5], 1.0), _tok([3, 4], 0.0)]),
              RolloutGroup(rollouts=[_tok([4, 4, 4], 0.5), _tok([4], 0.0)]),
              RolloutGroup(rollouts=[_tok([5, 5], 1.0), _tok([5, 5, 5], 0.0)])]
    sequences = groups_to_sequences(groups)
    m = staleness_metrics([s.policy_versions for s in sequences], iteration=5)
    # staleness per generated token: A 2,2,1,0 | 2,1 ; B 1,1,1 | 1 ; C 0,0 | 0,0,0  -> 15 tokens, sum 12, 9 stale
    assert m == {"staleness_mean": 12 / 15, "staleness_max": 2.0, "off_policy_token_share": 9 / 15}
    assert staleness_metrics([None, [-1, -1]], 3) == {}  # nothing known: no metrics rather than zeros
    # restored by the rollout bank into checkpoint 3 from weights of version 4 that were lost: off-policy too
    assert staleness_metrics([[-1, 4, 4, 3]], 3) == {"staleness_mean": 2 / 3, "staleness_max": 1.0,
                                                     "off_policy_token_share": 2 / 3}


def test_is_weight_stats_are_exact_on_scripted_logprobs():
    # proximal (recomputed) vs behaviour (inference) log-probs: weights min(exp(prox - beh), 2)
    prox = torch.tensor([-1.0, -1.0, -2.0, -0.5, -3.0], dtype=torch.float64)
    beh = torch.tensor([-1.0, -2.0, -1.0, -0.5 - 1.0, -3.0], dtype=torch.float64)
    mask = torch.tensor([1, 1, 1, 1, 0], dtype=torch.float64)
    cfg = PolicyLossConfig(is_correction=True, is_truncation_coef=2.0)
    _, stats = compute_token_loss(cfg, prox.clone().requires_grad_(), prox, torch.ones(5, dtype=torch.float64),
                                  mask, inference_logprobs=beh)
    expected = [1.0, 2.0, math.exp(-1.0), 2.0]  # exp(1) and exp(1) are truncated to 2
    assert float(stats["is_weight_mean"]) == pytest.approx(sum(expected) / 4, abs=1e-12)
    assert float(stats["is_truncated_fraction"]) == 0.5


# ----------------------------------------------------------------------------------------------- versions


class _VersionedBackend(InferenceInterface):
    """Answers its i-th call with script i: (token ids, policy versions) per response."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)

    async def agenerate(self, requests):
        await asyncio.sleep(0)
        return [InferenceResponse(text="", token_ids=ids, prompt_length=2, logprobs=[-0.1] * (len(ids) - 2),
                                  finish_reason="stop", policy_versions=vs) for ids, vs in self.scripts.pop(0)]


def _rollouts(responses):
    return [TokenRollout(prompt="x", completion="", reward=0.0, token_ids=r.token_ids, prompt_length=2,
                         generation_mask=[0, 0] + [1] * (len(r.token_ids) - 2)) for r in responses]


def test_version_recorder_attaches_each_response_s_versions_to_its_rollout_within_its_own_call():
    # two identical completions with different versions: each rollout gets one of them, none twice
    script = [([7, 8, 1, 2, 3], [0, 0, 1]), ([7, 8, 1, 2, 3], [0, 1, 1]), ([7, 8, 4], [1])]
    # another agent call, concurrently, produces the same completion at a later version: it must not mix in
    rec = VersionRecorder(_VersionedBackend(script, [([7, 8, 4], [5])]))

    async def main():
        return await asyncio.gather(VersionRecorder.call(rec.agenerate, [InferenceRequest(prompt="x")]),
                                    VersionRecorder.call(rec.agenerate, [InferenceRequest(prompt="x")]))

    (responses, recorded), (responses2, recorded2) = asyncio.run(main())
    rollouts, rollouts2 = _rollouts(responses), _rollouts(responses2)
    VersionRecorder.annotate([RolloutGroup(rollouts=rollouts2)], recorded2)
    VersionRecorder.annotate([RolloutGroup(rollouts=rollouts)], recorded)
    assert [r.metadata[VERSIONS_KEY] for r in rollouts] == [[-1, -1, 0, 0, 1], [-1, -1, 0, 1, 1], [-1, -1, 1]]
    assert rollouts2[0].metadata[VERSIONS_KEY] == [-1, -1, 5]


# ----------------------------------------------------------------------------------------------- end to end

AGENTS = "tests.unit_tests.rl.rl_test_agents"
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-iters", "3", "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11",
         "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--rl-max-new-tokens", "8",
         "--rl-use-sequence-packing", "--grpo-entropy-term-weight", "0.001", "--log-interval", "1",
         "--langrl-allow-imports", "--rl-prompts-per-eval", "0"]
COMPARED = ("reward_mean", "rl_loss", "grad_norm", "clip_fraction_low", "entropy_mean", "ratio_mean",
            "response_length_mean", "num_sequences")


def _train(tmp: Path, name: str, *extra) -> list[dict]:
    env = tmp / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    out = tmp / f"{name}.jsonl"
    cmd = [sys.executable, str(REPO_ROOT / "train_rl.py"), *FLAGS, "--langrl-env-config", str(env),
           "--rl-metrics-jsonl", str(out), *map(str, extra)]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    return [r for r in map(json.loads, out.read_text().splitlines()) if "reward_mean" in r]


@pytest.mark.slow
def test_lag_zero_through_the_pipeline_is_today_bit_for_bit_and_lag_one_partial_is_off_policy(tmp_path):
    sync = _train(tmp_path, "sync")
    # lag 0 through the pipeline (G consumption: the pipeline is built, nothing is generated ahead)
    piped = _train(tmp_path, "piped", "--rl-consumption-granularity", "G")
    assert len(sync) == len(piped) == 3
    for a, b in zip(sync, piped):
        for key in COMPARED:
            assert a[key] == b[key], (a["iteration"], key, a[key], b[key])
        assert b["staleness_max"] == 0.0 and b["off_policy_token_share"] == 0.0
        assert "staleness_max" not in a  # the synchronous path does not build the pipeline
    lagged = _train(tmp_path, "lag1", "--rl-generation-lag", "1", "--rl-partial-rollouts",
                    "--rl-submission-granularity", "G", "--rl-consumption-granularity", "G")
    assert max(r["staleness_max"] for r in lagged) == 1.0  # generated ahead, never more than the lag
    assert any(r["off_policy_token_share"] > 0 for r in lagged)
    assert all("is_weight_mean" in r and "is_truncated_fraction" in r for r in lagged)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_dp2_lag_one_partial_rollouts(tmp_path):
    """torchrun, DP=2 over gloo: each rank runs its own pipeline (2 groups per step each, generated ahead); the
    iterations stay matched across ranks and the gathered metrics respect the lag bound."""
    from tests.conftest import run_torchrun

    env = tmp_path / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    out = tmp_path / "dp2.jsonl"
    run_torchrun(REPO_ROOT / "train_rl.py",
                 [*FLAGS, "--langrl-env-config", env, "--rl-metrics-jsonl", out, "--rl-generation-lag", "1",
                  "--rl-partial-rollouts", "--rl-submission-granularity", "G", "--rl-consumption-granularity", "G"],
                 timeout=500)
    records = [r for r in map(json.loads, out.read_text().splitlines()) if "reward_mean" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3]
    assert all(r["num_sequences"] == 16 and r["env/HashReward/groups"] == 4 for r in records)
    assert all(0 <= r["staleness_max"] <= 1 and "is_weight_mean" in r for r in records)
    assert any(r["off_policy_token_share"] > 0 for r in records)


@pytest.mark.slow
def test_a_weighted_mixture_serves_group_by_group_submission(tmp_path):
    """Two environments weighted 3:1, lag 1, partial rollouts, one agent call per group (G submission) and G
    consumption: the mixture is asked for one group at a time and shares them out over the calls (it refused such
    a request before: "1 groups per step cannot give each of the 2 weighted environments at least one group")."""
    env = tmp_path / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", name: a, weight: 3}}, '
                   f'{{type: "{AGENTS}:HashReward", name: b, weight: 1}}]\n')
    out = tmp_path / "mix.jsonl"
    flags = list(FLAGS)
    flags[flags.index("--train-iters") + 1] = "4"  # 16 groups trained
    cmd = [sys.executable, str(REPO_ROOT / "train_rl.py"), *flags, "--langrl-env-config", str(env),
           "--rl-metrics-jsonl", str(out), "--rl-generation-lag", "1", "--rl-partial-rollouts",
           "--rl-submission-granularity", "G", "--rl-consumption-granularity", "G"]
    proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-5000:]
    records = [r for r in map(json.loads, out.read_text().splitlines()) if "reward_mean" in r]
    assert [r["iteration"] for r in records] == [1, 2, 3, 4]
    groups = [(r.get("env/a/groups", 0), r.get("env/b/groups", 0)) for r in records]
    assert all(a + b == 4 for a, b in groups), groups
    # 24 groups were submitted (16 trained + up to 8 ahead), 1 in 4 to b; the 16 trained hold 3 to 5 of them
    assert 3 <= sum(b for _, b in groups) <= 5, groups
