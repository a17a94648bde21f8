"""Aggregation modes vs references; micro-batch splits with global normalisers sum to the full loss."""
import random

import pytest
import torch

from megatron.rl.algorithms import (AGGREGATIONS, LossNormalizers, PolicyLossConfig, aggregate_loss,
                                    compute_token_loss, local_normalizers)


def _batch(num_seqs=9, seed=0):
    """Ragged sequences flattened into one token stream, with per-token seq ids."""
    rng = random.Random(seed)
    losses, masks, ids = [], [], []
    for s in range(num_seqs):
        n = rng.randint(1, 12)
        losses.append([rng.gauss(0, 1) for _ in range(n)])
        m = [rng.random() < 0.7 for _ in range(n)]
        if s == 3:
            m = [False] * n  # a sequence without loss tokens does not count
        masks.append(m)
        ids.append([s] * n)
    return losses, masks, ids


def ref_aggregate(losses, masks, mode, max_len=16):
    seqs = [(l, m) for l, m in zip(losses, masks) if any(m)]
    total_tokens = sum(sum(m) for _, m in seqs)
    if mode == "token":
        return sum(x for l, m in seqs for x, k in zip(l, m) if k) / total_tokens
    if mode == "sequence":
        return sum(sum(x for x, k in zip(l, m) if k) / sum(m) for l, m in seqs) / len(seqs)
    if mode == "drgrpo":
        return sum(x for l, m in seqs for x, k in zip(l, m) if k) / (len(seqs) * max_len)
    raise KeyError(mode)


def _flat(rows, dtype=torch.float64):
    return torch.tensor([x for r in rows for x in r], dtype=dtype)


def test_every_mode_has_a_reference():
    assert AGGREGATIONS.names() == ["drgrpo", "sequence", "token"]


@pytest.mark.parametrize("mode", ["token", "sequence", "drgrpo"])
def test_full_batch_matches_reference(mode):
    losses, masks, ids = _batch()
    loss, mask, seq_ids = _flat(losses), _flat(masks, torch.bool), _flat(ids, torch.long)
    nt, ns = local_normalizers(mask, seq_ids)
    out = aggregate_loss(loss, mask, mode, LossNormalizers(nt, ns, 16), seq_ids)
    assert out.item() == pytest.approx(ref_aggregate(losses, masks, mode), rel=1e-12)


@pytest.mark.parametrize("mode", ["token", "sequence", "drgrpo"])
@pytest.mark.parametrize("split", [[9], [1] * 9, [4, 5], [2, 3, 4]])
def test_microbatch_split_sums_to_full_loss_and_gradient(mode, split):
    """Same global loss and gradients for any split of sequences into micro-batches / DP ranks."""
    cfg = PolicyLossConfig(eps_lower=0.2, eps_upper=0.28, kl_beta=0.1)
    g = torch.Generator().manual_seed(1)
    lengths = [int(x) for x in torch.randint(2, 10, (9,), generator=g)]
    n = sum(lengths)
    seq_ids = torch.repeat_interleave(torch.arange(9), torch.tensor(lengths))
    params = torch.randn(n, dtype=torch.float64, generator=g) * 0.3 - 1.0
    old = params + torch.randn(n, dtype=torch.float64, generator=g) * 0.2
    ref = params + torch.randn(n, dtype=torch.float64, generator=g) * 0.2
    adv = torch.randn(9, dtype=torch.float64, generator=g)[seq_ids]
    mask = torch.rand(n, generator=g) < 0.8

    def run(groups_of_seqs):
        lp = params.clone().requires_grad_()
        nt, ns = 0, 0
        for seqs in groups_of_seqs:  # first pass: local counts, "all-reduced" by summing
            sel = torch.isin(seq_ids, torch.tensor(seqs))
            a, b = local_normalizers(mask[sel], seq_ids[sel])
            nt, ns = nt + a, ns + b
        norm = LossNormalizers(nt, ns, max_len=12)
        total = 0.0
        for seqs in groups_of_seqs:
            sel = torch.isin(seq_ids, torch.tensor(seqs))
            tok, _ = compute_token_loss(cfg, lp[sel], old[sel], adv[sel], mask[sel], ref_logprobs=ref[sel])
            mb = aggregate_loss(tok, mask[sel], mode, norm, seq_ids[sel])
            mb.backward()
            total += mb.item()
        return total, lp.grad

    full_loss, full_grad = run([list(range(9))])
    bounds = [0]
    for s in split:
        bounds.append(bounds[-1] + s)
    order = [4, 0, 8, 2, 6, 1, 3, 7, 5]  # micro-batches need not hold consecutive sequences
    loss, grad = run([order[bounds[i]:bounds[i + 1]] for i in range(len(split))])
    assert loss == pytest.approx(full_loss, abs=1e-12)
    torch.testing.assert_close(grad, full_grad, rtol=0, atol=1e-12)
    assert full_grad.abs().sum() > 0


def test_bad_inputs():
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="num_tokens"):
        aggregate_loss(x, x, "token", LossNormalizers())
    with pytest.raises(ValueError, match="> 0"):
        aggregate_loss(x, x, "token", LossNormalizers(num_tokens=0))
    with pytest.raises(ValueError, match="seq_ids"):
        aggregate_loss(x, x, "sequence", LossNormalizers(num_sequences=2))
    with pytest.raises(ValueError, match="max_len"):
        aggregate_loss(x, x, "drgrpo", LossNormalizers(num_sequences=2))
    with pytest.raises(ValueError, match="--grpo-loss-aggregation"):
        aggregate_loss(x, x, "mean", LossNormalizers(1, 1, 1))
    with pytest.raises(ValueError, match="same shape"):
        aggregate_loss(x, torch.zeros(3), "token", LossNormalizers(1))


def test_all_padding_microbatch_contributes_zero_with_graph():
    lp = torch.randn(5, requires_grad=True)
    out = aggregate_loss(lp * 2, torch.zeros(5), "sequence", LossNormalizers(num_sequences=3),
                         torch.full((5,), -1))
    assert out.item() == 0.0 and out.requires_grad


@pytest.mark.slow  # torchrun + megatron-core imports: ~10 s CPU, 30+ s wall on a loaded machine
@pytest.mark.multiprocess
def test_megatron_schedule_dp2_packed_equals_full_batch(torchrun):
    """The documented megatron-core convention (calculate_per_token_loss=True, token count 0) makes
    DP=2 x packed micro-batches give the full-batch global loss and gradient."""
    import json
    from pathlib import Path

    script = Path(__file__).parent / "scripts" / "schedule_global_loss.py"
    proc = torchrun(script, args=["token,sequence,drgrpo"], nproc=2, timeout=400)
    results = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1][len("RESULT "):])
    assert sorted(results) == ["drgrpo", "sequence", "token"]
    for mode, r in results.items():
        assert r["num_bins"] < 10 and r["num_microbatches"] >= 2, (mode, r)
        assert r["loss"] == pytest.approx(r["ref_loss"], abs=1e-6), (mode, r)
        assert r["grad_max_abs_diff"] < 1e-6 and r["grad_norm"] > 1e-2, (mode, r)
