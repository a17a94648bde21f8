"""LoopControl: save/exit decisions shared by the pretraining loop and the RL driver, and the exit signal
handler end to end (pretrain_gpt.py receives SIGTERM mid-run -> exit 0, checkpoint at the reached iteration,
--load resumes from it)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from megatron.rl.training.loop_control import LoopControl
from tests.conftest import REPO_ROOT


def _drive(control: LoopControl, n: int, start: int = 0, on_iteration=None) -> int:
    it = start
    while it < n:
        it += 1
        if on_iteration:
            on_iteration(it)
        if control.after_iteration(it):
            break
    control.finish(it)
    return it


def test_save_interval_exit_interval_and_final_save():
    saved = []
    c = LoopControl("dir", 3, None, saved.append)
    assert _drive(c, 7) == 7 and saved == [3, 6, 7]  # interval saves, then the final one
    saved.clear()
    assert _drive(LoopControl("dir", 2, 5, saved.append), 20) == 5 and saved == [2, 4, 5]
    saved.clear()
    assert _drive(LoopControl("dir", 2, None, saved.append, last_saved=4), 4, start=4) == 4 and saved == []
    assert _drive(LoopControl(None, None, 3, saved.append), 10) == 3 and saved == []  # no --save: nothing


def test_signal_finishes_the_iteration_saves_and_stops():
    saved = []
    before = signal.getsignal(signal.SIGUSR1)
    c = LoopControl("dir", 100, None, saved.append, exit_signal="SIGUSR1")
    # the signal arrives in the middle of iteration 3: the iteration completes, then save + stop
    it = _drive(c, 50, on_iteration=lambda i: os.kill(os.getpid(), signal.SIGUSR1) if i == 3 else None)
    assert it == 3 and saved == [3] and c.stopped_by_signal
    assert signal.getsignal(signal.SIGUSR1) == before  # handler restored
    with pytest.raises(ValueError, match="--exit-signal"):
        LoopControl(None, None, None, saved.append, exit_signal="SIGKILL")


TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--lr", "1e-3", "--mock-data", "--log-interval", "1"]


def _env(**extra):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return {**env, **extra}


def run_until_then_signal(cmd: list[str], min_iteration: int, sig=signal.SIGTERM, timeout: float = 300, env=None):
    """Start ``cmd``; once its log shows iteration >= ``min_iteration``, send ``sig``. Returns (rc, output)."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env or _env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    lines, sent, deadline = [], False, time.monotonic() + timeout
    try:
        for line in proc.stdout:
            lines.append(line)
            m = re.search(r" iteration\s+(\d+)/", line)
            if not sent and m and int(m.group(1)) >= min_iteration:
                proc.send_signal(sig)
                sent = True
            if time.monotonic() > deadline:
                break
        rc = proc.wait(timeout=max(1.0, deadline - time.monotonic()))
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert sent, "".join(lines)[-4000:]
    return rc, "".join(lines)


def last_iteration(out: str) -> int:
    return max(int(m) for m in re.findall(r" iteration\s+(\d+)/", out))


def test_pretrain_gpt_sigterm_saves_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = [sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "100000",
           "--save", str(ckpt), "--save-interval", "100000", "--exit-signal-handler"]
    rc, out = run_until_then_signal(cmd, 2)
    assert rc == 0, out[-4000:]
    reached = last_iteration(out)
    assert 2 <= reached < 100000 and "received SIGTERM" in out, out[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(reached)
    assert (ckpt / f"iter_{reached:07d}").is_dir()
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *TINY,
                           "--train-iters", "100000", "--exit-interval", str(reached + 1), "--load", str(ckpt)],
                          cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    out2 = proc.stdout + proc.stderr
    assert proc.returncode == 0, out2[-4000:]
    assert f"training from iteration {reached} to 100000" in out2
    assert re.search(rf" iteration\s+{reached + 1}/", out2) and last_iteration(out2) == reached + 1


RL_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "16",
           "--lr", "1e-3", "--seed", "3", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
           "--rl-max-new-tokens", "4", "--rl-use-sequence-packing", "--log-interval", "1", "--train-iters", "1000"]


@pytest.mark.slow  # ~30-45 s: two train_rl.py processes
def test_train_rl_sigusr1_saves_and_resumes(tmp_path):
    env_cfg = tmp_path / "env.yaml"
    env_cfg.write_text("imports: [digit_agents]\nenvironments:\n  - type: digits_please\n    weight: 1\n")
    e2e = REPO_ROOT / "tests" / "unit_tests" / "rl" / "e2e"
    env = _env(PYTHONPATH=f"{e2e}{os.pathsep}{REPO_ROOT}")  # the e2e tests' user agent module
    ckpt = tmp_path / "ckpt"
    base = [sys.executable, str(REPO_ROOT / "train_rl.py"), *RL_TINY, "--langrl-env-config", str(env_cfg),
            "--langrl-allow-imports", "--save", str(ckpt)]
    rc, out = run_until_then_signal([*base, "--exit-signal-handler", "--exit-signal", "SIGUSR1"], 2,
                                    sig=signal.SIGUSR1, env=env)
    assert rc == 0, out[-4000:]
    reached = last_iteration(out)
    assert "received SIGUSR1" in out and (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() \
        == str(reached), out[-4000:]
    proc = subprocess.run([*base, "--load", str(ckpt), "--exit-interval", str(reached + 1)], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    out2 = proc.stdout + proc.stderr
    assert proc.returncode == 0, out2[-4000:]
    assert f"at RL iteration {reached}" in out2 and last_iteration(out2) == reached + 1, out2[-4000:]
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == str(reached + 1)

