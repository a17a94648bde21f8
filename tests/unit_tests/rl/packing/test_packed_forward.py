"""megatron.rl.packing.packed_forward: a packed row's sequences computed as if each ran alone.

The trainer's [rows, S] forward (``rl_loss.model_forward``) on a tiny megatron-core GPT (local spec, RoPE, GQA,
fp32) against (a) the same sequences one per row and (b) each sequence run alone; the model's weights are
scaled up so its distributions are peaked like a trained policy's, where rounding differences are largest.
"""
from __future__ import annotations

import pytest
import torch

from megatron.rl.sequence_packing_utils import build_packed_batch, plan_packing
from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, tiny_gpt

S = 128


@pytest.fixture(scope="module")
def sequences():
    g = torch.Generator().manual_seed(0)
    lengths = [int(torch.randint(5, 30, (1,), generator=g)) for _ in range(20)]
    assert len(set(lengths)) < len(lengths)  # some share a length: one attention call holds several sequences
    return [torch.randint(0, 259, (n,), generator=g).tolist() for n in lengths]


def _model(scale: float = 1.0, **config):
    init_distributed(tp=1)
    torch.manual_seed(0)
    model = tiny_gpt(hidden=64, layers=2, seq=S)
    for k, v in config.items():
        setattr(model.config, k, v)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def _batch(seqs, max_per_bin):
    info = plan_packing([len(s) for s in seqs], S, max_per_bin)
    masks = [[0] + [1] * (len(s) - 1) for s in seqs]
    return build_packed_batch(info, list(range(info.num_bins)), seqs, masks, 0)


def _per_sequence(lp, batch):
    info = batch.info
    return [lp[info.seq_to_bin_idx[s], info.seq_starts[s]:info.seq_starts[s] + n - 1]
            for s, n in enumerate(info.seq_lengths)]


def _packed_logprobs(model, batch, isolated=True, attention="exact"):
    from megatron.rl.rl_loss import vocab_parallel_logprobs as token_logprobs
    from megatron.rl.rl_loss import model_forward

    if isolated:
        out = model_forward(model, batch, torch.device("cpu"), use_thd=False, packed_attention=attention)
    else:  # the forward before megatron.rl.packing.packed_forward: mask only
        out = model(batch.tokens, batch.position_ids, batch.attention_mask())
    return _per_sequence(token_logprobs(out.reshape(batch.num_rows, S, -1), batch.labels), batch)


def _alone_logprobs(model, ids):
    from megatron.rl.rl_loss import vocab_parallel_logprobs as token_logprobs

    out = model(torch.tensor([ids]), torch.arange(len(ids))[None], None)
    return token_logprobs(out[0], torch.tensor(ids[1:] + [0]))[:-1]


def test_gather_rotary_table_rows_equal_a_shorter_table():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron.rl.packing.packed_forward import gather_rotary_table

    init_distributed(tp=1)  # the CPU layer: megatron-core moves the table to "cuda"
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0)
    table = rope.get_emb(10).cpu()  # [10, 1, 1, 16]
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 0, 1, 2], [0, 1, 2, 3, 4, 5, 6, 7, 8, 9]])
    got = gather_rotary_table(table, positions)
    assert got.shape == (10, 2, 1, 16)
    assert torch.equal(got[3:7, 0], rope.get_emb(4).cpu()[:, 0])  # the second sequence of row 0, from 0
    assert torch.equal(got[:, 1], table[:, 0])
    with pytest.raises(ValueError, match="outside the RoPE table"):
        gather_rotary_table(table, torch.tensor([[10]]))
    with pytest.raises(ValueError, match=r"\[S, 1, 1, dim\]"):
        gather_rotary_table(table.expand(10, 2, 1, 16), positions)


def test_packed_rows_equal_one_sequence_per_row_bit_for_bit(sequences):
    model = _model(scale=3.0).eval()
    packed, unpacked = _batch(sequences, 8), _batch(sequences, 1)
    assert packed.num_rows < len(sequences) and any(packed.info.seq_starts)  # really packed, offsets > 0
    with torch.no_grad():
        got = _packed_logprobs(model, packed)
        ref = _packed_logprobs(model, unpacked)
        old = _packed_logprobs(model, packed, isolated=False)
    assert sum(float(r.abs().mean()) for r in ref) / len(ref) > 1.0, "not peaked: the test would not bite"
    for s, (a, b) in enumerate(zip(got, ref)):
        assert torch.equal(a, b), (s, float((a - b).abs().max()))
    # the forward without it (RoPE at row positions, attention over the whole row) was not
    assert max(float((a - b).abs().max()) for a, b in zip(old, ref)) > 1e-5


def test_packed_rows_match_each_sequence_run_alone(sequences):
    """Alone, the linear layers see other matrix shapes (MKL's results depend on M in the last bits), so this
    one is close rather than bit-identical; the packed-only differences are gone."""
    model = _model().eval()
    with torch.no_grad():
        got = _packed_logprobs(model, _batch(sequences, 8))
        old = _packed_logprobs(model, _batch(sequences, 8), isolated=False)
        ref = [_alone_logprobs(model, ids) for ids in sequences]
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    assert worst <= 1e-6, worst
    assert max(float((a - b).abs().max()) for a, b in zip(old, ref)) > worst


def test_default_rope_positions_alone_bring_packed_rows_close_to_one_sequence_per_row(sequences):
    """Without attention per sequence (the default) only RoPE is fixed: the masked product over the whole row
    still rounds differently, but far less than before."""
    model = _model(scale=3.0).eval()
    with torch.no_grad():
        got = _packed_logprobs(model, _batch(sequences, 8), attention="masked")
        old = _packed_logprobs(model, _batch(sequences, 8), isolated=False)
        ref = _packed_logprobs(model, _batch(sequences, 1), attention="masked")
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    assert worst < 1e-5 < max(float((a - b).abs().max()) for a, b in zip(old, ref)), worst


def test_gradients_of_packed_rows_match_one_sequence_per_row(sequences):
    def grads(max_per_bin):
        model = _model(scale=3.0).train()
        lp = _packed_logprobs(model, _batch(sequences, max_per_bin))
        torch.cat(lp).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, unpacked = grads(8), grads(1)
    for name, g in unpacked.items():
        # weight gradients sum over rows * S tokens: another reduction length packed, so close, not equal
        torch.testing.assert_close(packed[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)


def test_hooks_are_removed_after_the_forward_and_on_errors(sequences):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron.rl.packing.packed_forward import isolate_sequences

    model = _model().eval()
    batch = _batch(sequences, 8)
    with torch.no_grad():
        _packed_logprobs(model, batch)
        with pytest.raises(ValueError, match="rows of sequence spans"):
            with isolate_sequences(model, batch.position_ids, batch.sequence_spans()[:-1]):
                model(batch.tokens, batch.position_ids, batch.attention_mask())
    for m in model.modules():
        assert not m._forward_hooks, type(m).__name__
        if isinstance(m, DotProductAttention):
            assert "forward" not in vars(m)


def test_recomputation_keeps_masked_attention_but_rope_positions(sequences, monkeypatch):
    """With activation recomputation the backward re-runs the attention outside the forward call, so only the
    RoPE hook applies (the table is an input of the recomputed layers); forward and gradients stay consistent."""
    import megatron.rl.packing.packed_forward as pf

    def refuse(*args):
        raise AssertionError("attention per sequence must not be used under activation recomputation")

    monkeypatch.setattr(pf, "attention_per_sequence", refuse)
    model = _model(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1).train()
    assert pf.uses_recomputation(model)
    lp = _packed_logprobs(model, _batch(sequences, 8))
    torch.cat(lp).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        ref = [_alone_logprobs(model, ids) for ids in sequences]
    # RoPE at each sequence's own positions: within the masked attention's rounding of the alone forward
    assert max(float((a.detach() - b).abs().max()) for a, b in zip(lp, ref)) < 1e-5


# ------------------------------------------------------------------------------------------ grouped attention
def _brute_force_cost(lengths, overhead):
    """The cheapest split into contiguous runs of power-of-two length classes, by trying every split."""
    import itertools

    classes = sorted({(n - 1).bit_length() for n in lengths})
    members = [[n for n in lengths if (n - 1).bit_length() == c] for c in classes]
    best = None
    for cuts in itertools.product([False, True], repeat=len(classes) - 1):
        cost, group = 0, []
        for i, m in enumerate(members):
            group += m
            if i == len(members) - 1 or cuts[i]:
                cost += overhead + len(group) * max(group) ** 2
                group = []
        best = cost if best is None else min(best, cost)
    return best


def test_attention_groups_exact_and_grouped():
    from megatron.rl.packing.packed_forward import attention_groups, grouped_attention_cost

    lengths = [5, 3, 5, 9, 200, 3, 17]
    assert attention_groups(lengths, "exact") == [[0, 2], [1, 5], [3], [4], [6]]
    # no call overhead: every class alone (padding within a class only); a huge one: a single call
    assert attention_groups(lengths, "grouped", 0) == [[1, 5], [0, 2], [3], [6], [4]]
    assert attention_groups(lengths, "grouped", 10 ** 9) == [list(range(len(lengths)))]
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        n = int(torch.randint(1, 12, (1,), generator=g))
        lens = torch.randint(1, 300, (n,), generator=g).tolist()
        overhead = int(torch.randint(0, 20000, (1,), generator=g))
        groups = attention_groups(lens, "grouped", overhead)
        assert sorted(i for grp in groups for i in grp) == list(range(n))
        assert grouped_attention_cost(lens, overhead) == _brute_force_cost(lens, overhead), (lens, overhead)
    with pytest.raises(ValueError, match="grouping"):
        attention_groups(lengths, "masked")


def test_choose_attention_takes_grouped_only_where_the_masked_product_is_mostly_waste():
    from megatron.rl.packing.packed_forward import choose_attention

    cpu = torch.device("cpu")
    many_short = [[(0, 30), (30, 40), (70, 25), (95, 200)] for _ in range(8)]  # rows of 320, 4 sequences each
    one_each = [[(0, 29)] for _ in range(128)]  # one sequence per row, rows cropped to the longest
    few_in_short_rows = [[(0, 20), (20, 22), (42, 18)] for _ in range(8)]  # the quickstart's 64-token rows
    assert choose_attention(many_short, 320, "auto", cpu) == "grouped"
    assert choose_attention(one_each, 29, "auto", cpu) == "masked"
    assert choose_attention(few_in_short_rows, 64, "auto", cpu) == "masked"
    assert choose_attention([], 64, "auto", cpu) == "masked"
    for mode in ("masked", "exact", "grouped"):
        assert choose_attention(one_each, 29, mode, cpu) == mode


@pytest.fixture(scope="module")
def mixed_sequences():
    """Lengths from 3 to 100 tokens: several power-of-two classes, so grouped calls pad within a class."""
    g = torch.Generator().manual_seed(1)
    lengths = [3, 4, 7, 9, 12, 15, 18, 25, 31, 33, 40, 64, 70, 100, 5, 6, 11, 21]
    return [torch.randint(0, 259, (n,), generator=g).tolist() for n in lengths]


def test_grouped_attention_matches_one_sequence_per_row(mixed_sequences):
    """Grouped calls pad a sequence's keys to the longest of its group (masked out): close to the sequence alone
    (another reduction length in the softmax and the product with V), far closer than the masked row product."""
    from megatron.rl.packing.packed_forward import _Plan

    batch = _batch(mixed_sequences, 8)
    plan = _Plan(batch.sequence_spans(), "grouped", torch.device("cpu"))
    assert len(plan.calls) > 1 and any(mask is not None for _, _, mask, _ in plan.calls), "no padded call: no bite"
    model = _model(scale=3.0).eval()
    with torch.no_grad():
        got = _packed_logprobs(model, batch, attention="grouped")
        masked = _packed_logprobs(model, batch, attention="masked")
        ref = _packed_logprobs(model, _batch(mixed_sequences, 1))  # exact, one sequence per row
        alone = [_alone_logprobs(model, ids) for ids in mixed_sequences]
    assert sum(float(r.abs().mean()) for r in ref) / len(ref) > 1.0, "not peaked: the test would not bite"
    worst = max(float((a - b).abs().max()) for a, b in zip(got, ref))
    assert worst < 1e-5, worst
    assert max(float((a - b).abs().max()) for a, b in zip(got, alone)) < 1e-5
    # the sequences of one length in a call without padding are the exact products
    assert max(float((a - b).abs().max()) for a, b in zip(masked, ref)) < 1e-5


def test_grouped_attention_gradients_match_one_sequence_per_row(mixed_sequences):
    def grads(max_per_bin, attention):
        model = _model(scale=3.0).train()
        lp = _packed_logprobs(model, _batch(mixed_sequences, max_per_bin), attention=attention)
        torch.cat(lp).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    packed, unpacked = grads(8, "grouped"), grads(1, "exact")
    for name, g in unpacked.items():
        torch.testing.assert_close(packed[name], g, rtol=1e-5, atol=1e-5 * float(g.abs().max()), msg=name)
