"""GSPO and CISPO vs plain-Python references (values and gradients written out per case), with every
aggregation, packed against flat layouts, and edge cases (all tokens masked, a single token, nothing at all)."""
import math
import random

import pytest
import torch

from megatron.rl.algorithms import (LossNormalizers, PolicyLossConfig, aggregate_loss, cispo_loss,
                                    compute_token_loss, gspo_loss, ppo_clip_loss)


def _tokens(seed, num_seqs=6, max_len=7, drift=0.002):
    """Sequences laid out in runs with padding; one advantage per sequence (as GRPO gives)."""
    rng = random.Random(seed)
    lp, old, adv, mask, ids = [], [], [], [], []
    for s in range(num_seqs):
        a = rng.gauss(0, 1)
        for _ in range(rng.randint(1, max_len)):
            o = -rng.uniform(0.05, 3)
            old.append(o)
            lp.append(o + rng.uniform(-drift, drift) + (drift if s % 2 else -drift))
            adv.append(a)
            mask.append(rng.random() < 0.85)
            ids.append(s)
        lp.append(0.0), old.append(0.0), adv.append(0.0), mask.append(False), ids.append(-1)
    return lp, old, adv, mask, ids


def ref_gspo(lp, old, adv, mask, ids, lo, hi):
    """Per-token GSPO loss and d(sum over each sequence's mean token loss)/d lp, by explicit cases."""
    groups = {}
    for k, (m, s) in enumerate(zip(mask, ids)):
        if m:
            groups.setdefault(s, []).append(k)
    loss, grad = [0.0] * len(lp), [0.0] * len(lp)
    for s, ks in groups.items():
        ratio = math.exp(sum(lp[k] - old[k] for k in ks) / len(ks))
        a = adv[ks[0]]
        if a >= 0:
            clipped = ratio > 1 + hi
            obj = (1 + hi) * a if clipped else ratio * a
        else:
            clipped = ratio < 1 - lo
            obj = (1 - lo) * a if clipped else ratio * a
        for k in ks:
            loss[k] = -obj
            # mean over the sequence's tokens of a constant = that constant; d ratio / d lp_k = ratio / n
            grad[k] = 0.0 if clipped else -a * ratio / len(ks)
    return loss, grad


def ref_cispo(lp, old, adv, mask, lo, hi):
    """Per-token CISPO value (-c A) and gradient of the token-summed loss (-c A), c the clipped ratio."""
    loss, grad = [], []
    for a, b, c, m in zip(lp, old, adv, mask):
        if not m:
            loss.append(0.0), grad.append(0.0)
            continue
        r = math.exp(a - b)
        w = 1 - lo if r < 1 - lo else (1 + hi if r > 1 + hi else r)
        loss.append(-w * c)
        grad.append(-w * c)
    return loss, grad


def _t(v, dtype=torch.float64):
    return torch.tensor(v, dtype=dtype)


@pytest.mark.parametrize("seed,eps", [(0, (3e-4, 4e-4)), (1, (3e-4, 4e-4)), (2, (0.01, 0.02))])
def test_gspo_matches_reference_values_and_gradients(seed, eps):
    lp, old, adv, mask, ids = _tokens(seed)
    x = _t(lp).requires_grad_()
    loss, stats = gspo_loss(x, _t(old), _t(adv), torch.tensor(mask), *eps, seq_ids=torch.tensor(ids))
    ref_loss, ref_grad = ref_gspo(lp, old, adv, mask, ids, *eps)
    torch.testing.assert_close(loss.detach(), _t(ref_loss), rtol=1e-12, atol=1e-14)
    total = aggregate_loss(loss, torch.tensor(mask, dtype=torch.float64), "sequence",
                           LossNormalizers(num_sequences=1.0), seq_ids=torch.tensor(ids))
    total.backward()
    torch.testing.assert_close(x.grad, _t(ref_grad), rtol=1e-10, atol=1e-14)
    if eps[0] == 3e-4:  # the published range clips some of these sequences and not others
        assert 0 < float(stats["clip_fraction_low"]) + float(stats["clip_fraction_high"]) < 1


@pytest.mark.parametrize("eps", [(1.0, 3.0), (0.2, 0.28), (0.1, 0.1)])
def test_cispo_matches_reference_values_and_gradients(eps):
    lp, old, adv, mask, _ = _tokens(5, drift=0.4)
    x = _t(lp).requires_grad_()
    loss, stats = cispo_loss(x, _t(old), _t(adv), torch.tensor(mask), *eps)
    ref_loss, ref_grad = ref_cispo(lp, old, adv, mask, *eps)
    torch.testing.assert_close(loss.detach(), _t(ref_loss), rtol=1e-12, atol=1e-14)
    loss.sum().backward()
    torch.testing.assert_close(x.grad, _t(ref_grad), rtol=1e-10, atol=1e-14)


def test_cispo_keeps_gradients_where_ppo_clip_drops_them():
    lp = torch.log(_t([1.5, 0.5])).requires_grad_()
    adv = _t([1.0, -1.0])
    cispo_loss(lp, torch.zeros(2, dtype=torch.float64), adv, torch.ones(2), 0.2, 0.2)[0].sum().backward()
    torch.testing.assert_close(lp.grad, _t([-1.2, 0.8]))  # weights capped at 1.2 / 0.8, gradients kept
    lp.grad = None
    ppo_clip_loss(lp, torch.zeros(2, dtype=torch.float64), adv, torch.ones(2), 0.2, 0.2)[0].sum().backward()
    torch.testing.assert_close(lp.grad, _t([0.0, 0.0]))


def test_single_token_sequences_gspo_is_ppo_clip():
    lp, old, adv, mask, _ = _tokens(3, max_len=1, drift=0.3)
    ids = list(range(len(lp)))  # every token its own sequence
    g, _ = gspo_loss(_t(lp), _t(old), _t(adv), torch.tensor(mask), 0.2, 0.2, seq_ids=torch.tensor(ids))
    p, _ = ppo_clip_loss(_t(lp), _t(old), _t(adv), torch.tensor(mask), 0.2, 0.2)
    torch.testing.assert_close(g, p)


@pytest.mark.parametrize("loss_fn", [gspo_loss, cispo_loss])
def test_all_tokens_masked_and_empty(loss_fn):
    lp = _t([float("nan"), -1.0, -2.0]).requires_grad_()
    loss, stats = loss_fn(lp, _t([0.0, -1.5, -1.0]), _t([1.0, 1.0, -1.0]), torch.zeros(3),
                          seq_ids=torch.tensor([0, 0, 1]))
    assert torch.equal(loss.detach(), torch.zeros(3, dtype=torch.float64))
    loss.sum().backward()
    assert torch.equal(lp.grad, torch.zeros(3, dtype=torch.float64))  # no NaN from the garbage position
    assert int(stats["num_tokens"]) == 0 and float(stats["ratio_mean"]) == 0
    e = torch.zeros(0, dtype=torch.float64)
    loss, _ = loss_fn(e, e, e, e, seq_ids=torch.zeros(0, dtype=torch.long))
    assert loss.numel() == 0


def test_gspo_needs_sequence_ids():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="seq_ids"):
        gspo_loss(x, x, x, torch.ones(3))


@pytest.mark.parametrize("name", ["ppo_clip", "gspo", "cispo"])
@pytest.mark.parametrize("aggregation", ["token", "sequence", "drgrpo"])
def test_packed_rows_equal_flat_and_micro_batches_sum_to_the_step(name, aggregation):
    """The per-token loss on [rows, S] packed rows equals the flat one; micro-batches of whole rows (never a
    sequence split between two) sum to the whole step's loss and gradient, for every aggregation."""
    rng = random.Random(11)
    rows, S = 4, 12
    lp, old, adv, mask, ids = (torch.zeros(rows, S, dtype=torch.float64) for _ in range(5))
    ids.fill_(-1)
    seq = 0
    for r in range(rows):  # 2-3 sequences per row, then padding
        pos = 0
        for _ in range(rng.randint(2, 3)):
            n = rng.randint(2, 4)
            a = rng.gauss(0, 1)
            for _ in range(n):
                o = -rng.uniform(0.1, 2)
                old[r, pos], lp[r, pos], adv[r, pos] = o, o + rng.uniform(-0.3, 0.3), a
                mask[r, pos], ids[r, pos] = float(rng.random() < 0.9), seq
                pos += 1
            seq += 1
    ids = ids.long()
    cfg = PolicyLossConfig(policy_loss=name, eps_lower=0.1, eps_upper=0.15)
    norm = LossNormalizers(num_tokens=float(mask.sum()), num_sequences=float(seq), max_len=8.0)

    def step_loss(sl):
        x = lp[sl].clone().requires_grad_()
        tok, _ = compute_token_loss(cfg, x.reshape(-1), old[sl].reshape(-1), adv[sl].reshape(-1),
                                    mask[sl].reshape(-1), seq_ids=ids[sl].reshape(-1))
        total = aggregate_loss(tok, mask[sl].reshape(-1), aggregation, norm, seq_ids=ids[sl].reshape(-1))
        total.backward()
        return total.detach(), x.grad, tok.detach()

    whole, whole_grad, whole_tok = step_loss(slice(0, rows))
    parts = [step_loss(slice(i, i + 2)) for i in (0, 2)]
    torch.testing.assert_close(sum(p[0] for p in parts), whole, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(torch.cat([p[1] for p in parts]), whole_grad, rtol=1e-12, atol=1e-14)
    # flat layout: the same tokens in one row give the same per-token loss
    flat, _ = compute_token_loss(cfg, lp.reshape(-1), old.reshape(-1), adv.reshape(-1), mask.reshape(-1),
                                 seq_ids=ids.reshape(-1))
    torch.testing.assert_close(flat, whole_tok.reshape(-1))


def test_config_defaults_are_each_losss_published_clip():
    assert PolicyLossConfig().clip_range == (0.2, 0.2)
    assert PolicyLossConfig(policy_loss="gspo").clip_range == (3e-4, 4e-4)
    assert PolicyLossConfig(policy_loss="cispo").clip_range == (1.0, 3.0)
    assert PolicyLossConfig(policy_loss="gspo", eps_upper=0.01).clip_range == (3e-4, 0.01)


def test_a_sequence_without_loss_tokens_changes_nothing_for_the_others():
    """An empty group (a sequence whose tokens are all masked, between others in a packed row) gets loss 0 and
    leaves the other sequences' ratios, losses and gradients as they are without it."""
    lp, old, adv, mask, ids = _tokens(8, num_seqs=3)
    extra = [-0.3, -1.2, float("nan")]  # a masked sequence with garbage log-probs
    full = lambda a, b: a[:len(a) // 2] + b + a[len(a) // 2:]  # noqa: E731
    cut = len(lp) // 2
    ids_with = ids[:cut] + [99] * 3 + ids[cut:]
    for fn in (gspo_loss, cispo_loss):
        x = _t(lp).requires_grad_()
        alone, _ = fn(x, _t(old), _t(adv), torch.tensor(mask), 0.01, 0.02, seq_ids=torch.tensor(ids))
        alone.sum().backward()
        y = _t(full(lp, extra)).requires_grad_()
        both, _ = fn(y, _t(full(old, [0.0] * 3)), _t(full(adv, [1.0] * 3)), torch.tensor(full(mask, [False] * 3)),
                     0.01, 0.02, seq_ids=torch.tensor(ids_with))
        both.sum().backward()
        torch.testing.assert_close(torch.cat([both[:cut], both[cut + 3:]]).detach(), alone.detach())
        assert torch.equal(both[cut:cut + 3].detach(), torch.zeros(3, dtype=torch.float64))
        torch.testing.assert_close(torch.cat([y.grad[:cut], y.grad[cut + 3:]]), x.grad)
