"""Off-policy corrections (truncated / masked / sequence-level IS, sequence rejection, mismatch metrics) vs
plain-Python references that loop over tokens and group them by sequence in dicts; edge cases."""
import math
import random

import pytest
import torch

from megatron.rl.algorithms import (IS_CORRECTIONS, CorrectionParams, masked_is_weights, mismatch_sums,
                                    reject_sequences, sequence_is_weights, truncated_is_weights)
from megatron.rl.algorithms.importance_sampling import trust_region_is_weights
from megatron.rl.algorithms.segments import segments_of


def _batch(n, seed, num_seqs=5, spread=0.8):
    """Flat tokens of ``num_seqs`` sequences laid out in runs (as packing does), padding (-1) between them."""
    rng = random.Random(seed)
    seq_ids, mask, old, inf = [], [], [], []
    for s in range(num_seqs):
        for _ in range(rng.randint(1, n)):
            seq_ids.append(s)
            mask.append(rng.random() < 0.8)
            o = -rng.uniform(0.05, 3)
            old.append(o)
            inf.append(o + rng.uniform(-spread, spread))
        seq_ids.append(-1)  # padding
        mask.append(False)
        old.append(float("nan"))  # garbage the corrections must ignore
        inf.append(0.0)
    return old, inf, mask, seq_ids


def _t(v, dtype=torch.float64):
    return torch.tensor(v, dtype=dtype)


def _by_sequence(values, mask, seq_ids):
    groups = {}
    for v, m, s in zip(values, mask, seq_ids):
        if m:
            groups.setdefault(s, []).append(v)
    return groups


def ref_truncated(old, inf, mask, c):
    return [min(math.exp(o - i), c) if m else 0.0 for o, i, m in zip(old, inf, mask)]


def ref_masked(old, inf, mask, lo, hi):
    out = []
    for o, i, m in zip(old, inf, mask):
        r = math.exp(o - i) if m else 0.0
        out.append(r if m and lo <= r <= hi else 0.0)
    return out


def ref_sequence(old, inf, mask, seq_ids, c):
    log_r = _by_sequence([o - i for o, i in zip(old, inf)], mask, seq_ids)
    geo = {s: math.exp(sum(v) / len(v)) for s, v in log_r.items()}  # exp of the mean = geometric mean of ratios
    return [min(geo[s], c) if m else 0.0 for m, s in zip(mask, seq_ids)]


def ref_trust_region(old, inf, mask, adv, c, lo, hi):
    out = []
    for o, i, m, a in zip(old, inf, mask, adv):
        if not m:
            out.append(0.0)
            continue
        r = math.exp(o - i)
        if a > 0 and r > hi:  # already raised past the band: old evidence does not push it further
            out.append(0.0)
        elif a < 0 and r < lo:
            out.append(0.0)
        else:
            out.append(min(r, c))
    return out


def ref_rejected(old, inf, mask, seq_ids, max_abs, mean_abs):
    gaps = _by_sequence([abs(o - i) for o, i in zip(old, inf)], mask, seq_ids)
    bad = set()
    for s, g in gaps.items():
        if (max_abs is not None and max(g) > max_abs) or (mean_abs is not None and sum(g) / len(g) > mean_abs):
            bad.add(s)
    return bad, len(gaps)


def test_registered_corrections():
    assert IS_CORRECTIONS.names() == ["masked", "sequence", "truncated", "trust_region"]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncated_masked_sequence_match_references(seed):
    old, inf, mask, seq_ids = _batch(12, seed)
    params = CorrectionParams(truncation_coef=1.4, mask_low=0.6, mask_high=1.5)
    O, I, M, S = _t(old), _t(inf), torch.tensor(mask), torch.tensor(seq_ids)
    w, st = truncated_is_weights(O, I, M, 1.4)
    torch.testing.assert_close(w, _t(ref_truncated(old, inf, mask, 1.4)), rtol=1e-12, atol=0)
    sel = [(o, i) for o, i, m in zip(old, inf, mask) if m]
    assert float(st["is_truncated_fraction"]) == pytest.approx(sum(math.exp(o - i) > 1.4 for o, i in sel) / len(sel))
    w, st = masked_is_weights(O, I, M, params=params)
    ref = ref_masked(old, inf, mask, 0.6, 1.5)
    torch.testing.assert_close(w, _t(ref), rtol=1e-12, atol=0)
    outside = sum(not 0.6 <= math.exp(o - i) <= 1.5 for o, i in sel) / len(sel)
    assert float(st["is_masked_fraction"]) == pytest.approx(outside) and 0 < outside < 1
    w, st = sequence_is_weights(O, I, M, seq_ids=S, params=params)
    torch.testing.assert_close(w, _t(ref_sequence(old, inf, mask, seq_ids, 1.4)), rtol=1e-12, atol=0)
    assert float(st["is_weight_mean"]) == pytest.approx(
        sum(x for x, m in zip(ref_sequence(old, inf, mask, seq_ids, 1.4), mask) if m) / len(sel))
    adv = [random.Random(seed).gauss(0, 1) * (k % 3 != 0) for k in range(len(old))]  # some exactly 0
    w, st = trust_region_is_weights(O, I, M, params=params, advantages=_t(adv))
    ref = ref_trust_region(old, inf, mask, adv, 1.4, 0.6, 1.5)
    torch.testing.assert_close(w, _t(ref), rtol=1e-12, atol=0)
    dropped = sum(1 for o, i, m, a in zip(old, inf, mask, adv) if m and (
        (a > 0 and math.exp(o - i) > 1.5) or (a < 0 and math.exp(o - i) < 0.6))) / len(sel)
    assert float(st["is_masked_fraction"]) == pytest.approx(dropped) and 0 < dropped < 1


def test_sequence_weight_is_constant_per_sequence_and_differs_from_token_mean():
    # one sequence of ratios e^1 and e^-1: geometric mean 1, arithmetic mean cosh(1) ~ 1.54
    old, inf = _t([1.0, -1.0]), _t([0.0, 0.0])
    w, _ = sequence_is_weights(old, inf, torch.ones(2), seq_ids=torch.tensor([3, 3]))
    torch.testing.assert_close(w, _t([1.0, 1.0]))


def test_packed_rows_equal_flat_layout():
    """[rows, S] packed tensors give the same weights as their flattening (segments follow seq ids, not rows)."""
    old, inf, mask, seq_ids = _batch(6, 4, num_seqs=4)
    n = len(old) + (-len(old)) % 4
    pad = n - len(old)
    old, inf, mask, seq_ids = old + [0.0] * pad, inf + [0.0] * pad, mask + [False] * pad, seq_ids + [-1] * pad
    flat, _ = sequence_is_weights(_t(old), _t(inf), torch.tensor(mask), seq_ids=torch.tensor(seq_ids))
    rows, _ = sequence_is_weights(_t(old).view(4, -1), _t(inf).view(4, -1), torch.tensor(mask).view(4, -1),
                                  seq_ids=torch.tensor(seq_ids).view(4, -1))
    torch.testing.assert_close(rows.reshape(-1), flat)


@pytest.mark.parametrize("fn", ["truncated", "masked", "sequence", "trust_region"])
def test_all_tokens_masked_gives_zero_weights_and_zero_stats(fn):
    old, inf = _t([-1.0, float("nan"), -3.0]), _t([-2.0, 0.0, -1.0])
    w, st = IS_CORRECTIONS.get(fn)(old, inf, torch.zeros(3), seq_ids=torch.tensor([0, 0, 1]), params=CorrectionParams(),
                                   advantages=_t([1.0, -1.0, 1.0]))
    assert torch.equal(w, torch.zeros(3, dtype=torch.float64))
    assert all(float(v) == 0 for v in st.values())


@pytest.mark.parametrize("fn", ["truncated", "masked", "sequence", "trust_region"])
def test_single_token(fn):
    old, inf = _t([-0.5]), _t([-0.7])
    r = math.exp(0.2)
    w, _ = IS_CORRECTIONS.get(fn)(old, inf, torch.ones(1), seq_ids=torch.tensor([0]), advantages=_t([1.0]),
                                  params=CorrectionParams(truncation_coef=1.1, mask_low=0.9, mask_high=1.1))
    expected = {"truncated": min(r, 1.1), "masked": 0.0 if r > 1.1 else r, "sequence": min(r, 1.1),
                "trust_region": 0.0}[fn]  # A > 0 and r = 1.22 > hi: the trust region drops it
    assert float(w) == pytest.approx(expected)


def test_empty_batch():
    e = torch.zeros(0, dtype=torch.float64)
    for fn in IS_CORRECTIONS.names():
        w, st = IS_CORRECTIONS.get(fn)(e, e, torch.zeros(0), seq_ids=torch.zeros(0, dtype=torch.long),
                                       params=CorrectionParams(), advantages=e)
        assert w.numel() == 0 and float(st["is_weight_mean"]) == 0
    keep, st = reject_sequences(e, e, torch.zeros(0), torch.zeros(0, dtype=torch.long), 0.1, 0.1)
    assert keep.numel() == 0 and int(st["num_sequences"]) == 0 and int(st["num_rejected"]) == 0
    sums = mismatch_sums(e, e, torch.zeros(0))
    assert float(sums["num_tokens"]) == 0 and float(sums["abs_max"]) == 0


def test_masked_band_edges_are_kept():
    r = _t([0.5, 2.0, 0.4999, 2.0001])
    w, _ = masked_is_weights(torch.log(r), torch.zeros(4, dtype=torch.float64), torch.ones(4),
                             params=CorrectionParams(mask_low=0.5, mask_high=2.0))
    torch.testing.assert_close(w, _t([0.5, 2.0, 0.0, 0.0]))


def test_bad_params():
    x = torch.zeros(2)
    with pytest.raises(ValueError, match="mask-low"):
        masked_is_weights(x, x, torch.ones(2), params=CorrectionParams(mask_low=2.0, mask_high=1.0))
    with pytest.raises(ValueError, match="truncation-coef"):
        sequence_is_weights(x, x, torch.ones(2), seq_ids=torch.zeros(2, dtype=torch.long),
                            params=CorrectionParams(truncation_coef=0.0))
    with pytest.raises(ValueError, match="seq_ids"):
        sequence_is_weights(x, x, torch.ones(2))
    with pytest.raises(ValueError, match="advantages"):
        trust_region_is_weights(x, x, torch.ones(2))
    with pytest.raises(ValueError, match="shape"):
        masked_is_weights(x, torch.zeros(3), torch.ones(2))


@pytest.mark.parametrize("thresholds", [(0.5, None), (None, 0.3), (0.6, 0.25), (None, None)])
def test_rejection_matches_reference(thresholds):
    old, inf, mask, seq_ids = _batch(10, 9, num_seqs=8)
    keep, st = reject_sequences(_t(old), _t(inf), torch.tensor(mask), torch.tensor(seq_ids), *thresholds)
    bad, count = ref_rejected(old, inf, mask, seq_ids, *thresholds)
    expected = [0.0 if not m or s in bad else 1.0 for m, s in zip(mask, seq_ids)]
    torch.testing.assert_close(keep, _t(expected))
    assert int(st["num_rejected"]) == len(bad) and int(st["num_sequences"]) == count
    if thresholds != (None, None):
        assert 0 < len(bad) < count  # the thresholds do split the batch


def test_mismatch_sums_match_reference():
    old, inf, mask, _ = _batch(10, 3)
    sums = mismatch_sums(_t(old), _t(inf), torch.tensor(mask))
    sel = [(o, i) for o, i, m in zip(old, inf, mask) if m]
    assert float(sums["num_tokens"]) == len(sel)
    assert float(sums["abs_sum"]) == pytest.approx(sum(abs(o - i) for o, i in sel))
    assert float(sums["abs_max"]) == pytest.approx(max(abs(o - i) for o, i in sel))
    # k3 of KL(q || p) from samples of q: p/q - 1 - log(p/q), p = trainer (old), q = inference
    assert float(sums["k3_sum"]) == pytest.approx(sum(math.exp(o - i) - 1 - (o - i) for o, i in sel))


def test_k3_mean_estimates_kl_of_the_sampling_policy():
    """Tokens drawn from q: the mean k3 approaches KL(q || p) computed from the two distributions."""
    q = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    p = torch.tensor([0.4, 0.4, 0.2], dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, 200000, replacement=True, generator=g)
    sums = mismatch_sums(p.log()[draws], q.log()[draws], torch.ones(draws.numel()))
    kl = float((q * (q / p).log()).sum())
    assert float(sums["k3_sum"] / sums["num_tokens"]) == pytest.approx(kl, rel=0.05)


def test_segments_reductions():
    mask = torch.tensor([1, 1, 0, 1, 1, 1, 0])
    ids = torch.tensor([7, 7, 7, 2, 2, 9, -1])
    seg = segments_of(mask, ids)
    v = _t([1.0, 3.0, 100.0, 2.0, 6.0, 5.0, 100.0])
    assert seg.count == 3
    # segments are numbered by sorted sequence id: 2, 7, 9
    torch.testing.assert_close(seg.sum(v), _t([8.0, 4.0, 5.0]))
    torch.testing.assert_close(seg.mean(v), _t([4.0, 2.0, 5.0]))
    torch.testing.assert_close(seg.max(v), _t([6.0, 3.0, 5.0]))
    torch.testing.assert_close(seg.broadcast(_t([10.0, 20.0, 30.0])), _t([20.0, 20.0, 0.0, 10.0, 10.0, 30.0, 0.0]))


@pytest.mark.parametrize("mode", ["truncated", "masked", "sequence", "trust_region"])
def test_compute_token_loss_applies_the_mode_and_rejection(mode):
    """loss_t = keep_s * w_t * ppo_t: the reference composes the pieces above by hand."""
    from megatron.rl.algorithms import PolicyLossConfig, compute_token_loss
    from tests.unit_tests.rl.algorithms.test_policy_loss import ref_ppo_token

    old, inf, mask, seq_ids = _batch(8, 21, num_seqs=6, spread=0.5)
    rng = random.Random(2)
    lp = [o + rng.uniform(-0.3, 0.3) if m else 0.0 for o, m in zip(old, mask)]
    adv = [rng.gauss(0, 1) for _ in old]
    old = [o if m else 0.0 for o, m in zip(old, mask)]
    cfg = PolicyLossConfig(is_mode=mode, is_truncation_coef=1.3, is_mask_low=0.7, is_mask_high=1.4,
                           reject_max_log_ratio=0.45)
    loss, stats = compute_token_loss(cfg, _t(lp), _t(old), _t(adv), torch.tensor(mask), inference_logprobs=_t(inf),
                                     seq_ids=torch.tensor(seq_ids))
    w = {"truncated": ref_truncated(old, inf, mask, 1.3), "masked": ref_masked(old, inf, mask, 0.7, 1.4),
         "sequence": ref_sequence(old, inf, mask, seq_ids, 1.3),
         "trust_region": ref_trust_region(old, inf, mask, adv, 1.3, 0.7, 1.4)}[mode]
    bad, count = ref_rejected(old, inf, mask, seq_ids, 0.45, None)
    expected = [0.0 if not m or s in bad else wt * ref_ppo_token(a, b, c, 0.2, 0.2)
                for a, b, c, m, s, wt in zip(lp, old, adv, mask, seq_ids, w)]
    torch.testing.assert_close(loss, _t(expected), rtol=1e-10, atol=1e-12)
    assert int(stats["num_rejected"]) == len(bad) > 0 and int(stats["num_sequences"]) == count
