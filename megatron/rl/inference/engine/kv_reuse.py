"""On CPU, one rollout phase's KV-cache buffer serves the next phase's engine.

Every rollout phase builds a new megatron-core context, whose ``memory_buffer`` (the paged KV cache,
0.5 GB by default on CPU) is a fresh ``torch.empty``: glibc maps it anew, so every cache page the phase writes
is page-faulted and zeroed by the kernel on first touch. On the small peer-benchmark shape that was most of
the cost of the prefill step's cache appends (index_copy_ ~0.75 ms per layer and tensor instead of ~0.06 ms)
and of the first decode steps' gathers. The block allocator hands out blocks from the same end of its pool
every phase, so a kept buffer is faulted in once and then reused page for page.

:class:`ReusedCpuKvBuffer` is a ``DynamicInferenceContext`` mixin: ``deallocate_all_tensors`` (which
:class:`~megatron.rl.inference.engine.session.EngineSession` calls when its engine stops) hands the CPU
buffer to a small pool, and ``allocate_all_tensors`` takes a buffer of the same shape and dtype from it
instead of its own fresh one. A buffer is in at most one live context or in the pool, never both. Only the
pages a phase touched stay resident (the rest of the buffer is never written). GPU buffers are not kept:
there, the memory goes back to training.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import torch

__all__ = ["ReusedCpuKvBuffer", "is_kept"]

# Buffers handed back, by (shape, dtype), most recent last. A couple at most: a run has one policy engine
# (and maybe an evaluation or separately laid-out one of another shape).
_POOL: "OrderedDict[tuple[tuple[int, ...], torch.dtype], torch.Tensor]" = OrderedDict()
_POOL_SIZE = 2
_LOCK = threading.Lock()


def is_kept(buffer: torch.Tensor) -> bool:
    """Whether ``buffer`` is in the pool (tests: after an engine stopped, the pool is what still holds it)."""
    with _LOCK:
        return any(kept is buffer for kept in _POOL.values())


class ReusedCpuKvBuffer:
    """Mixin over ``DynamicInferenceContext`` (before it in the bases); see the module docstring."""

    def allocate_all_tensors(self, *, is_init: bool) -> None:
        super().allocate_all_tensors(is_init=is_init)
        buffer = getattr(self, "memory_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            return
        with _LOCK:
            kept = _POOL.pop((tuple(buffer.shape), buffer.dtype), None)
        if kept is not None:
            self.memory_buffer = kept  # the fresh one is dropped untouched: it costs nothing

    def deallocate_all_tensors(self) -> None:
        buffer: Any = self.__dict__.get("memory_buffer")
        if (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and self.is_tensor_state_allocated
                and self.unified_memory_level == 0):  # otherwise megatron-core keeps its tensors: not ours to pool
            with _LOCK:
                _POOL[(tuple(buffer.shape), buffer.dtype)] = buffer
                while len(_POOL) > _POOL_SIZE:
                    _POOL.popitem(last=False)
        super().deallocate_all_tensors()
