"""train_rl.py with --save-retain-last 2 --save-retain-best eval/pass@1 1 (the quickstart's retention): at most
three checkpoints stay, the best-scored among them, and the run resumes from what is left."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys

from tests.conftest import REPO_ROOT

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--lr-decay-style", "constant",
         "--grpo-prompts-per-step", "4", "--grpo-group-size", "2", "--rl-max-new-tokens", "4",
         "--rl-prompts-per-eval", "4", "--rl-eval-temperature", "1.0", "--eval-interval", "1", "--save-interval", "1",
         "--save-retain-last", "2", "--save-retain-best", "eval/pass@1", "1", "--log-interval", "1"]


def _run(args) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *FLAGS, *map(str, args)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    return out


def _evals(path):
    return {r["iteration"]: r["eval/pass@1"] for r in map(json.loads, path.read_text().splitlines())
            if "eval/pass@1" in r}


def test_retention_keeps_last_two_and_the_best_and_resume_works(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text("environments:\n  - type: arithmetic\n    weight: 1\n")
    save, metrics = tmp_path / "run", tmp_path / "m.jsonl"
    common = ["--langrl-env-config", env, "--save", save, "--load", save, "--rl-metrics-jsonl", metrics]
    _run([*common, "--train-iters", "5"])
    kept = sorted(int(p.name[5:]) for p in save.glob("iter_*"))
    assert len(kept) <= 3 and kept[-2:] == [4, 5], kept
    scores = json.loads((save / "checkpoint_scores.json").read_text())
    evals = _evals(metrics)
    best = max(range(1, 6), key=lambda it: (evals[it], it))
    assert best in kept and {int(k) for k in scores} <= set(kept)
    assert not [p for p in save.iterdir() if ".replaced-" in p.name or ".tmp-" in p.name]
    log = _run([*common, "--train-iters", "6"])
    # the metrics file names the run (its directory) and when each attempt started, for tools/plot_metrics.py
    runs = [r["run"] for r in map(json.loads, metrics.read_text().splitlines()) if "run" in r]
    assert [r["name"] for r in runs] == [tmp_path.name] * 2 and runs[0]["started"] <= runs[1]["started"]
    assert re.search(r"resumed from \S+iter_0000005 at iteration 5", log), log[-3000:]
    assert sorted(int(p.name[5:]) for p in save.glob("iter_*"))[-2:] == [5, 6]
