"""Keep torch's CPU ops fast when a worker thread does the compute.

libgomp throttles every thread pool's spin-wait once the pools together hold more threads than there are CPUs,
so a worker thread's ops wait on futex wake-ups. :func:`release_thread_pool` frees the *calling* thread's pool
(OpenMP 5.0 ``omp_pause_resource_all``, soft pause) before it hands work to a worker thread; libgomp rebuilds it
on the caller's next parallel op, so calling it before every hand-off is cheap and harmless.

Why: docs/runtime.md.
"""
from __future__ import annotations

import ctypes
import functools
import logging
import threading
import torch  # noqa: F401 - loads torch's OpenMP runtime, whose pause call this module finds

log = logging.getLogger(__name__)

__all__ = ["release_thread_pool"]

_OMP_PAUSE_SOFT = 1
_RUNTIME_NAMES = ("libgomp", "libiomp", "libomp")


@functools.lru_cache(maxsize=None)
def _pause_fn():
    """``omp_pause_resource_all`` of the OpenMP runtime torch loaded, or None when there is none."""

    candidates = []
    try:
        with open("/proc/self/maps") as maps:
            candidates = sorted({line.split()[-1] for line in maps
                                 if any(name in line for name in _RUNTIME_NAMES) and "/" in line})
    except OSError:  # not Linux: look the symbol up among the globally loaded libraries
        pass
    for path in [*candidates, None]:
        try:
            fn = getattr(ctypes.CDLL(path), "omp_pause_resource_all")
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], ctypes.c_int
        return fn
    log.debug("no OpenMP runtime with omp_pause_resource_all found; worker-thread ops may be slower")
    return None


def release_thread_pool() -> bool:
    """Free the calling thread's OpenMP worker pool (see the module docstring).

    Returns True when a runtime was found and accepted the call. Never raises.
    """
    fn = _pause_fn()
    if fn is None:
        return False
    try:
        return fn(_OMP_PAUSE_SOFT) == 0
    except Exception:  # a foreign runtime refusing the call must never break generation
        log.debug("omp_pause_resource_all failed in thread %s", threading.current_thread().name, exc_info=True)
        return False
