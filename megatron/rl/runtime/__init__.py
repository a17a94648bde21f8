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
            _flush_denormals()
        else:
            from megatron.rl.runtime import cuda_fallbacks

            cuda_fallbacks.install_paged_attention_fallback()
        _INFO = RuntimeInfo(device=choose_device(), backend=choose_backend(), cpu_layer_active=cpu)
    elif _INFO.cpu_layer_active:
        from megatron.rl.runtime import cpu_patches

        cpu_patches.enter_cpu_mode()  # a new thread needs the (thread-local) device mode too
        _flush_denormals()
    return _INFO


def _flush_denormals() -> None:
    """Treat subnormal floats as zero on CPU (the calling thread and the threads it starts later).

    x86 runs arithmetic on subnormals (|x| < 1.2e-38 in fp32) through a microcode slow path, ~100x per op.
    RL weights and Adam states drift into that range over a run: the quickstart's iterations went from ~0.5 s
    to 10-30 s at iteration ~70 (generation and training alike), and back to ~0.5 s with this flag on the same
    checkpoint. Values that small change no result we compute.
    """
    import torch

    torch.set_flush_denormal(True)


__all__ = ["RuntimeInfo", "setup_runtime", "choose_device", "choose_backend", "cuda_usable"]
