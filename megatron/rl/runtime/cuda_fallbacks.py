"""megatron-core's paged inference attention without flash-attn: the pure-torch kernels (a registered patch).

megatron-core's dynamic inference engine runs its paged-KV attention through flash-attn
(``flash_attn_varlen_func`` for prefill, ``flash_attn_with_kvcache`` for decode) and fails with
``ModuleNotFoundError: flash_attn`` on the first request when it is not installed. flash-attn ships
no wheels on PyPI (it builds from source for tens of minutes), so a fresh GPU machine usually lacks it, and a
CPU machine always does. The pure-torch kernels of :mod:`megatron.rl.runtime.torch_attention` are
device-agnostic (SDPA over the gathered KV blocks), so they serve as the fallback: slower than flash-attn and
not CUDA-graph capturable (they read the cache lengths on the host), but correct. Only the two attention entry
points (and the version gate megatron-core reads) are replaced.
"""
from __future__ import annotations

import logging
import threading

from megatron.rl.runtime import patches, torch_attention, versions

log = logging.getLogger(__name__)

PAGED_ATTENTION = "paged attention without flash-attn -> pure torch"

_lock = threading.Lock()
_installed = False


@patches.register(
    PAGED_ATTENTION, when=("cpu", "cuda"),
    changes="megatron.core.transformer.attention:flash_attn_varlen_func, .flash_attn_with_kvcache, "
            ".is_fa_min_version",
    why="dynamic-batching inference calls flash-attn's paged kernels, which a CPU machine never has and a GPU "
        "machine often lacks (no PyPI wheels); the torch kernels compute the same attention",
    versions=versions.BOTH)
def use_torch_paged_attention() -> bool:
    """Point megatron-core's paged attention at the torch kernels when flash-attn is missing.

    Returns True when the torch kernels are (now or already) in use. Idempotent and thread-safe.
    """
    global _installed
    from megatron.core.transformer import attention  # heavy: megatron-core

    with _lock:
        if _installed:
            return True
        if attention.flash_attn_with_kvcache is not None:
            return False
        attention.flash_attn_varlen_func = torch_attention.flash_attn_varlen_func
        attention.flash_attn_with_kvcache = torch_attention.flash_attn_with_kvcache
        # megatron-core gates features on the flash-attn version it imported; the stand-ins implement
        # the calls it makes with any version.
        attention.is_fa_min_version = lambda *a, **k: True
        _installed = True
    return True


def install_paged_attention_fallback() -> bool:
    """On a GPU machine: :func:`use_torch_paged_attention`, with a warning the first time it takes over."""
    was_installed = _installed
    active = use_torch_paged_attention()
    if active:
        patches.record(PAGED_ATTENTION)
    if active and not was_installed:
        log.warning("flash-attn is not installed: the in-process inference engine uses megatron-rl's pure-torch "
                    "paged attention on CUDA (correct but slower, and no CUDA graphs). For speed, "
                    "pip install flash-attn --no-build-isolation.")
    return active


def paged_attention_fallback_active() -> bool:
    return _installed
