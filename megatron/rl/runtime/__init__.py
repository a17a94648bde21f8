"""Device/backend choice and the CPU compatibility layer for megatron-core.

Call :func:`setup_runtime` once, before building megatron-core models. On a machine with CUDA it
reports CUDA + NCCL and, when flash-attn is missing, points megatron-core's paged inference attention at
the pure-torch kernels (:mod:`megatron.rl.runtime.cuda_fallbacks`); on a CPU-only machine it installs the patches in
:mod:`megatron.rl.runtime.cpu_patches` (idempotent) and reports CPU + gloo.
"""
from __future__ import annotations

from megatron.rl.runtime.device import RuntimeInfo, choose_backend, choose_device, cuda_usable

_INFO: RuntimeInfo | None = None


def setup_runtime() -> RuntimeInfo:
    """Choose device and backend; install the CPU layer when there is no usable GPU. Idempotent."""
    global _INFO
    if _INFO is None:
        cpu = not cuda_usable()
        if cpu:
            from megatron.rl.runtime import cpu_patches

            cpu_patches.install()
        else:
            from megatron.rl.runtime import cuda_fallbacks

            cuda_fallbacks.install_paged_attention_fallback()
        _INFO = RuntimeInfo(device=choose_device(), backend=choose_backend(), cpu_layer_active=cpu)
    elif _INFO.cpu_layer_active:
        from megatron.rl.runtime import cpu_patches

        cpu_patches.enter_cpu_mode()  # a new thread needs the (thread-local) device mode too
    return _INFO


__all__ = ["RuntimeInfo", "setup_runtime", "choose_device", "choose_backend", "cuda_usable"]
