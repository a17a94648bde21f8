"""On CPU, one rollout phase's KV-cache buffer serves the next phase's engine.

:class:`ReusedCpuKvBuffer` is a ``DynamicInferenceContext`` mixin: a stopped engine's CPU KV buffer goes to a
small pool and the next context of the same shape and dtype takes it instead of a fresh ``torch.empty``, so its
pages are faulted in once. A buffer is in at most one live context or in the pool, never both. GPU buffers, and
buffers megatron-core placed in a memory pool or a memory saver's region, are never kept.

Why, and the 0.19 path: docs/inference.md.
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
