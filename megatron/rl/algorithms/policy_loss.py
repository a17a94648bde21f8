"""Per-token policy losses: PPO-clip, GSPO and CISPO, plus the combined GRPO token loss.

Everything here is per token ([N] in, [N] out); reducing to a scalar is :mod:`aggregation`'s job. A
sequence-level loss (GSPO) gives every token its sequence's loss. Each loss is registered in ``POLICY_LOSSES``
(``--grpo-policy-loss``) and declares its default clip range, help line and own settings with
:func:`loss_settings`.

Formulas and published defaults: docs/algorithms.md.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch

from megatron.rl.algorithms.entropy import entropy_bonus
from megatron.rl.algorithms.importance_sampling import (IS_CORRECTIONS, CorrectionParams, is_correction_weights,
                                                       logprob_gap_stats, reject_sequences)
from megatron.rl.algorithms.kl import KL_ESTIMATORS, kl_penalty
from megatron.rl.algorithms.segments import segments_of
from megatron.rl.base.errors import ConfigError
from megatron.rl.base.flags import derived, flag, registry_choices
from megatron.rl.base.registry import Registry

PolicyLossFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]

POLICY_LOSSES: Registry[PolicyLossFn] = Registry("policy loss", "--grpo-policy-loss")


class PolicyLossConfigError(ConfigError):
    """A policy-loss or off-policy-correction flag value that cannot work (the message names the flag)."""


def loss_settings(eps_lower: float, eps_upper: float, summary: str = "", *, clips_weight: bool = False,
                  **options: Any) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Declare what a registered loss needs from the command line.

    ``eps_lower`` / ``eps_upper``: its default clip range (``--grpo-clamp-eps-lower/upper`` unset). ``summary``:
    its line in ``--grpo-policy-loss``'s help. ``clips_weight``: the clip bounds a weight that may reach 0
    (``eps_lower`` up to 1), not the ratio itself (below 1). ``options``: the loss's own settings with their
    defaults, given as ``--grpo-policy-loss-option NAME=VALUE`` (typed like the default) and passed to the loss
    as keyword arguments.
    """

    def mark(fn: PolicyLossFn) -> PolicyLossFn:
        fn.default_clip = (eps_lower, eps_upper)
        fn.summary, fn.clips_weight, fn.options = summary, clips_weight, dict(options)
        return fn

    return mark


def clip_defaults(eps_lower: float, eps_upper: float) -> Callable[[PolicyLossFn], PolicyLossFn]:
    """Declare only a registered loss's default clip range (:func:`loss_settings` declares the rest)."""
    return loss_settings(eps_lower, eps_upper)


def _losses_help() -> str:
    losses = POLICY_LOSSES.registered()
    return "; ".join(f"{name}: {getattr(fn, 'summary', '') or 'registered loss'}" for name, fn in losses.items()) + "."


def _clip_help(side: int) -> Callable[[], str]:
    def text() -> str:
        own = ", ".join(f"{name} {getattr(fn, 'default_clip', (0.2, 0.2))[side]:g}"
                        for name, fn in POLICY_LOSSES.registered().items())
        bound = "ratio >= 1 - eps_lower" if side == 0 else "ratio <= 1 + eps_upper (> eps_lower is DAPO's clip-higher)"
        return f"Clip: {bound}. Default: the loss's own ({own})."

    return text


def _check_same_shape(**tensors: Optional[torch.Tensor]) -> None:
    shapes = {k: tuple(v.shape) for k, v in tensors.items() if v is not None}
    if len(set(shapes.values())) > 1:
        raise ValueError(f"per-token tensors must have the same shape, got {shapes}")


def _check_eps(eps_lower: float, eps_upper: float, max_lower: float = 1.0) -> None:
    if not (0 <= eps_lower <= max_lower and eps_upper >= 0):
        raise ValueError(f"clip ranges must be >= 0 (and eps_lower <= {max_lower:g}): --grpo-clamp-eps-lower="
                         f"{eps_lower}, --grpo-clamp-eps-upper={eps_upper}")


def _masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x over mask (float64 scalar); 0 for an empty mask."""
    m = mask.double()
    return (x.double() * m).sum() / m.sum().clamp(min=1)


def _ratio_stats(ratio: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor, lower: float,
                 upper: float) -> dict[str, torch.Tensor]:
    """Clip fractions (A < 0 and ratio < lower; A > 0 and ratio > upper), ratio mean / max, over masked tokens."""
    with torch.no_grad():
        sel = mask.bool()
        r = ratio.detach()
        r_sel = r[sel].double()
        return {
            "clip_fraction_low": _masked_mean((advantages < 0) & (r < lower), sel),
            "clip_fraction_high": _masked_mean((advantages > 0) & (r > upper), sel),
            "ratio_mean": r_sel.mean() if r_sel.numel() else torch.zeros((), dtype=torch.float64),
            "ratio_max": r_sel.max() if r_sel.numel() else torch.zeros((), dtype=torch.float64),
            "num_tokens": sel.sum().to(torch.int64),
        }


@POLICY_LOSSES.register("ppo_clip")
@loss_settings(0.2, 0.2, "token ratio, token clip")
def ppo_clip_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  mask: torch.Tensor, eps_lower: float = 0.2, eps_upper: float = 0.2,
                  seq_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO-clip per-token loss with separate lower/upper clip ranges.

    Args:
        logprobs: [N] current-policy log-probs of the sampled tokens (requires grad).
        old_logprobs: [N] log-probs under the policy that sampled (constant; detached here).
        advantages: [N] per-token advantages (constant).
        mask: [N] 1 where the token enters the loss; masked tokens get loss 0.
        eps_lower / eps_upper: ``--grpo-clamp-eps-lower`` / ``--grpo-clamp-eps-upper``, >= 0.
        seq_ids: unused (the registered signature).
    Returns:
        (loss [N], stats) with stats over masked tokens (float64 scalars): ``clip_fraction_low``
        (A < 0 and r < 1 - eps_lower: the clipped term is active), ``clip_fraction_high``
        (A > 0 and r > 1 + eps_upper), ``ratio_mean``, ``ratio_max``, and ``num_tokens``.
    """
    del seq_ids
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_eps(eps_lower, eps_upper, max_lower=1.0)
    mask_f = mask.to(logprobs.dtype)
    advantages = advantages.detach().to(logprobs.dtype)
    # Masked positions may hold garbage log-probs (padding); zero the log-ratio there so exp() stays finite.
    log_ratio = (logprobs - old_logprobs.detach()) * mask_f
    ratio = torch.exp(log_ratio)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_lower, 1.0 + eps_upper) * advantages
    loss = -torch.minimum(unclipped, clipped) * mask_f
    return loss, _ratio_stats(ratio, advantages, mask, 1.0 - eps_lower, 1.0 + eps_upper)


@POLICY_LOSSES.register("gspo")
@loss_settings(3e-4, 4e-4, "sequence ratio (geometric mean), sequence clip")
def gspo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
              eps_lower: float = 3e-4, eps_upper: float = 4e-4, seq_ids: Optional[torch.Tensor] = None,
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """GSPO per-token loss: the sequence ratio and a sequence-level clip (see the module docstring).

    ``s_i = exp(mean_{t in i} (logprobs_t - old_t))`` over the masked tokens of sequence ``i`` (``seq_ids``
    [N]: the sequence index of every token; packed rows: the packing's). Every masked token of ``i`` gets
    ``-min(s_i A_t, clip(s_i, 1 - eps_lower, 1 + eps_upper) A_t)``; its gradient flows through ``s_i`` into
    all of the sequence's tokens. Stats as :func:`ppo_clip_loss`'s, with the sequence ratio in place of the
    token ratio (token-weighted: a clipped sequence counts once per token).
    """
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_eps(eps_lower, eps_upper, max_lower=1.0)
    seg = segments_of(mask, seq_ids, "--grpo-policy-loss gspo")
    mask_f = mask.to(logprobs.dtype)
    advantages = advantages.detach().to(logprobs.dtype)
    log_ratio = torch.where(mask.bool(), logprobs - old_logprobs.detach(), torch.zeros_like(logprobs))
    seq_ratio = torch.exp(seg.mean(log_ratio.reshape(-1)))
    ratio = seg.broadcast(seq_ratio, fill=1.0).reshape(logprobs.shape)
    unclipped = ratio * advantages
    clipped = ratio.clamp(1.0 - eps_lower, 1.0 + eps_upper) * advantages
    loss = -torch.minimum(unclipped, clipped) * mask_f
    return loss, _ratio_stats(ratio, advantages, mask, 1.0 - eps_lower, 1.0 + eps_upper)


@POLICY_LOSSES.register("cispo")
@loss_settings(1.0, 3.0, "REINFORCE weighted by the clipped, stop-gradient token ratio", clips_weight=True)
def cispo_loss(logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               eps_lower: float = 1.0, eps_upper: float = 3.0, seq_ids: Optional[torch.Tensor] = None,
               ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """CISPO per-token loss: ``-sg(clip(r_t, 1 - eps_lower, 1 + eps_upper)) A_t exp(logprobs_t - sg(logprobs_t))``.

    The value is ``-c_t A_t`` (``c_t`` the clipped ratio) and the gradient ``-c_t A_t grad logprobs_t``: every
    masked token keeps a gradient, the clip only bounds its weight. ``eps_lower`` may be 1 (no lower bound).
    Stats as :func:`ppo_clip_loss`'s (a "clipped" token here is one whose weight was capped, not dropped).
    """
    del seq_ids
    _check_same_shape(logprobs=logprobs, old_logprobs=old_logprobs, advantages=advantages, mask=mask)
    _check_eps(eps_lower, eps_upper, max_lower=1.0)
    mask_f = mask.to(logprobs.dtype)
    advantages = advantages.detach().to(logprobs.dtype)
    safe = torch.where(mask.bool(), logprobs, logprobs.detach().new_zeros(()))  # garbage off the mask
    ratio = torch.exp((safe - old_logprobs.detach()) * mask_f)
    weight = ratio.detach().clamp(1.0 - eps_lower, 1.0 + eps_upper)
    loss = -weight * advantages * torch.exp(safe - safe.detach()) * mask_f
    return loss, _ratio_stats(ratio, advantages, mask, 1.0 - eps_lower, 1.0 + eps_upper)


@dataclass(frozen=True)
class PolicyLossConfig:
    """Knobs of the per-token GRPO/PPO loss; each field is also its ``train_rl.py`` flag (see ``name=``)."""

    policy_loss: str = flag("ppo_clip", name="--grpo-policy-loss", choices=registry_choices(POLICY_LOSSES),
                            help=_losses_help)
    eps_lower: float | None = flag(None, name="--grpo-clamp-eps-lower", help=_clip_help(0))
    eps_upper: float | None = flag(None, name="--grpo-clamp-eps-upper", help=_clip_help(1))
    loss_options: tuple[str, ...] = flag((), name="--grpo-policy-loss-option", metavar="NAME=VALUE",
                                         help="A setting of the chosen policy loss's own (repeatable values); a "
                                              "registered loss declares its settings with loss_settings().")
    kl_beta: float = flag(0.0, name="--grpo-kl-beta",
                          help="Weight of the KL penalty to the reference model; 0 never builds the reference model.")
    kl_estimator: str = flag("k3", name="--grpo-kl-estimator", choices=registry_choices(KL_ESTIMATORS))
    entropy_weight: float = flag(0.0, name="--grpo-entropy-term-weight", help="Entropy bonus weight.")
    is_correction: bool = flag(False, name="--rl-inference-logprobs-is-correction",
                               help="Weight the loss by an importance ratio between trainer and inference log-probs "
                                    "(--rl-importance-sampling-mode, default truncated). On by itself with "
                                    "asynchronous rollouts.")
    is_mode: str | None = flag(None, name="--rl-importance-sampling-mode", choices=registry_choices(IS_CORRECTIONS),
                               help="Which importance-sampling correction (turns the correction on): truncated = "
                                    "min(r, C) per token; masked = r per token inside [--rl-importance-sampling-mask-"
                                    "low, -high], 0 outside; sequence = min(geometric mean of the sequence's r, C); "
                                    "trust_region = min(r, C), 0 where r left that band in the direction the advantage "
                                    "pushes (PPO's clip from the sampling policy).")
    is_truncation_coef: float = flag(2.0, name="--rl-importance-sampling-truncation-coef",
                                     help="C of the truncated and sequence corrections.")
    is_mask_low: float = flag(0.8, name="--rl-importance-sampling-mask-low",
                              help="masked: tokens whose ratio is below this get weight 0; trust_region: the band's "
                                   "lower edge.")
    is_mask_high: float = flag(1.25, name="--rl-importance-sampling-mask-high",
                               help="masked: tokens whose ratio is above this get weight 0; trust_region: the band's "
                                    "upper edge.")
    reject_max_log_ratio: float | None = flag(
        None, name="--rl-reject-sequence-max-log-ratio",
        help="Drop (weight 0) a rollout whose largest |trainer - inference| log-prob over its tokens exceeds this.")
    reject_mean_log_ratio: float | None = flag(
        None, name="--rl-reject-sequence-mean-log-ratio",
        help="Drop (weight 0) a rollout whose mean |trainer - inference| log-prob over its tokens exceeds this.")

    # the policy's entropy is measured (and reported as entropy_mean) even without an entropy bonus: set for
    # asynchronous rollouts, whose warnings watch it for a collapse
    report_entropy: bool = derived(False)

    @property
    def clip_range(self) -> tuple[float, float]:
        """(eps_lower, eps_upper): the flags where given, else the registered loss's published defaults."""
        lo, hi = getattr(POLICY_LOSSES.get(self.policy_loss), "default_clip", (0.2, 0.2))
        return (lo if self.eps_lower is None else self.eps_lower, hi if self.eps_upper is None else self.eps_upper)

    @property
    def options(self) -> dict[str, Any]:
        """``--grpo-policy-loss-option`` values typed like the loss's declared defaults (declared defaults for the
        rest); :class:`PolicyLossConfigError` for a setting the loss does not declare or a value of another type."""
        declared = dict(getattr(POLICY_LOSSES.get(self.policy_loss), "options", {}))
        for item in self.loss_options:
            name, sep, value = item.partition("=")
            if not sep or name not in declared:
                known = ", ".join(f"{k}={v!r}" for k, v in declared.items()) or "none"
                raise PolicyLossConfigError(f"--grpo-policy-loss-option {item!r}: --grpo-policy-loss "
                                            f"{self.policy_loss} declares these settings: {known}; give NAME=VALUE.")
            declared[name] = _typed(value, declared[name], item)
        return declared

    @property
    def correction(self) -> str | None:
        """The importance-sampling correction in force (None: off)."""
        return self.is_mode or ("truncated" if self.is_correction else None)

    @property
    def rejects(self) -> bool:
        return self.reject_max_log_ratio is not None or self.reject_mean_log_ratio is not None

    @property
    def needs_inference_logprobs(self) -> bool:
        """Whether the loss needs the inference engine's log-probs (an IS correction or sequence rejection)."""
        return self.correction is not None or self.rejects

    @property
    def correction_params(self) -> CorrectionParams:
        return CorrectionParams(self.is_truncation_coef, self.is_mask_low, self.is_mask_high)

    @property
    def needs_ref_logprobs(self) -> bool:
        """Whether the reference model must be built and run at all."""
        return self.kl_beta > 0

    @property
    def needs_entropy(self) -> bool:
        """Whether the training forward computes per-token entropy (a bonus, or reported for the warnings)."""
        return self.entropy_weight != 0 or self.report_entropy


def _typed(value: str, default: Any, item: str) -> Any:
    try:
        if isinstance(default, bool):
            if value.lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.lower() in ("true", "1")
        return type(default)(value) if default is not None else value
    except ValueError:
        raise PolicyLossConfigError(f"--grpo-policy-loss-option {item!r}: expected a {type(default).__name__} like "
                                    f"the default {default!r}.") from None


def validate_policy_loss(cfg: PolicyLossConfig) -> None:
    """Raise :class:`PolicyLossConfigError` (naming the flag) for values no run can use; call before building."""

    def need(cond: bool, msg: str) -> None:
        if not cond:
            raise PolicyLossConfigError(msg)

    lo, hi = cfg.clip_range
    for name, value in (("--grpo-clamp-eps-lower", lo), ("--grpo-clamp-eps-upper", hi),
                        ("--rl-importance-sampling-truncation-coef", cfg.is_truncation_coef),
                        ("--rl-importance-sampling-mask-low", cfg.is_mask_low),
                        ("--rl-importance-sampling-mask-high", cfg.is_mask_high),
                        ("--rl-reject-sequence-max-log-ratio", cfg.reject_max_log_ratio),
                        ("--rl-reject-sequence-mean-log-ratio", cfg.reject_mean_log_ratio)):
        need(value is None or math.isfinite(value), f"{name}={value}: must be a finite number.")
    _ = cfg.options  # raises for a setting the loss does not declare
    # a clip that bounds a weight (CISPO) may reach 0; one that clips the ratio itself must keep it > 0
    max_lower = 1.0 if getattr(POLICY_LOSSES.get(cfg.policy_loss), "clips_weight", False) else 1.0 - 1e-12
    need(0 <= lo <= max_lower, f"--grpo-clamp-eps-lower={lo}: must be in [0, 1{']' if max_lower == 1 else ')'} for "
                               f"--grpo-policy-loss {cfg.policy_loss} (the clip keeps the ratio >= 1 - eps_lower).")
    need(hi >= 0, f"--grpo-clamp-eps-upper={hi}: must be >= 0.")
    need(cfg.is_truncation_coef > 0, f"--rl-importance-sampling-truncation-coef={cfg.is_truncation_coef}: must be > 0.")
    need(cfg.is_mask_low >= 0, f"--rl-importance-sampling-mask-low={cfg.is_mask_low}: must be >= 0 (a ratio).")
    need(cfg.is_mask_low <= cfg.is_mask_high,
         f"--rl-importance-sampling-mask-low={cfg.is_mask_low} > --rl-importance-sampling-mask-high="
         f"{cfg.is_mask_high}: the band [lo, hi] of kept ratios is empty; give lo <= hi (e.g. 0.5 and 2).")
    need(cfg.is_mask_low <= 1 <= cfg.is_mask_high or cfg.correction not in ("masked", "trust_region"),
         f"--rl-importance-sampling-mask-low/-high = [{cfg.is_mask_low}, {cfg.is_mask_high}] excludes ratio 1: "
         f"--rl-importance-sampling-mode {cfg.correction} would drop tokens on which trainer and engine agree; give "
         f"lo <= 1 <= hi.")
    for name, value in (("--rl-reject-sequence-max-log-ratio", cfg.reject_max_log_ratio),
                        ("--rl-reject-sequence-mean-log-ratio", cfg.reject_mean_log_ratio)):
        need(value is None or value > 0, f"{name}={value}: must be > 0 (a |log-ratio| threshold).")


def compute_token_loss(cfg: PolicyLossConfig, logprobs: torch.Tensor, old_logprobs: torch.Tensor,
                       advantages: torch.Tensor, mask: torch.Tensor, *,
                       ref_logprobs: Optional[torch.Tensor] = None,
                       inference_logprobs: Optional[torch.Tensor] = None,
                       entropy: Optional[torch.Tensor] = None,
                       seq_ids: Optional[torch.Tensor] = None,
                       ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The full per-token loss: keep * w * policy_loss + beta * KL - entropy_weight * H, masked.

    Shapes: all [N]. ``w`` is the IS weight of ``cfg.correction`` (needs ``inference_logprobs``) and 1 without
    one; ``keep`` is 0 on the tokens of sequences :func:`reject_sequences` drops (``cfg.rejects``) and 1
    otherwise. ``seq_ids`` is needed by sequence-level pieces (GSPO, sequence IS, rejection).
    ``ref_logprobs`` is required only when ``cfg.kl_beta > 0``; ``entropy`` only when ``cfg.entropy_weight != 0``.
    Returns (loss [N], stats): the policy loss's stats plus ``kl_mean`` / ``entropy_mean`` / the IS and gap
    stats where they apply (means over masked tokens of this call; combine micro-batches weighted by
    ``num_tokens``) and ``num_rejected`` / ``num_sequences`` with rejection.
    """
    policy_fn = POLICY_LOSSES.get(cfg.policy_loss)
    eps_lower, eps_upper = cfg.clip_range
    loss, stats = policy_fn(logprobs, old_logprobs, advantages, mask, eps_lower=eps_lower, eps_upper=eps_upper,
                            seq_ids=seq_ids, **cfg.options)
    mask_f = mask.to(loss.dtype)
    if cfg.needs_inference_logprobs and inference_logprobs is None:
        raise ValueError("--rl-inference-logprobs-is-correction / --rl-importance-sampling-mode / "
                         "--rl-reject-sequence-*-log-ratio need the inference engine's log-probs, but "
                         "inference_logprobs is None")
    if cfg.correction is not None:
        weights, is_stats = is_correction_weights(cfg.correction, old_logprobs, inference_logprobs, mask, seq_ids,
                                                  cfg.correction_params, advantages=advantages)
        loss = loss * weights
        stats.update({k: v for k, v in is_stats.items() if k != "num_tokens"})
    elif inference_logprobs is not None:
        stats.update({k: v for k, v in logprob_gap_stats(old_logprobs, inference_logprobs, mask).items()
                      if k != "num_tokens"})
    if cfg.rejects:
        keep, rej_stats = reject_sequences(old_logprobs, inference_logprobs, mask, seq_ids, cfg.reject_max_log_ratio,
                                           cfg.reject_mean_log_ratio)
        loss = loss * keep
        stats.update(rej_stats)
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
