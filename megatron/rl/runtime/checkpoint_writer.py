"""megatron-core's torch_dist checkpoint writer without a process that outlives the trainer.

Synchronous saves hand the write workers' results back through a queue of this process instead of a spawn
Manager's (whose server process and resource tracker would outlive a killed trainer). Processes the main thread
forks ask the kernel for SIGKILL when the trainer dies (:func:`die_with_parent`, Linux). Must not be used with
megatron-core's asynchronous save, which megatron-rl does not use and which would need the Manager's queue.

Why: docs/runtime.md.
"""
from __future__ import annotations

import ctypes
import os
import queue
import signal
import sys
import threading

from megatron.rl.runtime.patches import record, register

__all__ = ["WRITER_PATCH", "use_in_process_write_results", "die_with_parent"]

_PR_SET_PDEATHSIG = 1
# Set before each fork (the child reads its copy): the forking process's pid, or 0 when a thread other than the main
# thread forks (the kernel sends the death signal when the forking *thread* exits, which a pool thread may do early)
_FORKER = [0]
_PRCTL: list = []  # libc's prctl, looked up in the parent (a fresh child of a threaded process must not dlopen)

WRITER_PATCH = "torch_dist writer: in-process results queue"


@register(WRITER_PATCH, when="on use",
          changes="megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue (set)",
          why="FileSystemWriterAsync's results queue is a spawn-context Manager's, made on the first save and kept "
              "for the process's life: a server process (~275 MB) and a resource tracker that a SIGKILLed trainer "
              "leaves behind; synchronous saves (all of megatron-rl's) run the write in this process, so an "
              "in-process queue carries the results and no long-lived child is started")
def use_in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process results queue (see the module docstring). Idempotent
    and cheap: called before every save, so a queue reset since (by anything) is set again."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # heavy: megatron-core

    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()  # read by _get_write_results_queue() on every save
    if sys.platform == "linux" and not _PRCTL:
        try:
            _PRCTL.append(ctypes.CDLL(None, use_errno=True).prctl)
        except (OSError, AttributeError):
            _PRCTL.append(None)
        os.register_at_fork(before=_note_forker, after_in_child=lambda: _FORKER[0] and die_with_parent(_FORKER[0]))
    record(WRITER_PATCH)


def _note_forker() -> None:
    _FORKER[0] = os.getpid() if threading.current_thread() is threading.main_thread() else 0


def die_with_parent(parent: int) -> None:
    """In a process just forked from ``parent``: be killed when ``parent`` dies (Linux, once
    :func:`use_in_process_write_results` found libc's ``prctl``; else nothing), and exit now if it is already gone
    (it died between the fork and this call)."""
    prctl = _PRCTL[0] if _PRCTL else None
    if prctl is None or prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    if os.getppid() != parent:
        os._exit(1)
