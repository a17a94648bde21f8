"""Reward actually rises under GRPO: a short fixed-seed run of the real train_rl.py CLI.

The quick default-suite test uses a randomly initialised tiny GPT and a dense reward from a user-defined
agent (tests/unit_tests/rl/e2e/digit_agents.py, imported through the env config, as users do). The slow
test runs the README's main job (examples/rl/quickstart.py: pretrain on arithmetic, then GRPO) and checks
the held-out pass@1 gain the issue asks for.
"""
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

HERE = Path(__file__).parent


def _records(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def run_tiny_grpo(env: Path, metrics: Path, extra: tuple[str, ...] = (), iters: int = 12):
    """The real train_rl.py CLI: a randomly initialised tiny GPT, GRPO for ``iters`` iterations on the env config
    ``env`` (its ``imports:`` find modules in this folder); asserts it exits 0."""
    cmd = [sys.executable, str(REPO_ROOT / "train_rl.py"),
           "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "64",
           "--train-iters", str(iters), "--lr", "2e-2", "--lr-decay-style", "constant", "--clip-grad", "1.0",
           "--seed", "3", "--langrl-env-config", str(env), "--langrl-allow-imports",
           "--grpo-prompts-per-step", "8", "--grpo-group-size", "8", "--rl-max-new-tokens", "6",
           "--rl-use-sequence-packing", "--log-interval", "1", "--rl-metrics-jsonl", str(metrics), *extra]
    run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{HERE}{os.pathsep}{REPO_ROOT}"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-5000:]


# bf16 (~30 s of CPU) is the same recipe at another precision: opt-in, to keep the default suite in budget.
@pytest.mark.parametrize("precision", ["fp32", pytest.param("bf16", marks=pytest.mark.slow)])
def test_reward_rises_in_a_few_grpo_iterations(tmp_path, precision):
    """fp32, and --bf16 (bf16 weights for generation and training, fp32 optimizer state) on the same run."""
    env = tmp_path / "env.yaml"
    env.write_text("imports: [digit_agents]\nenvironments:\n  - type: digits_please\n    weight: 1\n")
    metrics = tmp_path / "metrics.jsonl"
    run_tiny_grpo(env, metrics, ("--bf16",) if precision == "bf16" else ())
    records = [r for r in _records(metrics) if "reward_mean" in r]
    rewards = [r["reward_mean"] for r in records]
    assert len(rewards) == 12
    # the engine's log-probs vs the trainer's recomputation: fp32 agrees to rounding; bf16 to its ~3 digits
    gap = max(r["logprob_gap_max"] for r in records)
    assert gap < (1e-4 if precision == "fp32" else 0.2), gap
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2 and last > 2 * first, f"reward did not rise: {rewards}"


@pytest.mark.slow
def test_quickstart_pass_at_1_rises(tmp_path):
    """The README's main job: held-out pass@1 rises by >= 0.1 absolute (budget: 15 minutes on 2 cores; ~12 here).

    Why 0.1 and not the ~0.3 the README reports: the 200-iteration trajectory is chaotic in the last float bits,
    so the seed and the machine type (another pretrained model, another RL trajectory) move the gain. Measured
    with the quickstart's recipe: seed 1 (this test's) +0.328 on a 2-core Intel Xeon without AMX, +0.277 on an
    Intel Xeon with AMX, +0.338 on an AMD EPYC with AVX-512, +0.190 on an AMD EPYC with AVX2 and no AVX-512;
    seeds 1-4 from one pretrained model (OMP_NUM_THREADS=1) +0.333, +0.280, +0.122, +0.293 on the Xeon without
    AMX and +0.287, +0.287, +0.278, +0.263 on the AVX2 EPYC. 0.1 holds below the lowest of these, and still
    fails a recipe that learns nothing (a run's gain is then about 0 +- 0.04)."""
    out = tmp_path / "qs"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / "rl" / "quickstart.py"), "--out", str(out)],
                          cwd=REPO_ROOT, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    evals = [(r["iteration"], r["eval/pass@1"]) for r in _records(out / "metrics.jsonl") if "eval/pass@1" in r]
    sys.path.insert(0, str(REPO_ROOT / "examples" / "rl"))
    from quickstart import final_pass_at_1

    assert final_pass_at_1(evals) - evals[0][1] >= 0.1, evals
    assert (out / "reward_curve.png").stat().st_size > 10_000
