"""megatron-core 0.19 and inference mode: its flag per thread instead of per process, and its global buffer
allocated outside torch.inference_mode (two registered patches, 0.19).

megatron-core 0.19 marks "an inference engine is using the model" with one process-wide flag
(``megatron.core.inference.utils.InferenceMode``), set when an engine is built and cleared when it is
suspended; every layer's forward reads it to choose inference-only paths (logits gathered across TP ranks, MoE
dispatch, fused kernels). megatron-rl runs its engine on a thread of its own, next to the trainer's forward
(log-probs, asynchronous rollouts) and keeps engines alive between phases, so a process-wide flag sends the
trainer's forward down the inference paths. Per thread, the flag is set where the engine is built and stepped,
which is the engine's thread, and the trainer's thread never sees it.
"""
from __future__ import annotations

import threading

import torch

from megatron.rl.runtime import patches, versions

INFERENCE_MODE_PER_THREAD = "inference-mode flag per thread"

_state = threading.local()


def _is_active(cls) -> bool:
    return getattr(_state, "active", False)


def _set_active(cls) -> None:
    _state.active = True


def _unset_active(cls) -> None:
    _state.active = False


@patches.register(
    INFERENCE_MODE_PER_THREAD, when=("cpu", "cuda"),
    changes="megatron.core.inference.utils:InferenceMode.is_active, .set_active, .unset_active",
    why="the flag is process-wide, so an engine built on the inference thread sends the trainer's forward on "
        "another thread down inference-only paths (e.g. 'Inference must always gather TP logits')",
    versions=versions.MCORE_0_19)
def install() -> None:
    """Make ``InferenceMode`` thread-local (idempotent: the same functions are set again)."""
    from megatron.core.inference.utils import InferenceMode  # heavy: megatron-core; 0.19 only

    InferenceMode.is_active = classmethod(_is_active)
    InferenceMode.set_active = classmethod(_set_active)
    InferenceMode.unset_active = classmethod(_unset_active)


GLOBAL_BUFFER_OUTSIDE_INFERENCE_MODE = "global memory buffer outside torch.inference_mode"


@patches.register(
    GLOBAL_BUFFER_OUTSIDE_INFERENCE_MODE, when=("cpu", "cuda"),
    changes="megatron.core.utils:GlobalMemoryBuffer.get_tensor",
    why="0.19's controller runs the engine's forward under torch.inference_mode, and megatron-core's process-wide "
        "buffer (the MoE token dispatcher's all-gather output with expert or sequence parallelism) is allocated on "
        "first use: allocated there it is an inference tensor, and the trainer's next forward that writes into it "
        "fails ('Inplace update to inference tensor outside InferenceMode'). Allocated with inference mode off it "
        "is an ordinary tensor, which both the engine and the trainer may write",
    versions=versions.MCORE_0_19)
def allocate_global_buffer_outside_inference_mode() -> None:
    """Wrap ``GlobalMemoryBuffer.get_tensor`` so that its buffers and views are never inference tensors."""
    from megatron.core.utils import GlobalMemoryBuffer  # heavy: megatron-core

    original = GlobalMemoryBuffer.get_tensor
    if getattr(original, "_rl_outside_inference_mode", False):
        return

    def get_tensor(self, *args, **kwargs):
        with torch.inference_mode(False):
            return original(self, *args, **kwargs)

    get_tensor._rl_outside_inference_mode = True
    GlobalMemoryBuffer.get_tensor = get_tensor
