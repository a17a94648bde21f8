"""Fit torch's CPU threads to the cores this process may use and that other processes leave free.

Must not: change a thread count the user fixed (``--cpu-threads N`` or ``OMP_NUM_THREADS``), or touch the
thread count of runs on GPUs. :class:`ThreadBudget` samples between iterations how much of the usable cores
other processes used and sets the intra-op thread count to the cores left, at least one; worker threads adopt a
new count with :func:`follow`.

Why: docs/runtime.md; figures: docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time

import torch

log = logging.getLogger(__name__)

__all__ = ["ThreadBudget", "threads_for", "follow", "usable_cpus"]

# a shorter window measures the scheduler's noise rather than another process's load
_MIN_WINDOW_S = 0.5
_local = threading.local()
_current = {"threads": 0, "generation": 0}  # what worker threads follow; 0: nothing chosen


def usable_cpus() -> list[int]:
    """The CPUs this process may run on (its affinity), all CPUs where affinity is unknown."""
    try:
        return sorted(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return list(range(os.cpu_count() or 1))


def threads_for(usable: int, others_busy: float) -> int:
    """Threads that fit ``usable`` cores when other processes keep ``others_busy`` of them busy on average.

    A process using under half a core leaves that core to us (noise, daemons); at least one thread.
    """
    return max(1, usable - int(others_busy + 0.5))  # others_busy >= 0: never above usable


def follow() -> None:
    """Adopt the chosen thread count in the calling thread, when it changed since this thread last looked.

    torch keeps the count per OpenMP thread once a thread has run a parallel op, so a worker thread started
    before a change keeps the old count unless it calls this.
    """
    threads, generation = _current["threads"], _current["generation"]
    if threads and getattr(_local, "generation", -1) != generation:
        torch.set_num_threads(threads)
        _local.generation = generation


def _torch_default() -> int:
    """torch's own thread count when this module first asked, before any budget changed it."""
    if "default" not in _current:
        _current["default"] = torch.get_num_threads()
    return _current["default"]


def _set(threads: int) -> None:
    _current["threads"] = threads
    _current["generation"] += 1
    follow()


def _busy_seconds(cpus: set[int]) -> float | None:
    """CPU seconds spent busy so far on ``cpus`` by everything (``/proc/stat``); None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = [line.split() for line in f if line.startswith("cpu") and line[3].isdigit()]
    except OSError:
        return None
    ticks = 0
    for fields in lines:
        if int(fields[0][3:]) in cpus:
            user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[1:9])
            ticks += user + nice + system + irq + softirq + steal
    return ticks / os.sysconf("SC_CLK_TCK")


@dataclasses.dataclass
class _Mark:
    wall: float
    busy: float
    own: float


class ThreadBudget:
    """The intra-op thread count of a CPU run: fixed, or adapted to other processes' load between iterations."""

    def __init__(self, fixed: int | None, cpus: list[int] | None = None):
        self.cpus = cpus if cpus is not None else usable_cpus()
        self.ceiling = max(1, min(len(self.cpus), _torch_default()))  # torch's default counts physical cores
        env = os.environ.get("OMP_NUM_THREADS", "").strip()
        self.source = "--cpu-threads" if fixed else ("OMP_NUM_THREADS" if env.isdigit() and int(env) > 0 else "auto")
        self.fixed = fixed or (int(env) if self.source == "OMP_NUM_THREADS" else None)
        self.threads = self.fixed or self.ceiling
        self.changes = 0
        self._mark: _Mark | None = None

    def start(self) -> None:
        """Set the first count and begin measuring."""
        _set(self.threads)
        if self.fixed is None:
            self._mark = self._now()

    def describe(self) -> str:
        """One line for the start-up summary."""
        n = len(self.cpus)
        if self.fixed is not None:
            return f"{self.threads} intra-op thread{'s' * (self.threads > 1)} (fixed by {self.source}; {n} usable cores)"
        return (f"{self.threads} intra-op thread{'s' * (self.threads > 1)} on {n} usable core{'s' * (n > 1)}, "
                "fewer while other processes keep cores busy (--cpu-threads N fixes the count)")

    def update(self) -> int:
        """Between iterations: re-measure other processes' load and adapt the count. Returns the count."""
        if self._mark is None:
            return self.threads
        now = self._now()
        wall = now.wall - self._mark.wall
        if wall < _MIN_WINDOW_S or now.busy is None or self._mark.busy is None:
            return self.threads
        others = max(0.0, (now.busy - self._mark.busy) - (now.own - self._mark.own)) / wall
        self._mark = now
        wanted = threads_for(self.ceiling, others)
        if wanted != self.threads:
            log.info("CPU threads: %d -> %d (other processes kept %.1f of %d usable cores busy)", self.threads,
                     wanted, others, len(self.cpus))
            self.threads, self.changes = wanted, self.changes + 1
            _set(wanted)
        return self.threads

    def _now(self) -> _Mark:
        return _Mark(time.monotonic(), _busy_seconds(set(self.cpus)), time.process_time())
