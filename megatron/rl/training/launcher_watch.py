"""Workers that die with their launcher.

A worker torchrun started is adopted by PID 1 when torchrun itself is killed (``kill -9``): nothing would stop it,
and it would go on training and writing checkpoints beside the next launch. :func:`watch_launcher` starts a daemon
thread that polls the parent PID; when the parent is gone the worker logs one line and kills itself with SIGKILL
(saves are atomic: a checkpoint being written is never loaded). A poll, not ``PR_SET_PDEATHSIG``: that signal
fires when the parent *thread* that forked the worker exits, which a launcher's worker threads may do while it
lives.

Only workers of torchrun (``$TORCHELASTIC_RUN_ID`` set) are watched: a run started from a shell outlives the
shell by design (``nohup``), and one whose parent is already PID 1 has nothing to watch.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from typing import Mapping

__all__ = ["watch_launcher"]

log = logging.getLogger(__name__)
POLL_S = 0.5


def _watch(parent: int, poll_s: float) -> None:
    while os.getppid() == parent:
        time.sleep(poll_s)
    log.error("the launcher (PID %d) is gone: this worker (PID %d) stops", parent, os.getpid())
    os.kill(os.getpid(), signal.SIGKILL)


def watch_launcher(environ: Mapping[str, str] | None = None, poll_s: float = POLL_S) -> bool:
    """Kill this process within ``poll_s`` of its launcher's death (torchrun workers only); True when watching."""
    environ = os.environ if environ is None else environ
    parent = os.getppid()
    if "TORCHELASTIC_RUN_ID" not in environ or parent == 1:
        return False
    threading.Thread(target=_watch, args=(parent, poll_s), name="launcher-watch", daemon=True).start()
    return True
