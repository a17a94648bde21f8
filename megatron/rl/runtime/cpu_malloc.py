"""Keep the memory that glibc's malloc frees for reuse, so large CPU tensors stop page-faulting on every allocation.

Must not: override an allocator the user chose (a preloaded jemalloc, tcmalloc or mimalloc, glibc's malloc tuning
variables, ``glibc.malloc`` tunables), run on GPU runs (:class:`~megatron.rl.training.run.TrainingRun` calls it on
CPU only), or fail a run where glibc is missing (other C libraries, other systems: nothing changes).

Why: docs/runtime.md; figures: docs/benchmarks.md.
"""
from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

__all__ = ["KEEP_BYTES", "user_allocator", "keep_freed_memory"]

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
# Blocks up to this size come from the heap and freed heap memory up to this size stays mapped: the activations and
# gradients of a training step (tens of MB each) are then reused, not mapped and faulted in afresh.
KEEP_BYTES = 1 << 30
_PRELOADED = ("jemalloc", "tcmalloc", "mimalloc", "hoard", "snmalloc")
_MALLOC_VARIABLES = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_",
                     "MALLOC_ARENA_MAX", "MALLOC_ARENA_TEST")


def user_allocator(environ: Mapping[str, str]) -> str | None:
    """What in ``environ`` shows the user chose the allocator's settings (a preloaded allocator, one of glibc's
    malloc tuning variables, a ``glibc.malloc`` tunable), or None."""
    preload = environ.get("LD_PRELOAD", "")
    for name in _PRELOADED:
        if name in preload:
            return f"LD_PRELOAD={preload}"
    for name in _MALLOC_VARIABLES:
        if name in environ:
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    return None


def _glibc():
    """glibc's ``mallopt`` as this process has it loaded, or None off glibc."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None)  # the symbols already loaded: no library search, no subprocess
        libc.gnu_get_libc_version  # noqa: B018 - only glibc has it
        return libc.mallopt
    except (OSError, AttributeError):
        return None


def keep_freed_memory(mode: str, environ: Mapping[str, str] | None = None, mallopt=None) -> str:
    """Apply ``--cpu-malloc`` (``keep`` or ``system``) to this process; returns the start-up summary's line.

    ``keep``: blocks up to :data:`KEEP_BYTES` come from the heap and the heap is not trimmed below that, unless the
    user chose the allocator's settings. ``mallopt``: glibc's function (tests pass a stand-in)."""
    if mode == "system":
        return "glibc defaults (--cpu-malloc system)"
    reason = user_allocator(os.environ if environ is None else environ)
    if reason is not None:
        return f"as set by {reason} (--cpu-malloc keep leaves it)"
    mallopt = _glibc() if mallopt is None else mallopt
    if mallopt is None:
        return "the C library's defaults (not glibc)"
    if not (mallopt(_M_MMAP_THRESHOLD, KEEP_BYTES) and mallopt(_M_TRIM_THRESHOLD, KEEP_BYTES)):
        return "glibc defaults (mallopt refused the thresholds)"
    return (f"freed memory kept for reuse (blocks up to {KEEP_BYTES >> 20} MiB from the heap; --cpu-malloc system "
            "hands it back)")
