"""Device/backend choice, and every change megatron-rl makes to megatron-core (one registry).

Call :func:`setup_runtime` once, before building megatron-core models. On a machine with CUDA it
reports CUDA + NCCL and, when flash-attn is missing, points megatron-core's paged inference attention at
the pure-torch kernels (:mod:`megatron.rl.runtime.cuda_fallbacks`); on a CPU-only machine it installs the patches in
:mod:`megatron.rl.runtime.cpu_patches` (idempotent) and reports CPU + gloo.

Only this package changes megatron-core, and every change is an entry of :mod:`megatron.rl.runtime.patches`
(what it changes, why, the megatron-core versions it was written for); :func:`all_patches` lists them.
"""
from __future__ import annotations

import contextlib

import torch

# Importing these registers every patch (the registry is complete once this package is imported).
from megatron.rl.runtime import attention_override, checkpoint_writer, cpu_patches, cuda_fallbacks, patches  # noqa: F401
from megatron.rl.runtime import inference_mode, prefix_cache  # noqa: F401
from megatron.rl.runtime import reshard_planner  # noqa: F401
from megatron.rl.runtime import subclasses  # noqa: F401
from megatron.rl.runtime.device import RuntimeInfo, choose_backend, choose_device, cuda_usable
from megatron.rl.runtime.patches import Patch

_INFO: RuntimeInfo | None = None


def setup_runtime() -> RuntimeInfo:
    """Choose device and backend; install the CPU layer when there is no usable GPU. Idempotent."""
    global _INFO
    if _INFO is None:
        cpu = not cuda_usable()
        if cpu:
            cpu_patches.install()
        else:
            cuda_fallbacks.install_paged_attention_fallback()
            for name in (inference_mode.INFERENCE_MODE_PER_THREAD, inference_mode.GLOBAL_BUFFER_OUTSIDE_INFERENCE_MODE):
                if patches.covers_installed(name):
                    patches.apply(name)
        _INFO = RuntimeInfo(device=choose_device(), backend=choose_backend(), cpu_layer_active=cpu)
    elif _INFO.cpu_layer_active:
        cpu_patches.enter_cpu_mode()  # a new thread needs the (thread-local) device mode too
    return _INFO


@contextlib.contextmanager
def flush_denormals():
    """Treat subnormal floats as zero on CPU while a training run computes (this thread and the threads it starts).

    x86 runs arithmetic on subnormals (|x| < 1.2e-38 in fp32) through a microcode slow path, many times slower
    per op, and RL weights and optimizer states drift into that range over a run (generation and training slow
    down alike: docs/benchmarks.md, "Subnormal floats"). Scoped to the run, not the process: the flag also zeroes
    subnormal Python floats (a request's temperature of 1e-308 would parse as 0), which the request validation
    must still see.
    """
    if cuda_usable():
        yield
        return
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


def keep_denormals() -> None:
    """Undo :func:`flush_denormals` for the calling thread (a thread started inside its scope inherits the flag):
    for a thread that validates clients' numbers, such as the policy server's, where ``5e-324`` must not read
    as 0."""
    torch.set_flush_denormal(False)


def all_patches() -> list[Patch]:
    """Every registered change to megatron-core, in registration order."""
    return patches.entries()


__all__ = ["RuntimeInfo", "setup_runtime", "flush_denormals", "keep_denormals", "choose_device", "choose_backend",
           "cuda_usable", "all_patches"]
