"""What the in-process engine needs on a CUDA machine that lacks flash-attn.

megatron-core's dynamic inference engine runs its paged-KV attention through flash-attn
(``flash_attn_varlen_func`` for prefill, ``flash_attn_with_kvcache`` for decode) and fails with
``ModuleNotFoundError: flash_attn`` on the first request when it is not installed. flash-attn ships
no wheels on PyPI (it builds from source for tens of minutes), so a fresh GPU machine usually lacks it.
The pure-torch kernels of :mod:`megatron.rl.runtime.torch_attention` are device-agnostic (SDPA over the
gathered KV blocks), so they serve as the fallback: slower than flash-attn and not CUDA-graph capturable
(they read the cache lengths on the host), but correct.

Only the two attention entry points are replaced; nothing of the CPU layer is installed on CUDA.
"""
from __future__ import annotations

import logging
import threading

from megatron.rl.runtime import torch_attention

log = logging.getLogger(__name__)

_lock = threading.Lock()
_installed = False


def install_paged_attention_fallback() -> bool:
    """Point megatron-core's paged attention at the torch kernels when flash-attn is missing.

    Returns True when the fallback is (now or already) in use. Idempotent and thread-safe.
    """
    global _installed
    from megatron.core.transformer import attention

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
    log.warning("flash-attn is not installed: the in-process inference engine uses megatron-rl's pure-torch "
                "paged attention on CUDA (correct but slower, and no CUDA graphs). For speed, "
                "pip install flash-attn --no-build-isolation.")
    return True


def paged_attention_fallback_active() -> bool:
    return _installed
