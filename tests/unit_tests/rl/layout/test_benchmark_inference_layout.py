"""benchmarks/inference_layout.py at toy size: runs end to end on 2 processes and prints its table (timings are
never asserted; the refit share must be a fraction and both layouts must have generated tokens)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_inference_layout_benchmark_prints_its_table():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "inference_layout.py"), "--iters", "2",
                           "--hidden", "32", "--layers", "2", "--prompts", "2", "--group-size", "4",
                           "--max-new-tokens", "4", "--micro-batch-size", "4", "--seq-length", "64"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {}
    for line in proc.stdout.splitlines():
        if line.startswith("| ("):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            rows[cells[0]] = cells[1:]
    a = rows["(a) generate with the trainer (TP=2, 1 replica)"]
    b = rows["(b) TP=1 inference copy (2 replicas)"]
    assert float(a[0].replace(",", "")) > 0 and float(b[0].replace(",", "")) > 0
    assert 0 < float(b[4].rstrip("%")) < 100
    assert rows["(b) / (a)"][0].endswith("x")
