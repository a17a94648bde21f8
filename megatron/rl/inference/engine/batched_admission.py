"""Admitting a step's new requests to megatron-core's dynamic context in one batch of tensor writes.

:class:`BatchedAdmission` is a ``DynamicInferenceContext`` mixin: ``add_request`` of a whole request does at once
only what scheduling reads before the forward (checks, KV-block allocation, counts) and queues the rest;
``initialize_attention_state`` then writes the queued entries with one write per array, the same values
megatron-core writes (a test compares every array). Chunks, hybrid models and (0.19) prefix-cache hits go
through megatron-core's own code. :meth:`follow` marks a shared-prefill follower.

Why, and the 0.19 differences: docs/inference.md.
"""
from __future__ import annotations

import dataclasses
from typing import Any

import torch

from megatron.rl.runtime import versions
from megatron.rl.runtime.ranges import concat_ranges

__all__ = ["BatchedAdmission"]


@dataclasses.dataclass
class _Queued:
    index: int  # the request's slot in the context
    request_id: int
    tokens: torch.Tensor  # the whole prompt (the engine empties the request's own copy after add_request)
    output_length: int
    metadata: list[Any]
    blocks: torch.Tensor  # its KV blocks, in order (a view of the allocator's bag, unchanged until the step runs)
    kept_from: int = 0  # prompt positions before this are not in the step (a follower keeps only its last token)


class BatchedAdmission:
    """Mixin over ``DynamicInferenceContext`` (before it in the bases); see the module docstring."""

    def _queued(self) -> list[_Queued]:
        # Kept in __dict__: megatron-core's constructor runs before any of our methods.
        return self.__dict__.setdefault("_rl_admission_queue", [])

    def add_request(self, req: Any, chunk_length: int | None = None, **kwargs: Any) -> None:
        chunk_length = kwargs.pop("prefill_chunk_length", chunk_length)  # its name on 0.19
        length = req.remaining_prompt_length
        whole = req.finished_chunk_token_count == 0 and chunk_length in (None, length)
        if not whole or self.is_hybrid_model or not self.is_tensor_state_allocated:
            self.write_admissions()
            return super().add_request(req, chunk_length)
        if versions.is_0_19():
            return self._queue_0_19(req, length)
        from megatron.core.inference.contexts.dynamic_context import (BlockOverflowError, RequestOverflowError,
                                                                      TokenOverflowError)

        # megatron-core's checks, in its order (a failing one leaves the same state behind)
        assert length > 0, "Chunk length is 0"
        if self.active_token_count + length > self.max_tokens:
            raise TokenOverflowError(req.request_id)
        num_blocks = (length + self.block_size_tokens - 1) // self.block_size_tokens
        blocks = self.block_allocator.allocate_memory_blocks(num_blocks)
        if blocks is None or len(blocks) != num_blocks:
            raise BlockOverflowError(req.request_id)
        index = self.total_request_count
        if index >= self.max_requests:
            raise RequestOverflowError(req.request_id)
        assert req.get_metadata_types() == self.request_metadata_types, \
            "Request added to context with invalid metadata types"
        self._queued().append(_Queued(index, req.request_id, req.remaining_prompt_tokens[:length],
                                      length + req.sampling_params.num_tokens_to_generate, req.tracked_metadata,
                                      blocks))
        self.active_token_count += length
        self.total_request_count += 1
        self.num_prefill_requests += 1

    def _queue_0_19(self, req: Any, length: int) -> None:
        """megatron-core 0.19's ``add_request`` of a whole prompt without a prefix-cache hit, its writes queued."""
        from megatron.core.inference.contexts.dynamic_context import (BlockOverflowError, RequestOverflowError,
                                                                      TokenOverflowError)

        assert length > 0, "Chunk length is 0"
        matched, from_pool = self._compute_prefix_match(req, length, record_mamba_match=True)[:2]
        if matched:  # megatron-core pins and counts the shared blocks: its own code, after what is queued
            self.write_admissions()
            return super().add_request(req)
        blocks = self.kv_block_allocator.allocate_memory_blocks(from_pool)
        if blocks is None or len(blocks) != from_pool:
            raise BlockOverflowError(req.request_id)
        index = self.total_request_count
        if index >= self.max_requests:
            raise RequestOverflowError(req.request_id)
        if self.active_token_count + length > self.max_tokens:
            raise TokenOverflowError(req.request_id)
        assert req.get_metadata_types() == self.request_metadata_types, \
            "Request added to context with invalid metadata types"
        self._queued().append(_Queued(index, req.request_id, req.remaining_prompt_tokens[:length],
                                      length + req.sampling_params.num_tokens_to_generate, req.tracked_metadata,
                                      blocks))
        hashes = req.precomputed_block_hashes[:length // self.block_size_tokens] if self.enable_prefix_caching else []
        if hashes:  # the prompt's whole blocks, as megatron-core registers them on admission
            self.kv_block_allocator.register_kv_block_hashes(blocks[:len(hashes)].tolist(), list(hashes),
                                                             [0, *hashes[:-1]])
        self.active_token_count += length
        self.lifetime_prefill_token_count += length
        if self.enable_prefix_caching:
            self.prefix_cache_prefill_computed_tokens += length
        self.total_request_count += 1
        self.num_prefill_requests += 1

    def follow(self, index: int) -> bool:
        """Make the queued request in slot ``index`` enter with its last prompt token only (a shared-prefill
        follower; its earlier positions' keys and values come from elsewhere). False if it is not queued."""
        queued = self._queued()
        if not queued or queued[-1].index != index:
            return False
        entry = queued[-1]
        self.active_token_count -= len(entry.tokens) - 1
        entry.kept_from = len(entry.tokens) - 1
        return True

    def initialize_attention_state(self, *args: Any, **kwargs: Any) -> None:
        self.write_admissions()
        return super().initialize_attention_state(*args, **kwargs)

    def reset(self, *args: Any, **kwargs: Any) -> None:
        self._queued().clear()
        return super().reset(*args, **kwargs)

    def deallocate_all_tensors(self, *args: Any, **kwargs: Any) -> Any:
        self._queued().clear()
        return super().deallocate_all_tensors(*args, **kwargs)

    def write_admissions(self) -> None:
        """Write the queued requests' entries into the context's arrays (what megatron-core's ``add_request``
        would have written for each)."""
        queued = self._queued()
        if not queued:
            return
        self.__dict__["_rl_admission_queue"] = []
        size = self.block_size_tokens
        slots = self.request_query_lengths.device

        def column(values: list, like: torch.Tensor) -> torch.Tensor:
            return torch.tensor(values, dtype=like.dtype, device=like.device)

        index = torch.tensor([q.index for q in queued], dtype=torch.long, device=slots)
        lengths = [len(q.tokens) for q in queued]
        kept = [n - q.kept_from for n, q in zip(lengths, queued)]
        self.request_ids[index] = column([q.request_id for q in queued], self.request_ids)
        for i, (label, *_) in enumerate(self.request_metadata_types):  # 0.19: (label, dtype) pairs
            target = self.request_metadata[label]
            values = [q.metadata[i] for q in queued]
            if any(isinstance(v, torch.Tensor) for v in values):
                for row, v in zip(index.tolist(), values):  # tensors as megatron-core assigns them, one by one
                    target[row] = v if isinstance(v, torch.Tensor) else torch.as_tensor(v, device=target.device,
                                                                                         dtype=target.dtype)
            else:
                target[index] = column(values, target)
        self.request_query_lengths[index] = column(kept, self.request_query_lengths)
        if versions.is_0_19():
            self.request_in_prefill_status_tensor[index] = 1
        self.request_output_lengths[index] = column([q.output_length for q in queued], self.request_output_lengths)
        self.request_kv_length_offsets[index] = column([q.kept_from for q in queued], self.request_kv_length_offsets)
        counts = [len(q.blocks) for q in queued]
        self.request_kv_block_counts[index] = column(counts, self.request_kv_block_counts)
        blocks = torch.cat([q.blocks for q in queued]).to(self.request_to_kv_block_ids.device)
        owner, cols = concat_ranges([0] * len(queued), counts, blocks.device)
        self.request_to_kv_block_ids[index.to(blocks.device)[owner], cols] = blocks.to(
            self.request_to_kv_block_ids.dtype)
        last = torch.tensor(counts, dtype=torch.long, device=slots) - 1
        self.request_last_kv_block_id[index] = self.request_to_kv_block_ids[index, last].to(
            self.request_last_kv_block_id.dtype)
        self.request_last_kv_block_offset[index] = column([(n - 1) % size for n in lengths],
                                                          self.request_last_kv_block_offset)

        # The step's token rows: each queued request's kept prompt positions, in admission order, contiguous.
        first = self.active_token_count - sum(kept)
        end = self.active_token_count
        device = self.token_to_pos_ids.device
        owner, positions = concat_ranges([q.kept_from for q in queued], lengths, device)
        request_rows = index.to(device)[owner]
        self.token_to_pos_ids[first:end] = positions
        self.token_to_input_ids[first:end] = torch.cat([q.tokens[q.kept_from:] for q in queued]).to(device)
        self.token_to_request_idx[first:end] = request_rows
        self.token_to_position_in_request[first:end] = positions
        self.token_to_block_idx[first:end] = self.request_to_kv_block_ids[request_rows, positions // size]
        self.token_to_local_position_within_kv_block[first:end] = positions % size
