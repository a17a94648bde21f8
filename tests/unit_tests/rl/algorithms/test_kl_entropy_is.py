"""KL estimators, entropy and truncated importance sampling vs slow references."""
import math
import random

import numpy as np
import pytest
import torch

from megatron.rl.algorithms import (KL_ESTIMATORS, entropy_bonus, entropy_from_logits, entropy_from_partials,
                                    entropy_partials, kl_penalty, logprob_gap_stats, truncated_is_weights)

REF_KL = {
    "k1": lambda lp, ref: lp - ref,
    "k2": lambda lp, ref: 0.5 * (math.log(math.exp(ref) / math.exp(lp))) ** 2,
    "k3": lambda lp, ref: math.exp(ref) / math.exp(lp) - 1 - math.log(math.exp(ref) / math.exp(lp)),
}


def _pairs(n, seed):
    rng = random.Random(seed)
    return [(-rng.uniform(0.01, 4), -rng.uniform(0.01, 4)) for _ in range(n)]


def test_every_kl_estimator_has_a_reference():
    assert set(KL_ESTIMATORS.names()) == set(REF_KL)


@pytest.mark.parametrize("name", sorted(REF_KL))
def test_kl_matches_reference(name):
    pairs = _pairs(50, 1)
    lp = torch.tensor([p[0] for p in pairs], dtype=torch.float64)
    ref = torch.tensor([p[1] for p in pairs], dtype=torch.float64)
    out = kl_penalty(lp, ref, beta=0.3, estimator=name)
    expected = torch.tensor([0.3 * REF_KL[name](a, b) for a, b in pairs], dtype=torch.float64)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_k2_k3_nonnegative_and_zero_at_equality():
    lp = torch.randn(1000, dtype=torch.float64) * 3
    ref = torch.randn(1000, dtype=torch.float64) * 3
    for name in ("k2", "k3"):
        assert (kl_penalty(lp, ref, 1.0, name) >= 0).all()
        assert torch.equal(kl_penalty(lp, lp.clone(), 1.0, name), torch.zeros_like(lp))


def test_k3_unbiased_and_k1_mean_estimate_true_kl():
    # sample from p, both k1 and k3 are unbiased estimators of KL(p || q)
    p = torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)
    q = torch.tensor([0.2, 0.5, 0.3], dtype=torch.float64)
    true_kl = float((p * (p / q).log()).sum())
    idx = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    lp, ref = p.log()[idx], q.log()[idx]
    for name in ("k1", "k3"):
        assert abs(float(kl_penalty(lp, ref, 1.0, name).mean()) - true_kl) < 5e-3


def test_k3_gradient_only_through_logprobs():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0], requires_grad=True)
    kl_penalty(lp, ref, 1.0, "k3").sum().backward()
    assert ref.grad is None
    # d/dlp (exp(ref - lp) - 1 - (ref - lp)) = -exp(ref - lp) + 1
    torch.testing.assert_close(lp.grad, 1 - torch.exp(ref.detach() - lp.detach()))


def test_k3_clamped_stays_finite():
    out = kl_penalty(torch.tensor([-200.0]), torch.tensor([0.0]), 1.0, "k3")
    assert torch.isfinite(out).all()


def test_beta_zero_needs_no_reference_and_beta_positive_does():
    lp = torch.randn(5)
    assert torch.equal(kl_penalty(lp, None, 0.0), torch.zeros(5))
    with pytest.raises(ValueError, match="--grpo-kl-beta"):
        kl_penalty(lp, None, 0.1)
    with pytest.raises(ValueError, match="--grpo-kl-beta"):
        kl_penalty(lp, lp, -1.0)
    with pytest.raises(ValueError, match="--grpo-kl-estimator"):
        kl_penalty(lp, lp, 1.0, "k9")


def _np_entropy(logits):
    out = []
    for row in logits:
        m = row.max()
        p = np.exp(row - m)
        p /= p.sum()
        out.append(-sum(pi * math.log(pi) for pi in p if pi > 0))
    return np.array(out)


def test_entropy_from_logits_matches_numpy():
    logits = torch.randn(6, 11, dtype=torch.float64) * 4
    logits[0] = 0.0  # uniform: entropy log(V)
    out = entropy_from_logits(logits)
    torch.testing.assert_close(out, torch.tensor(_np_entropy(logits.numpy())), rtol=1e-10, atol=1e-12)
    assert abs(float(out[0]) - math.log(11)) < 1e-12


def test_vocab_parallel_entropy_equals_full():
    logits = torch.randn(5, 12, dtype=torch.float64) * 3
    shards = logits.chunk(3, dim=-1)
    gmax = torch.stack([s.max(dim=-1).values for s in shards]).max(dim=0).values  # all-reduce MAX
    parts = [entropy_partials(s.double(), gmax) for s in shards]
    s_exp = sum(p[0] for p in parts)  # all-reduce SUM
    s_shift = sum(p[1] for p in parts)
    torch.testing.assert_close(entropy_from_partials(s_exp, s_shift).double(), entropy_from_logits(logits),
                               rtol=1e-6, atol=1e-6)


def test_entropy_bonus_sign():
    h = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(entropy_bonus(h, 0.1), torch.tensor([-0.1, -0.2]))
    assert torch.equal(entropy_bonus(h, 0.0), torch.zeros(2))


def test_truncated_is_weights_vs_reference():
    rng = random.Random(3)
    old = [-rng.uniform(0, 3) for _ in range(40)]
    inf = [o + rng.uniform(-1.5, 1.5) for o in old]
    mask = [rng.random() < 0.8 for _ in old]
    w, stats = truncated_is_weights(torch.tensor(old, requires_grad=True), torch.tensor(inf), torch.tensor(mask),
                                    truncation_coef=1.5)
    expected = [min(math.exp(o - i), 1.5) if m else 0.0 for o, i, m in zip(old, inf, mask)]
    torch.testing.assert_close(w, torch.tensor(expected), rtol=1e-5, atol=1e-6)
    assert not w.requires_grad
    gaps = [abs(o - i) for o, i, m in zip(old, inf, mask) if m]
    assert abs(float(stats["logprob_gap_mean_abs"]) - sum(gaps) / len(gaps)) < 1e-6
    assert abs(float(stats["logprob_gap_max_abs"]) - max(gaps)) < 1e-6
    raw = [math.exp(o - i) for o, i, m in zip(old, inf, mask) if m]
    assert abs(float(stats["is_truncated_fraction"]) - sum(r > 1.5 for r in raw) / len(raw)) < 1e-12
    assert int(stats["num_tokens"]) == sum(mask)


def test_is_bad_input():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="--rl-importance-sampling-truncation-coef"):
        truncated_is_weights(x, x, torch.ones(3), 0.0)
    with pytest.raises(ValueError, match="shape"):
        truncated_is_weights(x, torch.zeros(4), torch.ones(3), 2.0)


def test_gap_stats_empty_mask():
    s = logprob_gap_stats(torch.zeros(3), torch.ones(3), torch.zeros(3))
    assert float(s["logprob_gap_max_abs"]) == 0.0 and int(s["num_tokens"]) == 0


def test_token_logprobs_vs_numpy_at_temperature():
    from megatron.rl.algorithms import logprob_temperature, token_logprobs

    logits = torch.randn(3, 4, 9, dtype=torch.float64)
    labels = torch.randint(0, 9, (3, 4))
    for t in (0.7, 1.0, 0.0):
        tt = t if t > 0 else 1.0
        out = token_logprobs(logits, labels, t)
        z = logits.numpy() / tt
        ref = np.empty((3, 4))
        for i in range(3):
            for j in range(4):
                row = z[i, j]
                ref[i, j] = row[labels[i, j]] - (row.max() + math.log(np.exp(row - row.max()).sum()))
        torch.testing.assert_close(out, torch.tensor(ref), rtol=1e-10, atol=1e-12)
    assert token_logprobs(logits.bfloat16(), labels).dtype == torch.float32
    assert logprob_temperature(0.0) == 1.0
    with pytest.raises(ValueError, match="temperature"):
        token_logprobs(logits, labels, -1.0)
    with pytest.raises(ValueError, match="disagree"):
        token_logprobs(logits, labels[:, :3])
