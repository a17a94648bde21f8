"""megatron-core 0.19's prefix cache, emptied of the prompt blocks cached so far (a registered change).

0.19's context shares whole prompt KV blocks between requests through its block allocator's hash maps
(``kv_hash_to_block_id``, ``block_hashes``). After a pause in which the weights may have changed, those blocks hold
the old weights' keys and values, and a request admitted afterwards must not take them. megatron-core has no public
call that forgets them without freeing the blocks (its ``reset`` releases every request's blocks), so this empties
the maps in place.
"""
from __future__ import annotations

from typing import Any

from megatron.rl.runtime import versions
from megatron.rl.runtime.patches import register

__all__ = ["FORGET_CACHED_PREFIXES", "forget_cached_prefixes"]

FORGET_CACHED_PREFIXES = "prefix cache: forget the cached prompt blocks"


@register(FORGET_CACHED_PREFIXES, when="on call",
          changes="megatron.core.inference.contexts.kv_block_allocator:KVBlockAllocator (its kv_hash_to_block_id "
                  "emptied, its block_hashes set to -1)",
          why="after a pause in which the weights may change, requests admitted later must not share prompt blocks "
              "computed with the old weights; the requests holding them keep them, and each block returns to the "
              "pool when its last holder releases it (0.19's default eviction frees a block at reference count "
              "zero, registered or not)",
          versions=versions.MCORE_0_19)
def forget_cached_prefixes(context: Any) -> None:
    """Let no request admitted from now on share the KV blocks ``context``'s prefix cache holds. No-op for a context
    without prefix caching."""
    allocator = getattr(context, "kv_block_allocator", None)
    if allocator is None or not getattr(context, "enable_prefix_caching", False):
        return
    allocator.kv_hash_to_block_id.clear()
    allocator.block_hashes.fill_(-1)
