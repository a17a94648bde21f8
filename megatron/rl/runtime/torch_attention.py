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


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, block_table=None, **_unused):
    """Variable-length attention over concatenated sequences.

    q: [total_q, heads, dim]; k/v: [total_k, kv_heads, dim], or paged caches
    [num_blocks, block_size, kv_heads, dim] when ``block_table`` [batch, max_blocks] is given.

    A prefill step holds every newly admitted request (128 prompts in an RL rollout phase): the requests
    are padded into batches of at most ``_PREFILL_BATCH_ELEMENTS`` attention scores and each batch is one
    fused SDPA call (a Python loop of per-request attention cost ~8 small ops per request and layer).
    """
    scale = softmax_scale or q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [cq[b + 1] - cq[b] for b in range(len(cq) - 1)]
    lens_k = [ck[b + 1] - ck[b] for b in range(len(ck) - 1)]
    todo = [b for b in range(len(lens_q)) if lens_q[b] > 0 and lens_k[b] > 0]
    heads = q.shape[1]
    start = 0
    while start < len(todo):
        stop, max_q, max_k = start, 0, 0
        while stop < len(todo):
            b = todo[stop]
            mq, mk = max(max_q, lens_q[b]), max(max_k, lens_k[b])
            if stop > start and (stop - start + 1) * heads * mq * mk > _PREFILL_BATCH_ELEMENTS:
                break
            max_q, max_k, stop = mq, mk, stop + 1
        _attend_padded(q, k, v, out, todo[start:stop], cq, ck, lens_q, lens_k, max_q, max_k, scale, causal,
                       block_table)
        start = stop
    return out


# Most attention scores (batch x heads x query x key) one padded prefill SDPA call may hold (128 MB in fp32).
_PREFILL_BATCH_ELEMENTS = 32 * 1024 * 1024


def _attend_padded(q, k, v, out, rows, cq, ck, lens_q, lens_k, max_q, max_k, scale, causal, block_table):
    """Attention of requests ``rows`` as one padded batch; writes their outputs into ``out`` (packed rows)."""
    device = q.device
    n = len(rows)
    row_t = torch.tensor(rows, dtype=torch.long, device=device)
    lq = torch.tensor([lens_q[b] for b in rows], dtype=torch.long, device=device)
    lk = torch.tensor([lens_k[b] for b in rows], dtype=torch.long, device=device)
    qpos = torch.arange(max_q, device=device)
    kpos = torch.arange(max_k, device=device)
    q_valid = qpos[None, :] < lq[:, None]  # [n, Lq]
    q_index = (torch.tensor([cq[b] for b in rows], device=device)[:, None] + qpos[None, :])[q_valid]
    qb = q.new_zeros(n, max_q, *q.shape[1:])
    qb[q_valid] = q[q_index]
    if block_table is not None:
        block_size = k.shape[1]
        num_blocks = (max_k + block_size - 1) // block_size
        ids = block_table[row_t, :num_blocks].long().clamp(min=0).reshape(-1)  # -1 marks unused blocks
        kb = k.index_select(0, ids).view(n, num_blocks * block_size, *k.shape[2:])[:, :max_k]
        vb = v.index_select(0, ids).view(n, num_blocks * block_size, *v.shape[2:])[:, :max_k]
    else:
        k_index = (torch.tensor([ck[b] for b in rows], device=device)[:, None] + kpos[None, :])
        k_index = torch.minimum(k_index, torch.tensor(k.shape[0] - 1, device=device))  # padding reads any row
        kb, vb = k[k_index], v[k_index]
    key_valid = kpos[None, :] < lk[:, None]  # [n, Lk]
    # Cache slots past a request's length hold whatever was there (NaN in the tests): 0 * NaN would leak.
    kb = kb.masked_fill(~key_valid[:, :, None, None], 0.0)
    vb = vb.masked_fill(~key_valid[:, :, None, None], 0.0)
    allowed = key_valid[:, None, :]  # [n, 1, Lk]
    if causal:  # bottom-right aligned: query i of a request sees keys <= i + (lk - lq)
        allowed = allowed & (kpos[None, None, :] <= (qpos[None, :, None] + (lk - lq)[:, None, None]))
    attn = torch.nn.functional.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2).to(q.dtype), vb.transpose(1, 2).to(q.dtype),
        attn_mask=allowed[:, None], scale=scale, enable_gqa=kb.shape[2] != q.shape[1])
    out[q_index] = attn.transpose(1, 2)[q_valid].to(out.dtype)


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

    This runs once per layer per generated token, so it is written for speed: only the first ``max_len``
    cache slots of each request are gathered (one ``index_select`` of token rows; whole blocks would copy
    up to ``block_size - 1`` unused slots per request: 3x the data for 20-token RL rollouts in 64-token
    blocks) and attention is torch's fused SDPA with grouped-query support over exactly those slots.
    """
    batch, q_len, heads, dim = q.shape
    lens = cache_seqlens.long()
    max_len = max(int(lens.max()), 1)
    kv_heads = k_cache.shape[-2]
    if block_table is not None:
        kb, vb = _gather_paged(k_cache, v_cache, block_table, batch, max_len)
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


def _gather_paged(k_cache, v_cache, block_table, batch: int, max_len: int):
    """The first ``max_len`` cache slots of every request, as [batch, max_len, kv_heads, dim] K and V."""
    block_size, kv_heads, dim = k_cache.shape[1:]
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_table[:, :num_blocks].long().clamp(min=0)  # -1 marks unused blocks
    if k_cache.is_contiguous() and v_cache.is_contiguous():
        slots = torch.arange(block_size, device=blocks.device)
        rows = (blocks[:, :, None] * block_size + slots).view(batch, num_blocks * block_size)[:, :max_len]
        kbuf, vbuf = _gather_buffers((batch * max_len, kv_heads, dim), k_cache.dtype, k_cache.device)
        rows = rows.reshape(-1)
        kb = torch.index_select(k_cache.view(-1, kv_heads, dim), 0, rows, out=kbuf)
        vb = torch.index_select(v_cache.view(-1, kv_heads, dim), 0, rows, out=vbuf)
        return kb.view(batch, max_len, kv_heads, dim), vb.view(batch, max_len, kv_heads, dim)
    ids = blocks.reshape(-1)
    shape = (ids.numel(), block_size, kv_heads, dim)
    kbuf, vbuf = _gather_buffers(shape, k_cache.dtype, k_cache.device)
    kb = torch.index_select(k_cache, 0, ids, out=kbuf).view(batch, num_blocks * block_size, kv_heads, dim)
    vb = torch.index_select(v_cache, 0, ids, out=vbuf).view(batch, num_blocks * block_size, kv_heads, dim)
    return kb[:, :max_len], vb[:, :max_len]
