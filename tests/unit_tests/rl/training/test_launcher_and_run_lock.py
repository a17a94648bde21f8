"""Workers die with their launcher (kill -9 of torchrun leaves no rank alive), and one run per save directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.rl.training.launcher_watch import watch_launcher
from megatron.rl.training.run_lock import RunDirectoryLocked, RunLock

REPO_ROOT = Path(__file__).resolve().parents[4]
SCRIPTS = Path(__file__).parent / "scripts"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by PID 1) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0] != "Z"
    except (OSError, IndexError):
        return False


def test_sigkill_of_torchrun_leaves_no_rank_alive_within_10s(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    launcher = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
                                 "--master-addr=127.0.0.1", "--master-port=0", str(SCRIPTS / "launcher_worker.py"),
                                 str(tmp_path)], env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                start_new_session=True)
    pids: list[int] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(pids) < 2:
            pids = [int(p.read_text()) for p in tmp_path.glob("rank*.pid") if p.read_text()]
            time.sleep(0.2)
        assert len(pids) == 2, "the workers did not start"
        launcher.kill()
        launcher.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(_alive(p) for p in pids):
            time.sleep(0.2)
        assert not any(_alive(p) for p in pids), "a rank outlived its launcher by 10 s"
    finally:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if launcher.poll() is None:
            launcher.kill()


def test_only_torchrun_workers_are_watched():
    assert not watch_launcher({})  # started from a shell: outlives the shell by design (nohup)


_HOLD = ("import sys, time; from megatron.rl.training.run_lock import RunLock; RunLock(sys.argv[1]); "
         "print('held', flush=True); time.sleep(60)")


def test_a_second_run_in_a_held_save_directory_is_refused(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunDirectoryLocked, match=f"in use by another run \\(PID {holder.pid} on host "):
            RunLock(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    RunLock(tmp_path).release()  # the kernel dropped the killed holder's lock: no stale lock


def test_a_missing_load_directory_is_a_warning(tmp_path, caplog):
    import logging

    from megatron.rl.training.config import parse_args
    from megatron.rl.training.run import resolve_load_dir

    missing = str(tmp_path / "typo")
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                      "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
                      "--train-iters", "1", "--load", missing, "--save", missing], world_size=1)
    with caplog.at_level(logging.INFO):
        assert resolve_load_dir(cfg) is None
    assert [r.levelno for r in caplog.records if "does not exist: starting a new run" in r.getMessage()] == \
        [logging.WARNING]


def test_an_interrupted_saves_leftovers_go_before_anything_is_built(tmp_path, monkeypatch):
    """On a full disk the leftovers hold the space resuming needs (the rollout bank compacts early)."""
    from megatron.rl.training import run as run_module
    from megatron.rl.training.config import parse_args

    save = tmp_path / "save"
    (save / "iter_0000003.tmp-20260101T000000-1").mkdir(parents=True)
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
                      "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
                      "--train-iters", "1", "--save", str(save)], world_size=1)

    class Stop(Exception):
        pass

    def stop(*a, **k):
        raise Stop

    monkeypatch.setattr(run_module, "resolve_load_dir", stop)  # the first step after the lock
    with pytest.raises(Stop):
        run_module.TrainingRun.build(cfg)
    assert not (save / "iter_0000003.tmp-20260101T000000-1").exists()
