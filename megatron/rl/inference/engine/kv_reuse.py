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

megatron-core 0.19 allocates the buffer in ``_allocate_memory_buffer`` (called once, by the constructor's
``initialize_all_tensors``) and its suspend keeps it, so there the mixin takes a kept buffer after that allocation
and :func:`~megatron.rl.inference.engine.construct.free_context` hands the buffer over (:meth:`keep_memory_buffer`)
before it drops it. A buffer whose allocation megatron-core made in a memory pool or a memory saver's region
(unified memory, a non-PERSIST KV-cache mode) is never swapped or kept.
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

    def allocate_all_tensors(self, *, is_init: bool) -> None:  # megatron-core 0.16.1
        super().allocate_all_tensors(is_init=is_init)
        self._take_kept_buffer()

    def _allocate_memory_buffer(self) -> None:  # megatron-core 0.19
        super()._allocate_memory_buffer()
        if self._plain_buffer():
            self._take_kept_buffer()

    def _plain_buffer(self) -> bool:
        # A plain torch.empty of megatron-core's: no unified-memory pool, no memory saver, no offload backup of it.
        mode = getattr(self, "kv_cache_management_mode", None)
        return self.unified_memory_level == 0 and (mode is None or mode.name == "PERSIST")

    def _take_kept_buffer(self) -> None:
        buffer = getattr(self, "memory_buffer", None)
        if not isinstance(buffer, torch.Tensor) or buffer.device.type != "cpu":
            return
        with _LOCK:
            kept = _POOL.pop((tuple(buffer.shape), buffer.dtype), None)
        if kept is not None:
            self.memory_buffer = kept  # the fresh one is dropped untouched: it costs nothing

    def keep_memory_buffer(self) -> None:
        """Hand this context's CPU KV buffer to the pool; the context must not use it afterwards (0.16.1's
        ``deallocate_all_tensors`` and 0.19's :func:`~megatron.rl.inference.engine.construct.free_context` call
        this before they drop it)."""
        buffer: Any = self.__dict__.get("memory_buffer")
        if (isinstance(buffer, torch.Tensor) and buffer.device.type == "cpu" and self.is_tensor_state_allocated
                and self._plain_buffer()):  # otherwise megatron-core keeps its tensors: not ours to pool
            with _LOCK:
                _POOL[(tuple(buffer.shape), buffer.dtype)] = buffer
                while len(_POOL) > _POOL_SIZE:
                    _POOL.popitem(last=False)

    def deallocate_all_tensors(self) -> None:  # megatron-core 0.16.1
        self.keep_memory_buffer()
        super().deallocate_all_tensors()
