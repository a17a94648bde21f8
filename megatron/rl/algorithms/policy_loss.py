"""Per-token policy losses: PPO-clip with asymmetric clipping, plus the combined GRPO token loss.

Everything here is per token ([N] in, [N] out); reducing to a scalar is :mod:`aggregation`'s job,
so the same per-token loss works for token-, sequence- and Dr.GRPO-style normalisation.

PPO-clip (per token, ratio r = exp(logprobs - old_logprobs), advantage A):
    loss = -min(r * A, clip(r, 1 - eps_lower, 1 + eps_upper) * A)
``eps_upper > eps_lower`` is DAPO's "clip-higher". Where the clipped term is the minimum the loss is
constant in ``logprobs`` and its gradient is exactly 0.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.rl.algorithms.entropy import entropy_bonus
from megatron.rl.algorithms.importance_sampling import logprob_gap_stats, truncated_is_weights
from megatron.rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from megatron.rl.base.registry import Registry
from megatron.rl.base.flags import flag, registry_choices

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "--grpo-policy-loss")


def _check_same_shape(**tensors: Optional[torch.Tensor]) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (float64 scalar); 0 for an empty mask."""
    m = mask.double()
    return (x.double() * m).sum() / m.sum().clamp(min=1)


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, eps_lower: float = 0.2, eps_upper: float = 0.2,
                  ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per-token loss with separate lower/upper clip ranges.

    Args:
        logprobs: [N] current-policy log-probs of the sampled tokens (requires grad).
        old_logprobs: [N] log-probs under the policy that sampled (constant; detached here).
        advantages: [N] per-token advantages (constant).
        mask: [N] 1 where the token enters the loss; masked tokens get loss 0.
        eps_lower / eps_upper: ``--grpo-clamp-eps-lower`` / ``--grpo-clamp-eps-upper``, >= 0.
    Returns:
        (loss [N], stats) with stats over masked tokens (float64 scalars): ``clip_fraction_low``
        (A < 0 and r < 1 - eps_lower: the clipped term is active), ``clip_fraction_high``
        (A > 0 and r > 1 + eps_upper), ``ratio_mean``, ``ratio_max``, and ``num_tokens``.
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    if eps_lower < 0 or eps_upper < 0:
        raise ValueError(f"clip ranges must be >= 0: --grpo-clamp-eps-lower={eps_lower}, "
                         f"--grpo-clamp-eps-upper={eps_upper}")
    mask_f = mask.to(logprobs.dtype)
    advantages = advantages.detach().to(logprobs.dtype)
    # Masked positions may hold garbage log-probs (padding); zero the log-ratio there so exp() stays finite.
    log_ratio = (logprobs - old_logprobs.detach()) * mask_f
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_lower, 1.0 + eps_upper) * advantages
    loss = -torch.minimum(unclipped, clipped) * mask_f

    with torch.no_grad():
        sel = mask.bool()
        low = (advantages < 0) & (ratio < 1.0 - eps_lower)
        high = (advantages > 0) & (ratio > 1.0 + eps_upper)
        r_sel = ratio.detach()[sel]
        stats = {
            "clip_fraction_low": _masked_mean(low, sel),
            "clip_fraction_high": _masked_mean(high, sel),
            "ratio_mean": r_sel.double().mean() if r_sel.numel() else torch.zeros((), dtype=torch.float64),
            "ratio_max": r_sel.double().max() if r_sel.numel() else torch.zeros((), dtype=torch.float64),
            "num_tokens": sel.sum().to(torch.int64),
        }
    return loss, stats


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the per-token GRPO/PPO loss; each field is also its ``train_rl.py`` flag (see ``name=``)."""

    policy_loss: str = flag("ppo_clip", name="--grpo-policy-loss", choices=registry_choices(POLICY_LOSSES))
    eps_lower: float = flag(0.2, name="--grpo-clamp-eps-lower", help="PPO clip: ratio >= 1 - eps_lower.")
    eps_upper: float = flag(0.2, name="--grpo-clamp-eps-upper",
                            help="PPO clip: ratio <= 1 + eps_upper (> eps_lower is DAPO's clip-higher).")
    kl_beta: float = flag(0.0, name="--grpo-kl-beta",
                          help="Weight of the KL penalty to the reference model; 0 never builds the reference model.")
    kl_estimator: str = flag("k3", name="--grpo-kl-estimator", choices=registry_choices(KL_ESTIMATORS))
    entropy_weight: float = flag(0.0, name="--grpo-entropy-term-weight", help="Entropy bonus weight.")
    is_correction: bool = flag(False, name="--rl-inference-logprobs-is-correction",
                               help="Weight the loss by the truncated importance ratio between trainer and inference "
                                    "log-probs.")
    is_truncation_coef: float = flag(2.0, name="--rl-importance-sampling-truncation-coef")

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether the reference model must be built and run at all."""
        return self.kl_beta > 0

    @property
    def needs_entropy(self) -> bool:
        return self.entropy_weight != 0


def compute_token_loss(cfg: PolicyLossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, *,
                       ref_logprobs: Optional[torch.Tensor] = None,
                       inference_logprobs: Optional[torch.Tensor] = None,
                       entropy: Optional[torch.Tensor] = None,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-token loss: w * policy_loss + beta * KL - entropy_weight * H, masked.

    Shapes: all [N]. ``w`` is the truncated IS weight when ``cfg.is_correction`` (needs
    ``inference_logprobs``) and 1 otherwise; ``ref_logprobs`` is required only when ``cfg.kl_beta > 0``;
    ``entropy`` only when ``cfg.entropy_weight != 0``. Returns (loss [N], stats): the policy loss's
    stats plus ``kl_mean`` / ``entropy_mean`` / the IS and gap stats where they apply (means over
    masked tokens of this call; combine micro-batches weighted by ``num_tokens``).
    """
    policy_fn = POLICY_LOSSES.get(cfg.policy_loss)
    loss, stats = policy_fn(logprobs, old_logprobs, advantages, mask, eps_lower=cfg.eps_lower,
                            eps_upper=cfg.eps_upper)
    mask_f = mask.to(loss.dtype)
    if cfg.is_correction:
        if inference_logprobs is None:
            raise ValueError("--rl-inference-logprobs-is-correction needs the inference engine's log-probs, "
                             "but inference_logprobs is None")
        weights, is_stats = truncated_is_weights(old_logprobs, inference_logprobs, mask, cfg.is_truncation_coef)
        loss = loss * weights
        stats.update({k: v for k, v in is_stats.items() if k != "num_tokens"})
    elif inference_logprobs is not None:
        stats.update({k: v for k, v in logprob_gap_stats(old_logprobs, inference_logprobs, mask).items()
                      if k != "num_tokens"})
    if cfg.kl_beta != 0 or ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, cfg.kl_beta, cfg.kl_estimator) * mask_f
        loss = loss + kl
        if cfg.kl_beta > 0:
            stats["kl_mean"] = _masked_mean(kl.detach() / cfg.kl_beta, mask)
    if cfg.entropy_weight != 0:
        if entropy is None:
            raise ValueError(f"--grpo-entropy-term-weight={cfg.entropy_weight} needs per-token entropy, "
                             f"but entropy is None")
        loss = loss + entropy_bonus(entropy, cfg.entropy_weight) * mask_f
    if entropy is not None:
        stats["entropy_mean"] = _masked_mean(entropy.detach(), mask)
    return loss, stats
