"""Prefilling a prompt once for all the requests of a step that share it (a GRPO group's rollouts).

:class:`SharedPromptPrefill` is a mixin for megatron-core 0.16.1's ``DynamicInferenceContext``: a request added
in full with the prompt of a request already added in the same step (its leader) enters with only its last
prompt token, and after every layer the leader's first ``L - 1`` cache slots are copied into its own. From the
next step on it is an ordinary request. Not used for hybrid (Mamba) models or MLA caches; on megatron-core 0.19
the engine uses core's prefix caching instead (:func:`megatron_core_shares_prompts`). Why and what it costs:
docs/inference.md.
"""
from __future__ import annotations

from typing import Any

import torch

from megatron.rl.inference.engine.batched_admission import BatchedAdmission
from megatron.rl.runtime import versions
from megatron.rl.runtime.prefix_cache import forget_cached_prefixes
from megatron.rl.runtime.ranges import concat_ranges

__all__ = ["SharedPromptPrefill", "megatron_core_shares_prompts", "forget_shared_prompts", "shared_prefill_tokens"]


def megatron_core_shares_prompts() -> bool:
    """Whether the installed megatron-core shares prompt KV blocks itself (0.19's prefix caching), so that
    ``EngineSettings.share_prompt_prefill`` turns that on rather than :class:`SharedPromptPrefill`."""
    return versions.is_0_19()


def forget_shared_prompts(context: Any) -> None:
    """Let no request admitted from now on share the KV blocks cached so far (megatron-core 0.19's prefix cache):
    after a pause in which the weights may have changed, those blocks hold the old weights' keys and values
    (:func:`megatron.rl.runtime.prefix_cache.forget_cached_prefixes`, a registered change). No-op without prefix
    caching (0.16.1's :class:`SharedPromptPrefill` shares within one step only, never across a pause)."""
    forget_cached_prefixes(context)


def shared_prefill_tokens(engine: Any) -> int:
    """Prompt tokens ``engine``'s context did not compute because another request's keys and values served them,
    since the engine was built (a diagnostic): :class:`SharedPromptPrefill`'s count, or megatron-core 0.19's
    prefix-cache count (the engine drains the context's count into its own total after every step)."""
    context = engine.context
    if isinstance(context, SharedPromptPrefill):
        return context.shared_prefill_tokens
    return int(getattr(engine, "_prefill_tokens_skipped", 0)) + int(
        getattr(context, "prefix_cache_prefill_skipped_tokens", 0))

# The per-token arrays megatron-core 0.16.1's ``add_request`` fills for each prompt token of the step.
_TOKEN_ARRAYS = ("token_to_pos_ids", "token_to_input_ids", "token_to_request_idx", "token_to_position_in_request",
                 "token_to_block_idx", "token_to_local_position_within_kv_block")


class SharedPromptPrefill:
    """Mixin over ``DynamicInferenceContext`` (put it first in the bases); see the module docstring."""

    def _shared_state(self) -> dict[str, Any]:
        # Kept in __dict__ under one key: the context's constructor runs before any of our methods.
        state = self.__dict__.get("_rl_shared_prefill")
        if state is None:
            state = self.__dict__["_rl_shared_prefill"] = {"leaders": {}, "plan": None, "pairs": [],
                                                            "shared_tokens": 0}
        return state

    def _clear_shared(self) -> None:
        state = self._shared_state()
        state["leaders"].clear()
        state["pairs"].clear()
        state["plan"] = None

    def shared_prefill_pairs(self) -> list[tuple[int, int, int]]:
        """This step's followers: (follower slot, leader slot, prompt positions whose keys and values it takes from
        the leader), until the step's ``update_requests`` (MoE route recording reads them after the forward)."""
        return list(self._shared_state()["pairs"])

    @property
    def shared_prefill_tokens(self) -> int:
        """Prompt tokens not computed because a leader's were copied, since construction (a diagnostic)."""
        return self._shared_state()["shared_tokens"]

    def add_request(self, req: Any, chunk_length: int | None = None) -> None:
        whole = req.finished_chunk_token_count == 0 and chunk_length in (None, req.remaining_prompt_length)
        length = req.remaining_prompt_length
        if not whole or length < 2 or self.is_hybrid_model or self.cache_mla_latent:
            return super().add_request(req, chunk_length)
        state = self._shared_state()
        key = tuple(req.remaining_prompt_tokens.tolist())
        leader = state["leaders"].get(key)
        start, index = self.active_token_count, self.total_request_count
        super().add_request(req, chunk_length)
        if leader is None:
            state["leaders"][key] = index
            return
        # Keep only the last prompt token in the step. Admitted in a batch (BatchedAdmission): say so before its
        # entries are written; else move its last token's entries to the request's first token row.
        if not (isinstance(self, BatchedAdmission) and self.follow(index)):
            last = start + length - 1
            for name in _TOKEN_ARRAYS:
                array = getattr(self, name)
                array[start] = array[last]
            self.active_token_count = start + 1
            self.request_query_lengths[index] = 1
            self.request_kv_length_offsets[index] = length - 1
        state["plan"] = None
        state["pairs"].append((index, leader, length - 1))
        state["shared_tokens"] += length - 1

    def _copy_plan(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat cache slots (``block * block_size + offset``): the leaders' first positions and the followers' same
        positions, for every follower of the step (read from the block table once the step's entries are written)."""
        pairs = self._shared_state()["pairs"]
        table = self.request_to_kv_block_ids
        owner, positions = concat_ranges([0] * len(pairs), [n for _, _, n in pairs], table.device)
        followers = torch.tensor([f for f, _, _ in pairs], device=table.device)[owner]
        leaders = torch.tensor([lead for _, lead, _ in pairs], device=table.device)[owner]
        size = self.block_size_tokens
        block, offset = positions // size, positions % size
        return table[leaders, block].long() * size + offset, table[followers, block].long() * size + offset

    def append_key_value_cache(self, layer_number: int, key: torch.Tensor, value: torch.Tensor) -> None:
        super().append_key_value_cache(layer_number, key, value)
        state = self._shared_state()
        if not state["pairs"]:
            return
        if state["plan"] is None:
            state["plan"] = self._copy_plan()
        src, dst = state["plan"]
        layer = self.layer_map[layer_number - 1]
        for cache in (self.memory_buffer[0, layer], self.memory_buffer[1, layer]):
            flat = cache.view(-1, *cache.shape[2:])  # [blocks * block_size, heads, dim]
            flat.index_copy_(0, dst, flat.index_select(0, src))

    def update_requests(self, *args: Any, **kwargs: Any):
        self._clear_shared()  # the step ran: its leaders are ordinary requests from here on
        return super().update_requests(*args, **kwargs)

    def reset(self) -> None:
        self._clear_shared()
        return super().reset()
