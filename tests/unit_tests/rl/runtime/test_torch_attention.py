"""The pure-torch paged attention must equal dense causal attention computed another way (SDPA)."""
import pytest
import torch

from megatron.rl.runtime import torch_attention as ta


def _sdpa_reference(q, k, v, causal_offset):
    """q [Lq,h,d], k/v [Lk,hk,d]; query i sees keys <= i + causal_offset (bottom-right alignment)."""
    h, hk = q.shape[1], k.shape[1]
    k = k.repeat_interleave(h // hk, dim=1)
    v = v.repeat_interleave(h // hk, dim=1)
    lq, lk = q.shape[0], k.shape[0]
    mask = torch.arange(lk)[None, :] <= (torch.arange(lq)[:, None] + causal_offset)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    return out.transpose(0, 1)


def _paged(seqs_k, block_size, num_blocks, perm_seed=0):
    """Scatter per-request K tensors into a shuffled paged cache; return cache and block table."""
    hk, d = seqs_k[0].shape[1:]
    cache = torch.full((num_blocks, block_size, hk, d), float("nan"))  # unused slots must never be read
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(perm_seed)).tolist()
    max_blocks = max((len(s) + block_size - 1) // block_size for s in seqs_k)
    table = torch.full((len(seqs_k), max_blocks), -1, dtype=torch.int32)
    for b, s in enumerate(seqs_k):
        for j in range((len(s) + block_size - 1) // block_size):
            blk = order.pop()
            chunk = s[j * block_size:(j + 1) * block_size]
            cache[blk, :len(chunk)] = chunk
            table[b, j] = blk
    return cache, table


@pytest.mark.parametrize("heads,kv_heads", [(4, 4), (4, 2)])
def test_varlen_prefill_matches_sdpa(heads, kv_heads):
    g = torch.Generator().manual_seed(0)
    lens = [5, 1, 9]
    d = 8
    q = torch.randn(sum(lens), heads, d, generator=g)
    k = torch.randn(sum(lens), kv_heads, d, generator=g)
    v = torch.randn(sum(lens), kv_heads, d, generator=g)
    cu = torch.tensor([0, 5, 6, 15], dtype=torch.int32)
    out = ta.flash_attn_varlen_func(q, k, v, cu, cu, max(lens), max(lens), causal=True)
    for b in range(3):
        s, e = cu[b].item(), cu[b + 1].item()
        ref = _sdpa_reference(q[s:e], k[s:e], v[s:e], causal_offset=0)
        torch.testing.assert_close(out[s:e], ref, atol=1e-5, rtol=1e-5)


def test_varlen_paged_chunked_prefill_matches_sdpa():
    """Queries are the last tokens of longer cached sequences (chunked prefill over a paged cache)."""
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, d, block = 4, 2, 8, 4
    k_lens, q_lens = [7, 12], [3, 12]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    qs = [torch.randn(n, heads, d, generator=g) for n in q_lens]
    k_cache, table = _paged(ks, block, num_blocks=10)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, vv in enumerate(vs):
        for j in range((len(vv) + block - 1) // block):
            chunk = vv[j * block:(j + 1) * block]
            v_cache[table[b, j], :len(chunk)] = chunk
    cu_q = torch.tensor([0, 3, 15], dtype=torch.int32)
    cu_k = torch.tensor([0, 7, 19], dtype=torch.int32)
    out = ta.flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu_q, cu_k, 12, 12, causal=True,
                                    block_table=table)
    for b in range(2):
        ref = _sdpa_reference(qs[b], ks[b], vs[b], causal_offset=k_lens[b] - q_lens[b])
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=1e-5)


def test_kvcache_decode_matches_sdpa():
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, d, block = 4, 1, 8, 4
    lens = [1, 6, 13]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    k_cache, table = _paged(ks, block, num_blocks=12, perm_seed=3)
    v_cache = torch.zeros_like(k_cache)
    for b, vv in enumerate(vs):
        for j in range((len(vv) + block - 1) // block):
            chunk = vv[j * block:(j + 1) * block]
            v_cache[table[b, j], :len(chunk)] = chunk
    k_cache = k_cache.nan_to_num(0.0)
    q = torch.randn(3, 1, heads, d, generator=g)
    out = ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                     causal=True, block_table=table)
    for b in range(3):
        ref = _sdpa_reference(q[b], ks[b], vs[b], causal_offset=lens[b] - 1)
        torch.testing.assert_close(out[b], ref, atol=1e-5, rtol=1e-5)


def test_varlen_prefill_batches_many_mixed_requests(monkeypatch):
    """Many requests (some empty, some chunked against a longer cache), split over several padded batches."""
    monkeypatch.setattr(ta, "_PREFILL_BATCH_ELEMENTS", 4 * 2 * 10 * 16)  # a few requests per batch
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, d, block = 4, 2, 8, 4
    k_lens = [7, 12, 0, 1, 16, 9, 3, 5]
    q_lens = [3, 12, 0, 1, 10, 9, 0, 5]
    ks = [torch.randn(max(n, 1), kv_heads, d, generator=g)[:n] for n in k_lens]
    vs = [torch.randn(max(n, 1), kv_heads, d, generator=g)[:n] for n in k_lens]
    qs = [torch.randn(max(n, 1), heads, d, generator=g)[:n] for n in q_lens]
    k_cache, table = _paged([k if len(k) else torch.zeros(1, kv_heads, d) for k in ks], block, num_blocks=40)
    v_cache = torch.full_like(k_cache, float("nan"))
    for b, vv in enumerate(vs):
        for j in range((len(vv) + block - 1) // block):
            chunk = vv[j * block:(j + 1) * block]
            v_cache[table[b, j], :len(chunk)] = chunk
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ta.flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                    causal=True, block_table=table)
    assert torch.isfinite(out).all()
    for b in range(len(k_lens)):
        if q_lens[b] == 0:
            continue
        ref = _sdpa_reference(qs[b], ks[b], vs[b], causal_offset=k_lens[b] - q_lens[b])
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=1e-5)


def test_dot_product_attention_is_megatrons_bit_for_bit():
    """The engine's attention arithmetic is the trainer's: megatron-core's DotProductAttention module, bit for bit."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed

    init_distributed(tp=1)
    heads, groups, d, sq, b = 4, 2, 16, 11, 3
    config = TransformerConfig(num_layers=1, hidden_size=heads * d, num_attention_heads=heads,
                               num_query_groups=groups, attention_dropout=0.0, masked_softmax_fusion=False,
                               use_cpu_initialization=True)
    module = DotProductAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")
    g = torch.Generator().manual_seed(5)
    q = torch.randn(sq, b, heads, d, generator=g) * 3
    k = torch.randn(sq, b, groups, d, generator=g) * 3
    v = torch.randn(sq, b, groups, d, generator=g)
    masked = torch.ones(sq, sq, dtype=torch.bool).tril().logical_not()[None, None].expand(b, 1, sq, sq)
    masked = masked | (torch.arange(sq) >= torch.tensor([sq, 4, 7])[:, None])[:, None, None, :]  # padded keys
    expected = module(q, k, v, masked).view(sq, b, heads, d)
    assert torch.equal(ta.dot_product_attention(q, k, v, masked, d ** -0.5), expected)


@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (4, 4), (8, 2)])
def test_decode_folds_grouped_heads_without_changing_a_bit(monkeypatch, heads, kv_heads):
    """Query heads of one KV head as the rows of one product (zero rows added up to MIN_QUERY_ROWS) == megatron's
    per-head products over repeated K/V with the one query row padded to MIN_QUERY_ROWS, request by request.
    The reference attends over the batch's key slots, as the folded product does: that more masked slots change
    no bit is test_short_requests_attend_over_at_least_16_keys_like_longer_rows's claim, this one's is the rows'."""
    monkeypatch.setattr(ta, "_SPLIT_OVERHEAD_ELEMENTS", {"cpu": 1 << 40})  # one padded product for the batch
    g = torch.Generator().manual_seed(6)
    d, block = 8, 4
    lens = [1, 6, 13, 9, 20]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    k_cache, table = _paged(ks, block, num_blocks=32, perm_seed=2)
    k_cache = k_cache.nan_to_num(0.0)
    v_cache = torch.randn(k_cache.shape, generator=g)
    q = torch.randn(len(lens), 1, heads, d, generator=g)
    folded = ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=torch.tensor(lens, dtype=torch.int32),
                                        causal=True, block_table=table)
    slots = max(*lens, ta.MIN_KEY_SLOTS)
    for b, n in enumerate(lens):
        pos = torch.arange(slots).clamp(max=n - 1)
        key = k_cache[table[b, pos // block], pos % block][:, None]  # [slots, 1, kv_heads, d]
        value = v_cache[table[b, pos // block], pos % block][:, None]
        query = torch.zeros(ta.MIN_QUERY_ROWS, 1, heads, d)
        query[0] = q[b]
        masked = (torch.arange(slots) >= n)[None, None, None, :]
        ref = ta.dot_product_attention(query, key, value, masked, d ** -0.5)[0, 0]
        assert torch.equal(folded[b, 0], ref), b


def _values_like(k_cache, table, vs, block, fill):
    """The V cache of the requests whose K blocks ``table`` lists (unused slots hold ``fill``)."""
    v_cache = torch.full_like(k_cache, fill)
    for b, vv in enumerate(vs):
        for j in range((len(vv) + block - 1) // block):
            chunk = vv[j * block:(j + 1) * block]
            v_cache[table[b, j], :len(chunk)] = chunk
    return v_cache


def test_length_groups_split_only_where_padding_costs_more_than_a_group():
    # 63 short requests and one long one: padding them all to the long one costs 63 x 240 slots
    assert ta.length_groups([10] * 30 + [250] + [10] * 33, overhead=2048) == [[*range(30), *range(31, 64)], [30]]
    assert ta.length_groups([250] * 64, overhead=2048) == [list(range(64))]  # one length: nothing to gain
    assert ta.length_groups([20] * 7 + [250], overhead=2048) == [list(range(8))]  # 7 x 230 padded < a group
    assert ta.length_groups([], overhead=1) == [[]]
    # every request exactly once, groups ordered by length, each in request order
    lens = [5, 9, 17, 30, 60, 120, 250, 3, 250, 70, 1, 33] * 8
    groups = ta.length_groups(lens, overhead=64)
    assert len(groups) > 2
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    assert all(g == sorted(g) for g in groups)
    assert all(max(lens[i] for i in a) <= min(lens[i] for i in b) for a, b in zip(groups, groups[1:]))


def _padded_cost(lens, groups, overhead):
    return sum(overhead + len(g) * max(lens[i] for i in g) for g in groups)


def test_length_groups_is_no_worse_than_one_batch_or_one_group_per_class():
    g = torch.Generator().manual_seed(7)
    for _ in range(50):
        lens = torch.randint(1, 300, (int(torch.randint(2, 90, (1,), generator=g)),), generator=g).tolist()
        overhead = int(torch.randint(1, 3000, (1,), generator=g))
        groups = ta.length_groups(lens, overhead)
        classes = {}
        for i, n in enumerate(lens):
            classes.setdefault((n - 1).bit_length(), []).append(i)
        cost = _padded_cost(lens, groups, overhead)
        assert cost <= _padded_cost(lens, [list(range(len(lens)))], overhead)
        assert cost <= _padded_cost(lens, list(classes.values()), overhead)


@pytest.mark.parametrize("kv_heads", [4, 2])
def test_decode_of_far_apart_lengths_in_groups_matches_sdpa(monkeypatch, kv_heads):
    """Short requests next to long ones (partial rollouts) are attended in groups; each still equals SDPA and
    the single padded batch's result."""
    g = torch.Generator().manual_seed(8)
    heads, d, block = 4, 8, 4
    lens = [3, 40, 2, 5, 37, 4, 1, 6]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in lens]
    k_cache, table = _paged(ks, block, num_blocks=40, perm_seed=4)
    v_cache = _values_like(k_cache, table, vs, block, fill=0.0)
    k_cache = k_cache.nan_to_num(0.0)
    q = torch.randn(len(lens), 1, heads, d, generator=g)
    args = dict(cache_seqlens=torch.tensor(lens, dtype=torch.int32), causal=True, block_table=table)
    monkeypatch.setattr(ta, "_SPLIT_OVERHEAD_ELEMENTS", {"cpu": 32 * heads * d})
    calls = []
    decode = ta._decode_paged
    monkeypatch.setattr(ta, "_decode_paged", lambda q, *a: calls.append(q.shape[0]) or decode(q, *a))
    grouped = ta.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert sorted(calls) == [2, 6]  # the two long requests apart
    for b in range(len(lens)):
        ref = _sdpa_reference(q[b], ks[b], vs[b], causal_offset=lens[b] - 1)
        torch.testing.assert_close(grouped[b], ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(ta, "_SPLIT_OVERHEAD_ELEMENTS", {"cpu": 1 << 40})
    calls.clear()
    single = ta.flash_attn_with_kvcache(q, k_cache, v_cache, **args)
    assert calls == [len(lens)]
    torch.testing.assert_close(grouped, single, atol=1e-6, rtol=1e-6)


def test_varlen_step_with_new_prompts_and_long_decodes_in_groups_matches_sdpa(monkeypatch):
    """A step that prefills new prompts while decoding long requests: grouped by key length, then by query rows
    (request 4's 5 rows are not worth padding three 4-row requests to, at this tiny group overhead), still exact."""
    monkeypatch.setattr(ta, "_SPLIT_OVERHEAD_ELEMENTS", {"cpu": 32 * 4 * 8})
    batches = []
    attend = ta._attend_padded
    monkeypatch.setattr(ta, "_attend_padded", lambda *a: batches.append(list(a[4].rows)) or attend(*a))
    g = torch.Generator().manual_seed(9)
    heads, kv_heads, d, block = 4, 2, 8, 4
    k_lens = [4, 41, 3, 38, 5, 1]
    q_lens = [4, 1, 3, 1, 5, 1]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    qs = [torch.randn(n, heads, d, generator=g) for n in q_lens]
    k_cache, table = _paged(ks, block, num_blocks=40, perm_seed=5)
    v_cache = _values_like(k_cache, table, vs, block, fill=float("nan"))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ta.flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                    causal=True, block_table=table)
    assert sorted(map(sorted, batches)) == [[0, 2, 5], [1, 3], [4]]
    for b in range(len(k_lens)):
        ref = _sdpa_reference(qs[b], ks[b], vs[b], causal_offset=k_lens[b] - q_lens[b])
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=1e-5)


def test_prefill_does_not_pad_a_groups_rollouts_to_its_prompt(monkeypatch):
    """A GRPO group's prefill step: one request computes the 96-token prompt, the others enter with its last token
    (one query row each, the shared prompt's keys already cached). They are attended as their own batch, at
    MIN_QUERY_ROWS rows, not padded to the prompt's 96 query rows; every output still matches SDPA."""
    batches = []
    attend = ta._attend_padded
    monkeypatch.setattr(ta, "_attend_padded", lambda *a: batches.append((list(a[4].rows), a[4].rows_q)) or attend(*a))
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, d, block = 4, 2, 16, 16
    k_lens, q_lens = [96] * 8, [96] + [1] * 7
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    qs = [torch.randn(n, heads, d, generator=g) for n in q_lens]
    k_cache, table = _paged(ks, block, num_blocks=64, perm_seed=2)
    v_cache = _values_like(k_cache, table, vs, block, fill=0.0)
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)
    out = ta.flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu_q, cu_k, max(q_lens), max(k_lens),
                                    causal=True, block_table=table)
    assert sorted(batches) == [([0], 96), ([1, 2, 3, 4, 5, 6, 7], ta.MIN_QUERY_ROWS)]
    for b in range(len(k_lens)):
        ref = _sdpa_reference(qs[b], ks[b], vs[b], causal_offset=k_lens[b] - q_lens[b])
        torch.testing.assert_close(out[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=1e-5)


def _short_and_long_decode(heads=4, kv_heads=2, d=16, block=16):
    """A 13-key request decoded alone and next to a 40-key one (one padded batch): its output both ways."""
    g = torch.Generator().manual_seed(11)
    ks = [torch.randn(n, kv_heads, d, generator=g) * 3 for n in (13, 40)]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in (13, 40)]
    k_cache, table = _paged(ks, block, num_blocks=8, perm_seed=4)
    v_cache = _values_like(k_cache, table, vs, block, 0.0)
    k_cache = k_cache.nan_to_num(0.0)
    q = torch.randn(2, 1, heads, d, generator=g) * 3
    lens = torch.tensor([13, 40], dtype=torch.int32)
    alone = ta.flash_attn_with_kvcache(q[:1], k_cache, v_cache, cache_seqlens=lens[:1], causal=True,
                                       block_table=table[:1])
    batched = ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, block_table=table)
    return alone[0], batched[0]


def test_short_requests_attend_over_at_least_16_keys_like_longer_rows(monkeypatch):
    """A short request attends over MIN_KEY_SLOTS (16) key slots, the extra ones masked: from 16 keys on, more
    masked keys change no bit, so it gets the bits it gets in any longer row (the trainer's micro-batch rows, or a
    decode step next to a longer request). Below 16 keys the softmax and the product with V may round otherwise
    (they do on AVX-512 CPUs, not on AVX2 ones): the quickstart's 11-token prompts put their first decode steps at
    12-14 keys, and their log-probs up to 1.3e-5 from the trainer's on such a CPU. Whether the unpadded product
    rounds differently depends on the CPU, so the check that the test bites is on the key slots attended."""
    slots = []
    attend = ta.dot_product_attention
    monkeypatch.setattr(ta, "dot_product_attention",
                        lambda q, k, *a, **kw: slots.append(k.shape[0]) or attend(q, k, *a, **kw))
    alone, batched = _short_and_long_decode()
    assert slots == [16, 40]  # the 13-key request alone attends over 16 slots
    assert torch.equal(alone, batched)
    monkeypatch.setattr(ta, "MIN_KEY_SLOTS", 1)  # as before: the request alone attends over its 13 keys
    slots.clear()
    alone, batched = _short_and_long_decode()
    assert slots == [13, 40], "the sabotaged padding went unnoticed: the test would not bite"
    torch.testing.assert_close(alone, batched, rtol=1e-5, atol=1e-6)  # the same attention, rounded at most otherwise


def test_a_steps_decode_plan_is_built_once_for_all_layers_and_again_when_lengths_change_in_place(monkeypatch):
    """Every layer of a step gets the same length and block-table tensors: the groups, masks and gather rows are
    worked out by the first layer only. The next step rewrites those tensors in place: a new plan, as if fresh."""
    g = torch.Generator().manual_seed(12)
    heads, kv_heads, d, block = 4, 2, 8, 4
    full = [9, 30, 7, 12]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in full]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in full]
    k_cache, table = _paged(ks, block, num_blocks=40, perm_seed=6)
    v_cache = _values_like(k_cache, table, vs, block, fill=0.0)
    k_cache = k_cache.nan_to_num(0.0)
    q = torch.randn(len(full), 1, heads, d, generator=g)
    builds = []
    rows = ta._paged_rows
    monkeypatch.setattr(ta, "_paged_rows", lambda *a: builds.append(1) or rows(*a))
    lens = torch.tensor([n - 2 for n in full], dtype=torch.int32)
    layers = [ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, block_table=table)
              for _ in range(3)]
    assert len(builds) == 1 and all(torch.equal(out, layers[0]) for out in layers)
    lens += 2  # the next step, written in place as megatron-core's context does
    step2 = ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens, causal=True, block_table=table)
    assert len(builds) == 2
    fresh = ta.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lens.clone(), causal=True,
                                       block_table=table.clone())
    assert torch.equal(step2, fresh) and not torch.equal(step2, layers[0])
    for b, n in enumerate(full):
        torch.testing.assert_close(step2[b], _sdpa_reference(q[b], ks[b], vs[b], causal_offset=n - 1),
                                   atol=1e-5, rtol=1e-5)


def test_a_prefill_steps_batches_are_built_once_for_all_layers_and_again_for_the_next_step(monkeypatch):
    g = torch.Generator().manual_seed(13)
    heads, kv_heads, d, block = 4, 2, 8, 4
    k_lens, q_lens = [6, 9, 3], [6, 2, 3]
    ks = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    vs = [torch.randn(n, kv_heads, d, generator=g) for n in k_lens]
    qs = [torch.randn(n, heads, d, generator=g) for n in q_lens]
    k_cache, table = _paged(ks, block, num_blocks=20, perm_seed=7)
    v_cache = _values_like(k_cache, table, vs, block, fill=float("nan"))
    builds = []
    plan = ta._prefill_batches
    monkeypatch.setattr(ta, "_prefill_batches", lambda *a: builds.append(1) or plan(*a))
    cu_q = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(k_lens).cumsum(0).tolist()], dtype=torch.int32)

    def attend(cu_q, cu_k, table):
        return ta.flash_attn_varlen_func(torch.cat(qs), k_cache, v_cache, cu_q, cu_k, causal=True, block_table=table)

    layers = [attend(cu_q, cu_k, table) for _ in range(3)]
    assert len(builds) == 1 and all(torch.equal(out, layers[0]) for out in layers)
    cu_k[1:] -= torch.tensor([0, 2, 2], dtype=torch.int32)  # the next step's lengths, written in place
    step2 = attend(cu_q, cu_k, table)
    assert len(builds) == 2 and torch.equal(step2, attend(cu_q.clone(), cu_k.clone(), table.clone()))
    k_lens2 = [6, 7, 3]  # cu_k 0, 6, 13, 16
    for b in range(3):
        ref = _sdpa_reference(qs[b], ks[b][:k_lens2[b]], vs[b][:k_lens2[b]], causal_offset=k_lens2[b] - q_lens[b])
        torch.testing.assert_close(step2[cu_q[b]:cu_q[b + 1]], ref, atol=1e-5, rtol=1e-5)
