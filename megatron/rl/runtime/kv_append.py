"""Appending a step's keys and values to megatron-core's paged KV cache with one ``index_copy_`` per tensor.

Without its Triton kernel (CPU), megatron-core's ``DynamicInferenceContext.append_key_value_cache``
writes ``memory_buffer[0, layer, block_idx, local_idx] = key`` (and the same for values): an advanced-index
put with two index tensors, whose per-element index arithmetic cost ~0.2 ms per tensor and layer at 128
decode rows. :func:`install` replaces it with ``index_copy_`` into the layer's cache viewed as
``[blocks * block_size, heads, dim]`` at ``block_idx * block_size + local_idx`` (the same slots; negative
indices wrap as advanced indexing does), with those slot ids computed once per step (every layer of a step
appends at the same slots; cached on the context, keyed by the index buffers and their version counters).
MLA latent caches and the Triton kernel on CUDA tensors keep megatron-core's code (0.19 imports the kernel
whenever triton is installed, which the CUDA torch wheels pull in, and the kernel refuses CPU tensors). The step's
index buffers are the context's own on 0.16.1 and its ``gpu_view``'s on 0.19.
"""
from __future__ import annotations

import torch

__all__ = ["install", "forget"]

_ORIGINAL: dict[str, object] = {}


def install() -> None:
    """Replace ``append_key_value_cache`` (idempotent). Called by the CPU layer's patch registry."""
    from megatron.core.inference.contexts import dynamic_context

    if _ORIGINAL:
        return
    cls = dynamic_context.DynamicInferenceContext
    _ORIGINAL["append"] = cls.append_key_value_cache
    cls.append_key_value_cache = _append


def original():
    """megatron-core's ``append_key_value_cache`` (for tests and fallbacks)."""
    return _ORIGINAL["append"]


def _append(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> None:
    from megatron.core.inference.contexts import dynamic_context

    if self.cache_mla_latent or (dynamic_context.triton_append_key_value_cache is not None and key.is_cuda):
        return _ORIGINAL["append"](self, layer_number, key, value)
    assert key.size(1) == 1 and value.size(1) == 1
    layer = self.layer_map[layer_number - 1]
    n = self.padded_active_token_count
    slots = _step_slots(self, n)
    keys, values = self.memory_buffer[0, layer], self.memory_buffer[1, layer]  # [blocks, block_size, heads, dim]
    keys.view(-1, *keys.shape[2:]).index_copy_(0, slots, key.squeeze(1)[:n])
    values.view(-1, *values.shape[2:]).index_copy_(0, slots, value.squeeze(1)[:n])


def forget(context) -> None:
    """Drop ``context``'s memoised cache slots: the next append computes them afresh (inside a graph capture, say)."""
    context.__dict__.pop("_rl_kv_slots", None)


def _step_slots(context, n: int) -> torch.Tensor:
    """Flat cache slots of the step's first ``n`` tokens, memoised while the index buffers are unchanged."""
    view = getattr(context, "gpu_view", None) or context  # 0.19 keeps the step's index buffers in a view
    blocks, local = view.token_to_block_idx, view.token_to_local_position_within_kv_block
    num_blocks, block_size = context.memory_buffer.shape[2], context.memory_buffer.shape[3]
    versions = (blocks._version, local._version, n)
    hit = context.__dict__.get("_rl_kv_slots")
    if hit is not None and hit[0] is blocks and hit[1] is local and hit[2] == versions:
        return hit[3]
    slots = (blocks[:n].remainder(num_blocks) * block_size + local[:n].remainder(block_size)).long()
    context.__dict__["_rl_kv_slots"] = (blocks, local, versions, slots)
    return slots
