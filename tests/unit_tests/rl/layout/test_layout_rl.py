"""The RL loop with a separate inference layout, 2 processes over gloo (fp32, CPU).

Parity: every rollout's inference log-probs (from the inference copy) equal the trainer's teacher-forced
log-probs (``logprob_gap_max``, measured by the loop on every rollout) within 1e-5, at iteration 1
(rollouts from the initial weights) through iteration 4 (after 3 updates), and every refit after an update
changed the copy's weights. A missed refit would show as a gap of the size of an update (~1e-2 here).
"""
from __future__ import annotations

import json
import shutil
import statistics
import tempfile
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "layout_rl_run.py"
AGENTS = "tests.unit_tests.rl.rl_test_agents"
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11", "--grpo-prompts-per-step", "4",
         "--grpo-group-size", "4", "--rl-max-new-tokens", "8", "--rl-use-sequence-packing", "--log-interval", "1",
         "--langrl-allow-imports", "--rl-prompts-per-eval", "0", "--rl-verify-model-weights-swap"]
CASES = {
    "train_tp2_infer_tp1": ["--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1"],
    "train_pp2_infer_tp1": ["--pipeline-model-parallel-size", "2", "--rl-inference-pipeline-model-parallel-size", "1"],
    "moe_train_ep2_infer_ep1": ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
                                "--rl-inference-expert-model-parallel-size", "1"],
}


def _env(tmp: Path) -> Path:
    p = tmp / "env.yaml"
    p.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    return p


def _result_dir(tmp: Path) -> Path:
    return Path(tempfile.mkdtemp(prefix="results", dir=tmp))


def _results(result_dir: Path, stdout: str) -> list[dict]:
    out = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    assert len(out) == 2, stdout[-4000:]
    return sorted(out, key=lambda r: r["rank"])


def _run(tmp: Path, case: list[str], iters: int, *extra) -> list[dict]:
    result_dir = _result_dir(tmp)
    proc = run_torchrun(SCRIPT, [*FLAGS, "--train-iters", str(iters), "--langrl-env-config", _env(tmp), *case,
                                 *map(str, extra)], timeout=600, env={"LAYOUT_RESULT_DIR": str(result_dir)})
    assert "--rl-verify-model-weights-swap: inference copy equals the trainer" in proc.stdout + proc.stderr
    return _results(result_dir, proc.stdout)


@pytest.mark.multiprocess
@pytest.mark.parametrize("case", [
    "train_tp2_infer_tp1",
    pytest.param("train_pp2_infer_tp1", marks=pytest.mark.slow),
    pytest.param("moe_train_ep2_infer_ep1", marks=pytest.mark.slow),
])
def test_inference_copy_logprobs_equal_trainer_before_and_after_updates(tmp_path, case):
    # with evaluation at iterations 0, 2 and 4: served by the copy too, split over its replicas
    results = _run(tmp_path, CASES[case], 4, "--rl-prompts-per-eval", "4", "--eval-interval", "2")
    for r in results:
        assert [e["iteration"] for e in r["evals"]] == [0, 2, 4]
        assert all(e["eval/HashReward/num_prompts"] == 2 for e in r["evals"]), r["evals"]
        history = r["history"]
        assert [h["iteration"] for h in history] == [1, 2, 3, 4]
        gaps = [h["logprob_gap_max"] for h in history]
        assert max(gaps) < 1e-5, gaps
        assert all(h["optimizer_steps"] == 2 and h["skipped_steps"] == 0 for h in history)
        # refits: once after loading, then after each of the 4 iterations
        assert len(r["checksums"]) == 5, r["checksums"]
        for before, after in r["checksums"]:
            assert abs(after - before) > 1e-6 * abs(before), r["checksums"]
        assert all(h["time_refit_s"] > 0 for h in history)
    # the ranks agree on everything the loop reports (they computed the same global batch)
    assert results[0]["history"][-1]["rl_loss"] == results[1]["history"][-1]["rl_loss"]
    if case.startswith("moe"):
        # the EP=1 copy's token dispatchers talk over the inference layout's groups (this rank alone), never
        # over the training layout's EP group: its two replicas generate different prompts at their own pace
        for r in results:
            groups = r["copy_dispatcher_groups"]
            assert len(groups) == 2 and all(g == {"ep_group": [r["rank"]], "tp_group": [r["rank"]],
                                                  "tp_ep_group": [r["rank"]]} for g in groups), groups


COMPARED = ("reward_mean", "reward_std", "rl_loss", "grad_norm", "ratio_mean", "clip_fraction_high",
            "response_length_mean", "num_sequences")


@pytest.mark.multiprocess
@pytest.mark.slow
def test_resume_with_inference_copy_is_exact(tmp_path):
    """The copy is not checkpointed: a resumed run rebuilds it and refits from the trainer's checkpoint."""
    case = CASES["train_tp2_infer_tp1"]
    ckpt = tmp_path / "ckpt"
    full_run = _run(tmp_path, case, 3, "--save", ckpt, "--save-interval", "1")[0]
    load = tmp_path / "load"
    load.mkdir()
    shutil.copytree(ckpt / "iter_0000001", load / "iter_0000001")
    (load / "latest_checkpointed_iteration.txt").write_text("1")
    resumed_run = _run(tmp_path, case, 3, "--load", load)[0]
    full, resumed = full_run["history"], resumed_run["history"]
    assert [h["iteration"] for h in resumed] == [2, 3]
    # first the rollouts: different tokens mean the copy sampled differently (not the trainer's math)
    assert full_run["token_digests"][1:] == resumed_run["token_digests"], "the resumed copy sampled other tokens"
    for a, b in zip(full[1:], resumed):
        for key in COMPARED:
            assert a[key] == b[key], (key, a[key], b[key])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_grpo_reward_rises_with_a_separate_inference_layout(tmp_path):
    """The quick reward test's run (digits agent), trained at TP=2 and generated by a TP=1 copy (2 replicas)."""
    env = tmp_path / "env.yaml"
    env.write_text("imports: [digit_agents]\nenvironments:\n  - type: digits_please\n    weight: 1\n")
    flags = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
             "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "64",
             "--train-iters", "12", "--lr", "2e-2", "--lr-decay-style", "constant", "--clip-grad", "1.0",
             "--seed", "3", "--langrl-env-config", str(env), "--langrl-allow-imports",
             "--grpo-prompts-per-step", "8", "--grpo-group-size", "8", "--rl-max-new-tokens", "6",
             "--rl-use-sequence-packing", "--log-interval", "1", "--rl-prompts-per-eval", "0",
             "--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1"]
    e2e = REPO_ROOT / "tests" / "unit_tests" / "rl" / "e2e"
    result_dir = _result_dir(tmp_path)
    proc = run_torchrun(SCRIPT, flags, timeout=900,
                        env={"PYTHONPATH": f"{e2e}:{REPO_ROOT}", "LAYOUT_RESULT_DIR": str(result_dir)})
    history = _results(result_dir, proc.stdout)[0]["history"]
    rewards = [h["reward_mean"] for h in history]
    assert len(rewards) == 12
    assert max(h["logprob_gap_max"] for h in history) < 1e-4
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2 and last > 2 * first, f"reward did not rise: {rewards}"


@pytest.mark.multiprocess
@pytest.mark.slow  # ~15-30 s; the passing side of the check runs in every parity test above
def test_verify_model_weights_swap_fails_loudly_on_a_bad_copy():
    proc = run_torchrun(Path(__file__).parent / "scripts" / "verify_swap_check.py", timeout=400)
    assert proc.stdout.count("VERIFY OK") == 2, proc.stdout[-3000:]
