"""A checkpoint save leaves no process behind: megatron-core's torch_dist writer kept a spawned Manager process and
its resource tracker for the life of the trainer, which a SIGKILL orphaned (re-parented to PID 1, run after run)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

import ckpt_tiny_model as T
from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint
from tests.conftest import REPO_ROOT

ARCH = T.Arch(num_layers=2, hidden_size=32)


def _multiprocessing_children() -> list[str]:
    """Command lines of this process's descendants that multiprocessing spawned (workers, resource trackers)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            cmd = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "multiprocessing" in cmd:
            out.append(cmd)
    return out


def test_a_save_starts_no_process_that_outlives_it(tmp_path, dist1, monkeypatch):
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    monkeypatch.setattr(filesystem_async, "_results_queue", None)  # as in a fresh trainer: nothing made yet
    chunks, opt, sched = T.build(ARCH, distopt=False)
    T.train_step(chunks, opt, sched, 0)
    save_checkpoint(tmp_path, 1, chunks, opt, sched)
    save_checkpoint(tmp_path, 2, chunks, opt, sched)  # the second save reuses what the first one set up
    assert _multiprocessing_children() == []
    other = T.build(ARCH, distopt=False, seed=99)
    assert load_checkpoint(tmp_path, *other).iteration == 2
    assert all(a.equal(b) for a, b in zip(chunks[0].parameters(), other[0][0].parameters()))


@pytest.mark.slow
def test_a_sigkilled_trainer_leaves_no_process_behind(tmp_path):
    """train_rl.py killed with SIGKILL after its first checkpoint save: none of its descendants survives it."""
    env_yaml = tmp_path / "env.yaml"
    env_yaml.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO_ROOT / "train_rl.py"), "--num-layers", "2", "--hidden-size", "64",
           "--num-attention-heads", "4", "--seq-length", "64", "--max-position-embeddings", "64",
           "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3", "--tokenizer-type",
           "ByteLevelTokenizer", "--seed", "1", "--train-iters", "1000", "--grpo-prompts-per-step", "2",
           "--grpo-group-size", "4", "--rl-max-new-tokens", "8", "--rl-prompts-per-eval", "0",
           "--langrl-env-config", str(env_yaml), "--save", str(ckpt), "--save-interval", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    log = (tmp_path / "run.log").open("w")
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 600
        while not (ckpt / "latest_checkpointed_iteration.txt").exists():
            assert proc.poll() is None, (tmp_path / "run.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "no checkpoint within 600 s"
            time.sleep(0.5)
        time.sleep(1.0)  # into the next iteration
        descendants = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
        _, alive = psutil.wait_procs(descendants, timeout=10)
        survivors = []
        for p in alive:
            try:
                survivors.append(f"{p.pid}: {' '.join(p.cmdline())[:200]}")
            except psutil.Error:
                pass
        for p in alive:  # never leave them to the next test
            try:
                p.kill()
            except psutil.Error:
                pass
        assert survivors == [], survivors
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
