"""Shared test helpers: repo paths and a torchrun launcher for 2-process gloo tests."""
from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

# hypothesis' pytest plugin imports hypothesis lazily, in some runs only in the terminal summary; there, on
# CPython 3.11.7, the late import twice crashed pytest after every test had passed ("SystemError: AST
# constructor recursion depth mismatch"). Importing it while the session starts avoids that late compile.
import hypothesis  # noqa: F401

REPO_ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(script, args=(), nproc=2, env=None, timeout=600, cwd=None) -> subprocess.CompletedProcess:
    """Run ``torchrun --nproc-per-node N script args`` on loopback; raise with its output on failure."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
           "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(script), *map(str, args)]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    proc = subprocess.run(cmd, cwd=cwd or REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"torchrun failed ({proc.returncode}): {' '.join(cmd)}\n--- stdout ---\n"
                             f"{proc.stdout[-8000:]}\n--- stderr ---\n{proc.stderr[-8000:]}")
    return proc


@pytest.fixture
def torchrun():
    return run_torchrun


def rerun_in_fresh_process(request, timeout: int = 300) -> None:
    """Run the calling test again in a new pytest process and fail if it fails there.

    For tests of single-process behaviour without a process group: when an earlier test in this pytest
    process has already initialised torch.distributed, the test reruns where none exists instead of skipping.
    """
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", request.node.nodeid],
                          cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{request.node.nodeid} failed in a fresh process:\n{proc.stdout[-4000:]}{proc.stderr[-2000:]}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]


def needs_entry(name: str, *others: str):
    """Skip unless the megatron-core patch-registry entry ``name`` (or one of ``others``: a feature's entries for
    other releases) was written for the installed megatron-core (features built on it are left off on other
    releases, where megatron-core's own path runs)."""
    from megatron.rl.runtime import patches, versions

    entries = [patches.REGISTRY[n] for n in (name, *others)]
    written = sorted({v for entry in entries for v in entry.versions})
    return pytest.mark.skipif(
        not any(versions.written_for(entry.versions) for entry in entries),
        reason=f"{name!r} is written for megatron-core {', '.join(written)} "
               f"(installed: {versions.installed_version()})")


@pytest.fixture(autouse=True)
def _cpu_threads_fixed_by_default(request, monkeypatch):
    """Runs inside tests keep torch's thread count: tests compare runs exactly, and a count that followed the
    machine's load would change reductions' order between them. The thread budget's own tests adapt."""
    if request.node.get_closest_marker("adaptive_cpu_threads") is None:
        from megatron.rl.runtime import cpu_threads

        monkeypatch.setattr(cpu_threads, "_MIN_WINDOW_S", float("inf"))
