"""One run per save directory: a lock file naming its holder.

``<--save>/.run.lock`` is locked (``fcntl.lockf``, exclusive) by global rank 0 for the run's life and holds
``<pid> <host>``. The kernel drops the lock when the process ends, however it ends, so a killed run leaves no
stale lock; a second run into the same directory while the first holds it is refused, naming the holder.
"""
from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from megatron.rl.base.errors import UserError

__all__ = ["RunDirectoryLocked", "RunLock", "LOCK_NAME"]

LOCK_NAME = ".run.lock"


class RunDirectoryLocked(UserError, RuntimeError):
    """Another process holds the save directory's run lock."""


class RunLock:
    """The held lock of ``directory`` (see the module docstring); :meth:`release` or process exit drops it."""

    def __init__(self, directory: str | os.PathLike):
        self.path = Path(directory) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 256, 0).decode("utf-8", "replace").strip() or "unknown"
            os.close(fd)
            pid, _, host = holder.partition(" ")
            raise RunDirectoryLocked(
                f"--save {self.path.parent} is in use by another run (PID {pid} on host {host or '?'}, "
                f"{self.path}): stop that run, or save to another directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()} {socket.gethostname()}\n".encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)  # closing drops the lock
