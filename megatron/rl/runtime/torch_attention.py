"""Pure-torch stand-ins for flash-attn's paged kernels, used by megatron-core's dynamic inference.

megatron-core's dynamic-batching attention calls ``flash_attn_varlen_func`` (prefill, paged KV
through ``block_table``) and ``flash_attn_with_kvcache`` (decode). Both are CUDA-only; these
functions have the same calling convention and semantics (causal masks aligned bottom-right, as
flash-attn does when query and key lengths differ) and run anywhere.
"""
from __future__ import annotations

import math
import threading

import torch


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, length: int) -> torch.Tensor:
    """cache [num_blocks, block_size, heads, dim], block ids of one request -> [length, heads, dim]."""
    block_size = cache.shape[1]
    num_blocks = (length + block_size - 1) // block_size
    return cache[block_ids[:num_blocks].long()].reshape(-1, *cache.shape[2:])[:length]


def _expand_kv_heads(k: torch.Tensor, v: torch.Tensor, num_q_heads: int, head_dim_axis: int):
    """Grouped-query attention: repeat each KV head for the query heads that share it."""
    num_kv_heads = k.shape[head_dim_axis]
    if num_kv_heads == num_q_heads:
        return k, v
    rep = num_q_heads // num_kv_heads
    return k.repeat_interleave(rep, dim=head_dim_axis), v.repeat_interleave(rep, dim=head_dim_axis)


def _attend(q, k, v, scale: float, causal: bool) -> torch.Tensor:
    """q [Lq, h, d], k/v [Lk, h_kv, d] -> [Lq, h, d]."""
    k, v = _expand_kv_heads(k, v, q.shape[1], head_dim_axis=1)
    scores = torch.einsum("qhd,khd->hqk", q.float(), k.float()) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        allowed = torch.ones(lq, lk, dtype=torch.bool, device=q.device).tril(diagonal=lk - lq)
        scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return torch.einsum("hqk,khd->qhd", probs, v.float()).to(q.dtype)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, block_table=None, **_unused):
    """Variable-length attention over concatenated sequences.

    q: [total_q, heads, dim]; k/v: [total_k, kv_heads, dim], or paged caches
    [num_blocks, block_size, kv_heads, dim] when ``block_table`` [batch, max_blocks] is given.
    """
    scale = softmax_scale or q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(len(cq) - 1):
        lq, lk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if lq <= 0 or lk <= 0:
            continue
        if block_table is not None:
            kb, vb = _gather_blocks(k, block_table[b], lk), _gather_blocks(v, block_table[b], lk)
        else:
            kb, vb = k[ck[b]:ck[b + 1]], v[ck[b]:ck[b + 1]]
        out[cq[b]:cq[b + 1]] = _attend(q[cq[b]:cq[b + 1]], kb, vb, scale, causal)
    return out


_BUFFERS = threading.local()


def _gather_buffers(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Two reusable tensors of ``shape`` for the gathered K and V blocks, grown on demand, one pair per thread.

    The gathered cache is tens of MB per layer and step at moderate sizes; allocated afresh, glibc hands
    such blocks back to the OS on free and every step pays the page faults again (2-5x the cost of the copy
    itself). A layer's gather is consumed before the next layer's starts, so one pair serves all layers.
    """
    numel = math.prod(shape)
    key = (dtype, device)
    pairs = getattr(_BUFFERS, "pairs", None)
    if pairs is None:
        pairs = _BUFFERS.pairs = {}
    pair = pairs.get(key)
    if pair is None or pair[0].numel() < numel:
        grown = max(numel, 2 * pair[0].numel()) if pair is not None else numel
        pair = pairs[key] = (torch.empty(grown, dtype=dtype, device=device),
                             torch.empty(grown, dtype=dtype, device=device))
    return pair[0][:numel].view(shape), pair[1][:numel].view(shape)


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False, block_table=None,
                            softmax_scale=None, **_unused):
    """Decode-step attention against a (paged) KV cache, vectorised over the batch.

    q: [batch, q_len, heads, dim]; caches [num_blocks, block_size, kv_heads, dim] with
    ``block_table`` [batch, max_blocks], or [batch, max_len, kv_heads, dim] without.
    ``cache_seqlens`` [batch]: valid cache length per request (including the new tokens).

    This runs once per layer per generated token, so it is written for speed: the blocks are gathered
    with ``index_select`` (a copy, cheaper than advanced indexing) and attention is torch's fused SDPA
    with grouped-query support (about half of a CPU decode step was spent here with einsum).
    """
    batch, q_len, heads, dim = q.shape
    lens = cache_seqlens.long()
    max_len = max(int(lens.max()), 1)
    kv_heads = k_cache.shape[-2]
    if block_table is not None:
        block_size = k_cache.shape[1]
        num_blocks = (max_len + block_size - 1) // block_size
        ids = block_table[:, :num_blocks].long().clamp(min=0).reshape(-1)  # -1 marks unused blocks
        shape = (ids.numel(), *k_cache.shape[1:])
        kbuf, vbuf = _gather_buffers(shape, k_cache.dtype, k_cache.device)
        kb = torch.index_select(k_cache, 0, ids, out=kbuf).view(batch, num_blocks * block_size, kv_heads, dim)
        vb = torch.index_select(v_cache, 0, ids, out=vbuf).view(batch, num_blocks * block_size, kv_heads, dim)
    else:
        kb, vb = k_cache[:, :max_len], v_cache[:, :max_len]
    key_pos = torch.arange(kb.shape[1], device=q.device)
    allowed = (key_pos[None, :] < lens[:, None])[:, None, None, :]  # [b, 1, 1, k]
    if causal and q_len > 1:
        query_pos = torch.arange(q_len, device=q.device)[None, :, None] + (lens[:, None, None] - q_len)
        allowed = allowed & (key_pos[None, None, :] <= query_pos)[:, None]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=allowed, scale=softmax_scale,
        enable_gqa=kv_heads != heads)
    return out.transpose(1, 2).nan_to_num(0.0).to(q.dtype)  # a request with no valid key -> zeros
