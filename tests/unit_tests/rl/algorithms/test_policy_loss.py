"""PPO-clip and the combined token loss vs slow python-float references; clipping boundary behaviour."""
import math
import random

import pytest
import torch

from megatron.rl.algorithms import POLICY_LOSSES, PolicyLossConfig, compute_token_loss, ppo_clip_loss


def ref_ppo_token(lp, old, adv, eps_lo, eps_hi):
    """Per-token PPO-clip written as explicit cases rather than min/clamp."""
    r = math.exp(lp - old)
    if adv >= 0:
        # pessimistic bound: the objective stops growing once r exceeds 1 + eps_hi
        obj = min(r, 1 + eps_hi) * adv
    else:
        # for negative advantages it stops growing (becoming less negative) once r falls below 1 - eps_lo
        obj = max(r, 1 - eps_lo) * adv
    return -obj


def _random_tokens(n, seed):
    rng = random.Random(seed)
    old = [-rng.uniform(0.05, 3) for _ in range(n)]
    lp = [o + rng.uniform(-0.6, 0.6) for o in old]
    adv = [rng.gauss(0, 1) for _ in range(n)]
    mask = [rng.random() < 0.75 for _ in range(n)]
    return lp, old, adv, mask


def test_registered_policy_losses():
    assert POLICY_LOSSES.names() == ["cispo", "gspo", "ppo_clip"]


@pytest.mark.parametrize("eps", [(0.2, 0.2), (0.2, 0.28), (0.1, 0.5)])
def test_ppo_clip_matches_reference_and_stats(eps):
    lo, hi = eps
    lp, old, adv, mask = _random_tokens(200, 7)
    loss, stats = ppo_clip_loss(torch.tensor(lp, dtype=torch.float64), torch.tensor(old, dtype=torch.float64),
                                torch.tensor(adv, dtype=torch.float64), torch.tensor(mask), lo, hi)
    expected = [ref_ppo_token(a, b, c, lo, hi) if m else 0.0 for a, b, c, m in zip(lp, old, adv, mask)]
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)
    sel = [(a, b, c) for a, b, c, m in zip(lp, old, adv, mask) if m]
    ratios = [math.exp(a - b) for a, b, _ in sel]
    assert abs(float(stats["ratio_mean"]) - sum(ratios) / len(ratios)) < 1e-12
    assert abs(float(stats["ratio_max"]) - max(ratios)) < 1e-12
    low = sum(1 for (a, b, c), r in zip(sel, ratios) if c < 0 and r < 1 - lo) / len(sel)
    high = sum(1 for (a, b, c), r in zip(sel, ratios) if c > 0 and r > 1 + hi) / len(sel)
    assert float(stats["clip_fraction_low"]) == pytest.approx(low) and float(stats["clip_fraction_high"]) == pytest.approx(high)
    assert low > 0 and high > 0  # the random inputs do exercise both clip sides
    assert int(stats["num_tokens"]) == len(sel)


def test_gradient_is_zero_exactly_where_clipped():
    old = torch.zeros(6, dtype=torch.float64)
    # ratios: 1.5 (A>0: clipped high), 1.1 (A>0: inside), 0.5 (A<0: clipped low), 0.9 (A<0 inside),
    #         0.5 (A>0: below 1-eps is NOT clipped for positive advantage), 1.5 (A<0: NOT clipped)
    lp = torch.log(torch.tensor([1.5, 1.1, 0.5, 0.9, 0.5, 1.5], dtype=torch.float64)).requires_grad_()
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, -2.0], dtype=torch.float64)
    loss, stats = ppo_clip_loss(lp, old, adv, torch.ones(6), 0.2, 0.2)
    loss.sum().backward()
    r = lp.detach().exp()
    expected_grad = torch.tensor([0.0, -r[1] * 1.0, 0.0, r[3] * 1.0, -r[4] * 2.0, r[5] * 2.0], dtype=torch.float64)
    torch.testing.assert_close(lp.grad, expected_grad)
    assert lp.grad[0] == 0 and lp.grad[2] == 0
    assert float(stats["clip_fraction_high"]) == pytest.approx(1 / 6)
    assert float(stats["clip_fraction_low"]) == pytest.approx(1 / 6)


def test_clip_higher_is_asymmetric():
    # ratio 1.25: clipped with eps_upper=0.2, not with eps_upper=0.28
    lp, old, adv = torch.tensor([math.log(1.25)]), torch.zeros(1), torch.ones(1)
    l1, _ = ppo_clip_loss(lp, old, adv, torch.ones(1), 0.2, 0.2)
    l2, _ = ppo_clip_loss(lp, old, adv, torch.ones(1), 0.2, 0.28)
    assert float(l1) == pytest.approx(-1.2) and float(l2) == pytest.approx(-1.25)


def test_on_policy_loss_is_minus_advantage_and_masked_garbage_is_ignored():
    lp = torch.tensor([-1.0, -2.0, float("nan")])
    loss, stats = ppo_clip_loss(lp, torch.tensor([-1.0, -2.0, 0.0]), torch.tensor([0.5, -0.3, 1.0]),
                                torch.tensor([1, 1, 0]), 0.2, 0.2)
    torch.testing.assert_close(loss[:2], torch.tensor([-0.5, 0.3]))
    assert float(stats["ratio_max"]) == 1.0


def test_shape_mismatch_and_bad_eps():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="same shape"):
        ppo_clip_loss(x, torch.zeros(4), x, x)
    with pytest.raises(ValueError, match="--grpo-clamp-eps-lower"):
        ppo_clip_loss(x, x, x, x, -0.1, 0.2)


def test_compute_token_loss_combines_terms_like_reference():
    lp, old, adv, mask = _random_tokens(60, 11)
    rng = random.Random(5)
    ref = [o + rng.uniform(-0.5, 0.5) for o in old]
    inf = [o + rng.uniform(-0.5, 0.5) for o in old]
    ent = [rng.uniform(0, 3) for _ in old]
    cfg = PolicyLossConfig(eps_lower=0.2, eps_upper=0.3, kl_beta=0.05, kl_estimator="k3", entropy_weight=0.01,
                           is_correction=True, is_truncation_coef=1.3)
    t = lambda v: torch.tensor(v, dtype=torch.float64)  # noqa: E731
    loss, stats = compute_token_loss(cfg, t(lp), t(old), t(adv), torch.tensor(mask), ref_logprobs=t(ref),
                                     inference_logprobs=t(inf), entropy=t(ent))
    expected = []
    for a, b, c, m, r, i, h in zip(lp, old, adv, mask, ref, inf, ent):
        if not m:
            expected.append(0.0)
            continue
        w = min(math.exp(b - i), 1.3)
        d = r - a
        expected.append(w * ref_ppo_token(a, b, c, 0.2, 0.3) + 0.05 * (math.exp(d) - 1 - d) - 0.01 * h)
    torch.testing.assert_close(loss, t(expected), rtol=1e-10, atol=1e-12)
    for key in ("kl_mean", "entropy_mean", "logprob_gap_mean_abs", "logprob_gap_max_abs", "is_weight_mean",
                "clip_fraction_low", "ratio_mean"):
        assert key in stats


def test_compute_token_loss_defaults_need_no_reference_and_report_gap():
    cfg = PolicyLossConfig()
    assert not cfg.needs_ref_logprobs and not cfg.needs_entropy
    x = torch.tensor([-1.0, -2.0])
    loss, stats = compute_token_loss(cfg, x, x, torch.tensor([1.0, -1.0]), torch.ones(2),
                                     inference_logprobs=x + 0.5)
    torch.testing.assert_close(loss, torch.tensor([-1.0, 1.0]))
    assert float(stats["logprob_gap_max_abs"]) == pytest.approx(0.5) and "is_weight_mean" not in stats
    with pytest.raises(ValueError, match="--grpo-kl-beta"):
        compute_token_loss(PolicyLossConfig(kl_beta=0.1), x, x, x, torch.ones(2))
    with pytest.raises(ValueError, match="--rl-inference-logprobs-is-correction"):
        compute_token_loss(PolicyLossConfig(is_correction=True), x, x, x, torch.ones(2))
    with pytest.raises(ValueError, match="--grpo-entropy-term-weight"):
        compute_token_loss(PolicyLossConfig(entropy_weight=0.1), x, x, x, torch.ones(2))
