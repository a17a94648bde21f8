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
