"""Pure-torch stand-ins for flash-attn's paged kernels, used by megatron-core's dynamic inference.

Same calling convention and semantics as ``flash_attn_varlen_func`` (prefill) and ``flash_attn_with_kvcache``
(decode), causal masks aligned bottom-right, and the formula and tensor layouts of megatron-core's
``DotProductAttention``, so the engine's log-probs round like the trainer's. Each request's attention uses at
least :data:`MIN_QUERY_ROWS` query rows, so a decode step does not take a matrix-vector kernel that rounds
otherwise.

Why: docs/runtime.md; figures: docs/benchmarks.md.
"""
from __future__ import annotations

import dataclasses
import math
import threading

import torch

from megatron.rl.runtime import decode_mirror
from megatron.rl.runtime.decode_lengths import padded_key_slots, step_host
from megatron.rl.runtime.length_groups import length_groups


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q=None, max_seqlen_k=None,
                           softmax_scale=None, causal=False, block_table=None, **_unused):
    """Variable-length attention over concatenated sequences.

    q: [total_q, heads, dim]; k/v: [total_k, kv_heads, dim], or paged caches
    [num_blocks, block_size, kv_heads, dim] when ``block_table`` [batch, max_blocks] is given.

    A prefill step holds every newly admitted request (128 prompts in an RL rollout phase): the requests, grouped
    by key length and then by query rows (:func:`_query_length_parts`), are padded into batches of at most
    ``_PREFILL_BATCH_ELEMENTS`` attention scores and each batch is one
    :func:`dot_product_attention` call (a Python loop of per-request attention cost ~8 small ops per request
    and layer). Paged K and V are gathered as in decode (:func:`_paged_rows`: only the slots in use, heads
    already repeated). With a paged cache the batches, masks and indices are worked out once per step (as for
    decode, keyed on the step's length and block-table tensors) and reused by every layer.
    """
    scale = softmax_scale or q.shape[-1] ** -0.5
    out = torch.zeros_like(q)
    if block_table is None:
        batches = _prefill_batches(cu_seqlens_q, cu_seqlens_k, None, q.shape, k.shape, causal)
    else:
        key = (q.shape, k.shape, causal, cu_seqlens_q._version, cu_seqlens_k._version, block_table._version,
               split_overhead_slots(q.shape[1] * q.shape[-1], q.device), MIN_KEY_SLOTS, MIN_QUERY_ROWS)
        cached = getattr(_STEP_PLAN, "prefill", None)
        if (cached is not None and cached[0] is cu_seqlens_q and cached[1] is cu_seqlens_k
                and cached[2] is block_table and cached[3] == key):
            batches = cached[4]
        else:
            batches = _prefill_batches(cu_seqlens_q, cu_seqlens_k, block_table, q.shape, k.shape, causal)
            _STEP_PLAN.prefill = (cu_seqlens_q, cu_seqlens_k, block_table, key, batches)
    for batch in batches:
        _attend_padded(q, k, v, out, batch, scale)
    return out


# Most attention scores (batch x heads x query x key) one padded prefill batch may hold (128 MB in fp32).
_PREFILL_BATCH_ELEMENTS = 32 * 1024 * 1024


@dataclasses.dataclass
class _PrefillBatch:
    """Requests attended as one padded batch in a prefill step: what every layer of the step shares."""

    rows: list[int]  # the requests (indices into the step's batch)
    n: int
    rows_q: int  # query rows per request (>= MIN_QUERY_ROWS)
    max_k: int  # key slots per request (>= MIN_KEY_SLOTS)
    q_valid: torch.Tensor  # [n, rows_q]: real query rows
    q_index: torch.Tensor  # the packed rows of q (and of the output) of the real query rows, in order
    masked: torch.Tensor  # [n, 1, rows_q, max_k]
    gather_rows: torch.Tensor | None  # paged: rows of the flattened caches (see _paged_rows)
    k_index: torch.Tensor | None  # dense: [n, max_k] rows of k / v
    key_valid: torch.Tensor  # [n, max_k]


def _prefill_batches(cu_seqlens_q, cu_seqlens_k, block_table, q_shape, k_shape, causal) -> list[_PrefillBatch]:
    """The padded batches of a prefill step (requests of similar key lengths together, see
    :func:`flash_attn_with_kvcache`: a step that admits new prompts also decodes the requests in flight, a few
    hundred tokens long with partial rollouts)."""
    device = cu_seqlens_q.device
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    lens_q = [cq[b + 1] - cq[b] for b in range(len(cq) - 1)]
    lens_k = [ck[b + 1] - ck[b] for b in range(len(ck) - 1)]
    todo = [b for b in range(len(lens_q)) if lens_q[b] > 0 and lens_k[b] > 0]
    heads = q_shape[1]
    overhead = split_overhead_slots(heads * q_shape[-1], device)
    batches = []
    for group in _query_length_parts(todo, lens_q, lens_k, overhead):
        start = 0
        while start < len(group):
            stop, max_q, max_k = start, 0, 0
            while stop < len(group):
                b = group[stop]
                mq, mk = max(max_q, lens_q[b]), max(max_k, lens_k[b])
                if stop > start and (stop - start + 1) * heads * mq * mk > _PREFILL_BATCH_ELEMENTS:
                    break
                max_q, max_k, stop = mq, mk, stop + 1
            rows = group[start:stop]
            batches.append(_prefill_batch(rows, cq, ck, lens_q, lens_k, max_q, max_k, block_table, q_shape,
                                          k_shape, causal, device))
            start = stop
    return batches


def _query_length_parts(todo: list[int], lens_q: list[int], lens_k: list[int], overhead: int) -> list[list[int]]:
    """Requests of similar key lengths, then of similar query lengths: a group's rollouts after a shared prompt
    (one query row each) are not padded to the query rows of the request that computes the prompt."""
    parts = []
    for part in length_groups([lens_k[b] for b in todo], overhead):
        group = [todo[i] for i in part]
        # a padded batch costs every request the longest query's rows x the longest key's slots
        row_overhead = max(1, overhead // max(max(lens_k[b] for b in group), MIN_KEY_SLOTS))
        rows = [max(lens_q[b], MIN_QUERY_ROWS) for b in group]
        parts += [[group[i] for i in sub] for sub in length_groups(rows, row_overhead)]
    return parts


def _prefill_batch(rows, cq, ck, lens_q, lens_k, max_q, max_k, block_table, q_shape, k_shape, causal,
                   device) -> _PrefillBatch:
    lq = torch.tensor([lens_q[b] for b in rows], dtype=torch.long, device=device)
    lk = torch.tensor([lens_k[b] for b in rows], dtype=torch.long, device=device)
    rows_q = max(max_q, MIN_QUERY_ROWS)
    max_k = max(max_k, MIN_KEY_SLOTS)
    qpos = torch.arange(rows_q, device=device)
    kpos = torch.arange(max_k, device=device)
    q_valid = qpos[None, :] < lq[:, None]  # [n, Lq]
    q_index = (torch.tensor([cq[b] for b in rows], device=device)[:, None] + qpos[None, :])[q_valid]
    key_valid = kpos[None, :] < lk[:, None]  # [n, Lk]
    gather_rows = k_index = None
    if block_table is not None:  # each request's first max_k slots, heads repeated, in megatron's K/V layout
        row_t = torch.tensor(rows, dtype=torch.long, device=device)
        gather_rows = _paged_rows(block_table[row_t], key_valid, k_shape[1], k_shape[2], q_shape[1])
    else:
        k_index = (torch.tensor([ck[b] for b in rows], device=device)[:, None] + kpos[None, :])
        k_index = torch.minimum(k_index, torch.tensor(k_shape[0] - 1, device=device))  # padding reads any row
    allowed = key_valid[:, None, :]  # [n, 1, Lk]
    if causal:  # bottom-right aligned: query i of a request sees keys <= i + (lk - lq)
        allowed = allowed & (kpos[None, None, :] <= (qpos[None, :, None] + (lk - lq)[:, None, None]))
    return _PrefillBatch(rows, len(rows), rows_q, max_k, q_valid, q_index, ~allowed[:, None], gather_rows, k_index,
                         key_valid)


def _attend_padded(q, k, v, out, batch: _PrefillBatch, scale):
    """Attention of one padded prefill batch; writes its outputs into ``out`` (packed rows)."""
    qb = q.new_zeros(batch.rows_q, batch.n, *q.shape[1:])  # megatron's [sq, b, heads, dim] layout
    qb.transpose(0, 1)[batch.q_valid] = q[batch.q_index]
    if batch.gather_rows is not None:
        key, value = _gather_rows(k, v, batch.gather_rows, (batch.max_k, batch.n, q.shape[1], k.shape[-1]))
        key, value = key.to(q.dtype), value.to(q.dtype)
    else:
        key = k[batch.k_index].transpose(0, 1).to(q.dtype)
        value = _zero_invalid(v[batch.k_index], batch.key_valid).transpose(0, 1)
    attn = dot_product_attention(qb, key, value, batch.masked, scale)
    out[batch.q_index] = attn.transpose(0, 1)[batch.q_valid].to(out.dtype)


# See the module docstring: MKL's batched products take other kernels for fewer than 4 rows than for the
# trainer's many rows (1-3 rows round differently, 4 and more give the many-row product's bits; the gaps:
# docs/benchmarks.md, "Train-inference log-prob gap").
MIN_QUERY_ROWS = 4
# Keys (masked past a request's length) every product runs over at least: the softmax and the product with V
# may round differently below 16 keys than from 16 on (they do on AVX-512 CPUs, not on AVX2 ones; from 16 on, more
# masked keys change no bit), and the trainer attends over its micro-batch's row length, nearly always >= 16
# (tests/unit_tests/rl/runtime).
MIN_KEY_SLOTS = 16


def dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, masked: torch.Tensor,
                          scale: float, real_rows: int | None = None) -> torch.Tensor:
    """megatron-core 0.16.1 ``DotProductAttention.forward``'s arithmetic (fp32, no dropout, no softmax offset).

    query: [sq, b, heads, dim]; key/value: [sk, b, kv_heads, dim]; masked: bool [b, 1, sq, sk], True = masked
    (filled with -10000 before the softmax, as megatron's ``attention_mask_func``). Returns [sq, b, heads, dim].
    ``real_rows``: only the first this many query rows are used (the rest are zeros that give the products their
    row count): the softmax skips the others, and their rows of the result are not meaningful.
    Same operations in the same layouts as the trainer's attention, so the results round the same way;
    ``test_torch_attention.py`` checks it bit for bit against the module.
    """
    heads, kv_heads = query.shape[2], key.shape[2]
    if heads // kv_heads > 1:
        key = key.repeat_interleave(heads // kv_heads, dim=2)
        value = value.repeat_interleave(heads // kv_heads, dim=2)
    sq, b, _, dim = query.shape
    sk = key.shape[0]
    scores = torch.baddbmm(query.new_empty(b * heads, sq, sk), query.reshape(sq, b * heads, dim).transpose(0, 1),
                           key.reshape(sk, b * heads, dim).transpose(0, 1).transpose(1, 2), beta=0.0, alpha=scale)
    if real_rows is None or real_rows >= sq:
        probs = torch.softmax(scores.view(b, heads, sq, sk).masked_fill(masked, -10000.0), dim=-1)
    else:  # the softmax is per row: the real rows' probabilities go over their scores, the zero rows' scores stay
        real = scores.view(b, heads, sq, sk)[:, :, :real_rows]
        real.copy_(torch.softmax(real.masked_fill(masked, -10000.0), dim=-1))
        probs = scores
    context = torch.bmm(probs.view(b * heads, sq, sk), value.reshape(sk, b * heads, dim).transpose(0, 1))
    return context.view(b, heads, sq, dim).permute(2, 0, 1, 3)


def _zero_invalid(values: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Zero cache slots past a request's length ([b, k, ...] with valid [b, k]): they hold whatever was there
    (NaN in the tests), and a zero probability times NaN would leak into the output."""
    return values.masked_fill(~valid[:, :, None, None], 0.0)


def mirror_min_elements(capability: str) -> int:
    """Below this many elements of K (padded batch x slots x KV heads x dim) a decode step gathers instead of reading
    the mirror: a small gather undercuts the mirror's scattered per-layer copies of the new tokens. ``capability`` as
    ``torch.backends.cpu.get_cpu_capability()``. Measured (docs/benchmarks.md): on an AMD EPYC with AVX-512 the
    gather was cheaper up to 0.6M elements and the mirror from 1.2M; on one with AVX2 the mirror was cheaper from
    256K. Other AVX2 CPUs take the AVX2 figure; the rest (AVX-512 and AMX Intel CPUs not measured) keep 1M."""
    return 1 << 18 if capability == "AVX2" else 1 << 20


# The next step that reads the mirror copies what the steps that gathered left out.
MIRROR_MIN_ELEMENTS = mirror_min_elements(torch.backends.cpu.get_cpu_capability())

_BUFFERS = threading.local()
# Pairs handed back by threads that stopped stepping an engine (release_thread_buffers), for the next thread:
# each rollout phase runs its engine on a new thread, and fresh buffers page-fault again on first touch.
# Keyed by (dtype, device, inference tensor?): a tensor made under ``torch.inference_mode`` (the engine's steps)
# cannot be written outside it.
_FREE_PAIRS: dict[tuple[torch.dtype, torch.device, bool], tuple[torch.Tensor, torch.Tensor]] = {}
_FREE_LOCK = threading.Lock()


def _gather_buffers(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device):
    """Two reusable tensors of ``shape`` for the gathered K and V blocks, grown on demand, one pair per thread.

    The gathered cache is tens of MB per layer and step at moderate sizes; allocated afresh, glibc hands
    such blocks back to the OS on free and every step pays the page faults again (2-5x the cost of the copy
    itself). A layer's gather is consumed before the next layer's starts, so one pair serves all layers.
    A thread without a pair takes one a finished engine thread handed back (:func:`release_thread_buffers`).
    """
    numel = math.prod(shape)
    key = (dtype, device)
    pairs = getattr(_BUFFERS, "pairs", None)
    if pairs is None:
        pairs = _BUFFERS.pairs = {}
    pair = pairs.get(key)
    if pair is None:
        with _FREE_LOCK:
            pair = _FREE_PAIRS.pop((dtype, device, torch.is_inference_mode_enabled()), None)
        if pair is not None:
            pairs[key] = pair
    if pair is None or pair[0].numel() < numel:
        grown = max(numel, 2 * pair[0].numel()) if pair is not None else numel
        pair = pairs[key] = (torch.empty(grown, dtype=dtype, device=device),
                             torch.empty(grown, dtype=dtype, device=device))
    return pair[0][:numel].view(shape), pair[1][:numel].view(shape)


def release_thread_buffers() -> None:
    """Hand this thread's gather buffers to the next thread that attends (call when it stops stepping an engine).

    One pair per dtype and device is kept (the larger); CPU only: GPU memory goes back to training.
    """
    decode_mirror.release()
    pairs = getattr(_BUFFERS, "pairs", None) or {}
    _BUFFERS.pairs = {}
    with _FREE_LOCK:
        for (dtype, device), pair in pairs.items():
            key = (dtype, device, pair[0].is_inference())
            kept = _FREE_PAIRS.get(key)
            if device.type == "cpu" and (kept is None or kept[0].numel() < pair[0].numel()):
                _FREE_PAIRS[key] = pair


def flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=None, causal=False, block_table=None,
                            softmax_scale=None, **_unused):
    """Decode-step attention against a (paged) KV cache, vectorised over the batch.

    q: [batch, q_len, heads, dim]; caches [num_blocks, block_size, kv_heads, dim] with
    ``block_table`` [batch, max_blocks], or [batch, max_len, kv_heads, dim] without.
    ``cache_seqlens`` [batch]: valid cache length per request (including the new tokens).

    This runs once per layer per generated token, so it is written for speed: only the first ``max_len``
    cache slots of each request are gathered (one ``index_select`` of token rows; whole blocks would copy
    up to ``block_size - 1`` unused slots per request: 3x the data for 20-token RL rollouts in 64-token
    blocks); attention is :func:`dot_product_attention` over exactly those slots. What only depends on the
    lengths and the block table (groups, masks, gather indices) is worked out once per step
    (:func:`_paged_decode_plan`) and reused by every layer.

    A padded batch costs every request the longest request's slots, so requests of very different lengths
    are attended in groups of similar length (:func:`length_groups`): with partial rollouts a step holds
    fresh requests next to a few hundred-token ones carried over from earlier iterations, and one padded
    batch of 63 ten-token requests and one of 250 tokens cost 5x the same batch without the long one.
    """
    batch, q_len, heads, dim = q.shape
    if block_table is None:
        return _decode_dense(q, k_cache, v_cache, cache_seqlens.long(), causal, softmax_scale)
    host = _mirror_rows(q_len, k_cache, cache_seqlens)
    plan = _paged_decode_plan(cache_seqlens, block_table, q.shape, k_cache.shape, mirrored=host is not None)
    if host is not None:
        mirrored = decode_mirror.for_owner(host.owner).key_values(k_cache, v_cache, block_table, host.request_ids,
                                                                  host.lengths, max(part.max_len for part in plan))
        if mirrored is not None:
            return _attend_mirrored(q, *mirrored, plan, causal, softmax_scale)
    if len(plan) == 1:
        return _decode_paged(q, k_cache, v_cache, plan[0], causal, softmax_scale)
    out = q.new_empty(batch, q_len, heads, dim)
    for part in plan:
        out[part.rows] = _decode_paged(q[part.rows], k_cache, v_cache, part, causal, softmax_scale)
    return out


@dataclasses.dataclass
class _DecodeGroup:
    """One padded batch of a paged decode step: what every layer's attention of the step shares."""

    rows: torch.Tensor | None  # indices into the step's batch (None: all of it)
    lens: torch.Tensor  # [b] int64 cache lengths
    max_len: int  # key slots attended (>= MIN_KEY_SLOTS)
    masked: torch.Tensor  # [b, 1, 1, max_len]: slots past a request's length
    table: torch.Tensor  # [b, blocks] the group's rows of the block table
    # rows of the flattened cache [*, dim] that make K and V [max_len, b, heads', dim]; worked out when first needed
    # (a step over the decode mirror gathers nothing)
    gather_rows: torch.Tensor | None


_STEP_PLAN = threading.local()


def forget_step_plans() -> None:
    """Drop this thread's memoised attention plans: the next call plans afresh (inside a graph capture, say)."""
    _STEP_PLAN.__dict__.clear()


def _paged_decode_plan(cache_seqlens: torch.Tensor, block_table: torch.Tensor, q_shape: torch.Size,
                       cache_shape: torch.Size, mirrored: bool = False) -> list[_DecodeGroup]:
    """The step's :class:`_DecodeGroup` list, built by the first layer and reused by the others.

    ``mirrored``: K and V come from the :mod:`decode_mirror` (one group reads it in place, more groups copy their
    rows out of it). The groups are the gather's either way: a softmax or product over other numbers of padded
    slots can round differently, and the mirror must give the gather's bits.

    megatron-core hands every layer of a step the same ``cache_seqlens`` and ``block_table`` tensors and writes
    the next step's values in place (which bumps their version counters), so the plan is keyed on those two
    objects (held here, so their ids cannot be reused) and their versions.
    """
    batch, q_len, heads, dim = q_shape
    overhead = split_overhead_slots(heads * dim, cache_seqlens.device)
    key = (q_shape, cache_shape, cache_seqlens._version, block_table._version, overhead, MIN_KEY_SLOTS, mirrored)
    cached = getattr(_STEP_PLAN, "decode", None)
    if cached is not None and cached[0] is cache_seqlens and cached[1] is block_table and cached[2] == key:
        return cached[3]
    host = step_host(cache_seqlens)
    if host is not None:
        host_lens, key_multiple = host.lengths, host.key_multiple
    else:  # a caller that did not give the lengths (tests, other engines): read them back
        host_lens, key_multiple = cache_seqlens.tolist(), 1
    lens = cache_seqlens.long()
    groups = [list(range(batch))]
    if batch > 1 and (host is None or host.split_groups):
        split = length_groups(host_lens, overhead)
        if len(split) > 1:  # lengths too far apart for one padded batch
            groups = split
    plan = []
    for group in groups:
        rows = None if len(groups) == 1 else torch.tensor(group, dtype=torch.long, device=cache_seqlens.device)
        part_lens, part_table = (lens, block_table) if rows is None else (lens[rows], block_table[rows])
        max_len = padded_key_slots(max(host_lens[i] for i in group), MIN_KEY_SLOTS, key_multiple)
        key_valid = torch.arange(max_len, device=lens.device)[None, :] < part_lens[:, None]  # [b, k]
        plan.append(_DecodeGroup(rows, part_lens, max_len, ~key_valid[:, None, None, :], part_table,
                                 None if mirrored else _group_rows(part_table, key_valid, cache_shape, q_len, heads)))
    _STEP_PLAN.decode = (cache_seqlens, block_table, key, plan)
    return plan


def _mirror_rows(q_len, k_cache, cache_seqlens):
    """This step's host facts (:mod:`decode_lengths`) when its attention is to read the :mod:`decode_mirror`: request
    ids given with the lengths, one query per request, a CPU cache, and a batch whose gather would copy at least
    :data:`MIRROR_MIN_ELEMENTS`. None otherwise."""
    host = step_host(cache_seqlens)
    if (q_len != 1 or host is None or host.request_ids is None or k_cache.device.type != "cpu"
            or host.padded_slots * k_cache.shape[-2] * k_cache.shape[-1] < MIRROR_MIN_ELEMENTS):
        return None
    return host


def _attend_mirrored(q, keys, values, plan, causal, softmax_scale):
    """:func:`flash_attn_with_kvcache` over the mirror's K and V [batch, kv_heads, slots, dim]: one padded batch in
    place, or each group's rows copied out; either way in megatron's order of dimensions [slots, b, kv_heads, dim]
    (with other strides: the products give the same bits)."""
    def part_of(cache, part):
        cache = cache[:, :, :part.max_len]
        return (cache if part.rows is None else cache.index_select(0, part.rows)).permute(2, 0, 1, 3)

    if len(plan) == 1:
        part = plan[0]
        return _attend_decode(q, part_of(keys, part), part_of(values, part), part.lens, part.max_len, part.masked,
                              causal, softmax_scale)
    out = q.new_empty(q.shape)
    for part in plan:
        out[part.rows] = _attend_decode(q[part.rows], part_of(keys, part), part_of(values, part), part.lens,
                                        part.max_len, part.masked, causal, softmax_scale)
    return out


def _group_rows(table, key_valid, cache_shape, q_len: int, heads: int) -> torch.Tensor:
    """A decode group's :func:`_paged_rows` (one query: K/V per KV head, see :func:`_attend_decode`)."""
    kv_heads = cache_shape[-2]
    return _paged_rows(table, key_valid, cache_shape[1], kv_heads, kv_heads if q_len == 1 else heads)


def _decode_paged(q, k_cache, v_cache, part: _DecodeGroup, causal, softmax_scale):
    """:func:`flash_attn_with_kvcache` of one padded batch of a paged cache (``part`` of the step's plan)."""
    batch, q_len, heads, dim = q.shape
    if part.gather_rows is None:  # planned for the decode mirror, which declined (larger than the paged cache)
        part.gather_rows = _group_rows(part.table, ~part.masked[:, 0, 0, :], k_cache.shape, q_len, heads)
    key, value = _gather_rows(k_cache, v_cache, part.gather_rows, (part.max_len, batch, -1, dim))
    return _attend_decode(q, key, value, part.lens, part.max_len, part.masked, causal, softmax_scale)


def _decode_dense(q, k_cache, v_cache, lens, causal, softmax_scale):
    """:func:`flash_attn_with_kvcache` of a dense cache [batch, max_len, kv_heads, dim] (tests, no paging)."""
    batch, q_len, heads, dim = q.shape
    max_len = max(int(lens.max()), 1)
    key_valid = torch.arange(max_len, device=q.device)[None, :] < lens[:, None]  # [b, k]
    expanded = k_cache.shape[-2] if q_len == 1 else heads
    key, value = (_expand_heads(c[:, :max_len].masked_fill(~key_valid[:, :, None, None], 0.0), expanded)
                  for c in (k_cache, v_cache))
    return _attend_decode(q, key, value, lens, max_len, ~key_valid[:, None, None, :], causal, softmax_scale)


def _attend_decode(q, key, value, lens, max_len, masked, causal, softmax_scale):
    """Decode attention of queries ``q`` [b, q_len, heads, dim] over K/V [max_len, b, heads', dim] (megatron's
    layout; heads' = KV heads for one query per request, else query heads)."""
    batch, q_len, heads, dim = q.shape
    scale = softmax_scale or dim ** -0.5
    if q_len == 1:
        # One query per request: the query heads sharing a KV head are the rows of one product (megatron repeats
        # K and V per query head instead: the same per-row arithmetic, more copies), zero rows added up to
        # MIN_QUERY_ROWS.
        kv_heads = key.shape[2]
        group = heads // kv_heads
        query = q.view(batch, kv_heads, group, dim).permute(2, 0, 1, 3)  # [group, b, kv_heads, dim]
        if group < MIN_QUERY_ROWS:
            query = torch.cat([query, query.new_zeros(MIN_QUERY_ROWS - group, batch, kv_heads, dim)])
        out = dot_product_attention(query, key, value, masked, scale, real_rows=group)[:group]
        return out.permute(1, 2, 0, 3).reshape(batch, 1, heads, dim).to(q.dtype)
    rows = max(q_len, MIN_QUERY_ROWS)
    query = q.new_zeros(rows, batch, heads, dim)  # megatron's [sq, b, heads, dim] layout
    query[:q_len] = q.transpose(0, 1)
    if causal and q_len > 1:  # bottom-right aligned
        query_pos = torch.arange(rows, device=q.device)[None, :, None] + (lens[:, None, None] - q_len)
        masked = masked | (torch.arange(max_len, device=q.device)[None, None, :] > query_pos)[:, None]
    out = dot_product_attention(query, key, value, masked, scale)
    return out[:q_len].transpose(0, 1).to(q.dtype)


# What attending one more group costs (its ~20 torch ops), in elements of gathered cache: measured on a 2-core
# CPU (one more group ~0.6 ms with its indexing, a cache slot of 64 elements ~0.35 us); on a GPU the ops are
# launches of ~10 us each against memory bandwidth, so groups pay only for far larger batches.
_SPLIT_OVERHEAD_ELEMENTS = {"cpu": 128 * 1024, "cuda": 64 * 1024 * 1024}


def split_overhead_slots(slot_elements: int, device: torch.device) -> int:
    """The cost of one more attention group in cache slots of ``slot_elements`` elements (heads x dim)."""
    overhead = _SPLIT_OVERHEAD_ELEMENTS.get(device.type)
    if overhead is None:  # other accelerators: as a GPU
        overhead = _SPLIT_OVERHEAD_ELEMENTS["cuda"]
    return max(1, overhead // max(slot_elements, 1))


def _expand_heads(cache: torch.Tensor, heads: int) -> torch.Tensor:
    """[b, k, kv_heads, dim] -> [k, b, heads, dim] contiguous (each KV head repeated for its query heads)."""
    return cache.transpose(0, 1).repeat_interleave(heads // cache.shape[2], dim=2).contiguous()


def _paged_rows(block_table, key_valid: torch.Tensor, block_size: int, kv_heads: int, heads: int) -> torch.Tensor:
    """The rows of a flattened paged cache [num_blocks * block_size * kv_heads, dim] that, gathered in order,
    give K or V [k, b, heads, dim] in the layout megatron's ``DotProductAttention`` gives them before its
    products.

    Gather, transpose and head repeat in one copy (the strided copy of ``repeat_interleave`` on the gathered
    cache cost 8 ms per decode layer at 128 requests). Slots past a request's length read its slot 0 (finite,
    and multiplied by a zero probability).
    """
    batch, max_len = key_valid.shape
    num_blocks = (max_len + block_size - 1) // block_size
    blocks = block_table[:, :num_blocks].long().clamp(min=0)  # -1 marks unused blocks
    if blocks.shape[1] < num_blocks:  # MIN_KEY_SLOTS past the table's end: masked slots, read from slot 0 below
        blocks = torch.nn.functional.pad(blocks, (0, num_blocks - blocks.shape[1]))
    slots = (blocks[:, :, None] * block_size + torch.arange(block_size, device=blocks.device))
    slots = slots.view(batch, num_blocks * block_size)[:, :max_len]
    slots = torch.where(key_valid, slots, slots[:, :1])
    head_of = torch.arange(heads, device=blocks.device) // (heads // kv_heads)
    return (slots.t()[:, :, None] * kv_heads + head_of).reshape(-1)  # [k, b, heads] rows of [*, dim]


def _gather_rows(k_cache, v_cache, rows: torch.Tensor, shape: tuple[int, ...]):
    """K and V: ``rows`` of the flattened caches (one ``index_select`` each, into reused buffers), as ``shape``."""
    dim = k_cache.shape[-1]
    kbuf, vbuf = _gather_buffers((rows.numel(), dim), k_cache.dtype, k_cache.device)
    # megatron-core's caches are contiguous slices of one buffer (a view); anything else is copied whole here
    key = torch.index_select(k_cache.reshape(-1, dim), 0, rows, out=kbuf).view(shape)
    value = torch.index_select(v_cache.reshape(-1, dim), 0, rows, out=vbuf).view(shape)
    return key, value
