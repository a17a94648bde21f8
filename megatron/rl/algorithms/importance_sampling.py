"""Off-policy corrections between the policy that sampled the tokens and the one the loss is taken against.

Per token ``log r_t = old_t - inference_t`` (trainer's proximal policy over the engine's behaviour policy).
Registered corrections (``IS_CORRECTIONS``, ``--rl-importance-sampling-mode``): ``truncated``, ``masked``,
``sequence``, ``trust_region``; each a pure function returning detached per-token weights (0 on unmasked
tokens) and stats. :func:`reject_sequences` drops sequences with extreme mismatch; :func:`mismatch_sums` gives
the mismatch metrics.

Formulas: docs/algorithms.md.
"""
from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import torch

from megatron.rl.algorithms.segments import segments_of
from megatron.rl.base.registry import Registry

__all__ = ["CorrectionParams", "IS_CORRECTIONS", "logprob_gap_stats", "truncated_is_weights", "masked_is_weights",
           "sequence_is_weights", "trust_region_is_weights", "reject_sequences", "mismatch_sums", "is_correction_weights"]

CorrectionFn = Callable[..., tuple[torch.Tensor, dict[str, torch.Tensor]]]
IS_CORRECTIONS: Registry[CorrectionFn] = Registry("importance-sampling correction", "--rl-importance-sampling-mode")

_ZERO = lambda: torch.zeros((), dtype=torch.float64)  # noqa: E731


@dataclasses.dataclass(frozen=True)
class CorrectionParams:
    """The knobs of the registered corrections (see the module docstring for their formulas)."""

    truncation_coef: float = 2.0  # C
    mask_low: float = 0.8  # lo
    mask_high: float = 1.25  # hi


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.reshape(x.shape).bool()]


def _log_ratio(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``old - inference`` detached, at least float32 (a bf16 exp would quantise the weight), 0 off the mask."""
    if old_logprobs.shape != inference_logprobs.shape:
        raise ValueError(f"inference_logprobs shape {tuple(inference_logprobs.shape)} != "
                         f"old_logprobs shape {tuple(old_logprobs.shape)}")
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_r = (old_logprobs.detach() - inference_logprobs.detach()).to(dtype)
    # masked positions may hold garbage (padding): zero them so exp() stays finite
    return torch.where(mask.reshape(log_r.shape).bool(), log_r, torch.zeros_like(log_r))


def logprob_gap_stats(train_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train-inference log-prob gap over masked tokens: mean and max of |train - inference|.

    Shapes [N] (any shape, all equal). Returns float64 scalar tensors plus ``num_tokens`` so the
    caller can combine micro-batches (weighted mean; max of max). Empty mask -> zeros.
    """
    gap = _masked((train_logprobs.detach() - inference_logprobs.detach()).abs().double(), mask)
    if gap.numel() == 0:
        return {"logprob_gap_mean_abs": _ZERO(), "logprob_gap_max_abs": _ZERO(),
                "num_tokens": torch.zeros((), dtype=torch.int64)}
    return {"logprob_gap_mean_abs": gap.mean(), "logprob_gap_max_abs": gap.max(),
            "num_tokens": torch.tensor(gap.numel(), dtype=torch.int64)}


def _truncated(raw: torch.Tensor, coef: float, old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
               mask: torch.Tensor, **shares: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``min(raw, C)`` on the masked tokens (detached, in old_logprobs' dtype) and its stats: the gap stats,
    ``is_weight_mean``, ``is_truncated_fraction`` (``raw > C``) and each boolean share in ``shares``."""
    if not coef > 0:
        raise ValueError(f"--rl-importance-sampling-truncation-coef must be > 0, got {coef}")
    weights = raw.clamp(max=coef) * mask.reshape(raw.shape)
    stats = logprob_gap_stats(old_logprobs, inference_logprobs, mask)
    stats.update(_weight_stats(weights, mask, is_truncated_fraction=raw > coef, **shares))
    return weights.to(old_logprobs.dtype).detach(), stats


def _weight_stats(weights: torch.Tensor, mask: torch.Tensor, **shares: torch.Tensor) -> dict[str, torch.Tensor]:
    """``is_weight_mean`` and each boolean ``shares[name]`` [N] as a fraction of the masked tokens."""
    sel = mask.reshape(weights.shape).bool()
    n = int(sel.sum())
    stats = {"is_weight_mean": weights.double()[sel].mean() if n else _ZERO()}
    for name, flags in shares.items():
        stats[name] = flags[sel].double().mean() if n else _ZERO()
    return stats


@IS_CORRECTIONS.register("truncated")
def truncated_is_weights(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                         truncation_coef: float | None = None, seq_ids: Optional[torch.Tensor] = None,
                         params: CorrectionParams | None = None, advantages: Optional[torch.Tensor] = None,
                         ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level truncated IS: ``w_t = min(exp(old_t - inference_t), C)``, detached, 0 where mask is 0.

    Args:
        old_logprobs: [N] trainer log-probs of the sampled tokens under the old / proximal policy.
        inference_logprobs: [N] the inference engine's (behaviour) log-probs of the same tokens.
        mask: [N] 1 for tokens that enter the loss.
        truncation_coef: ``C`` (``--rl-importance-sampling-truncation-coef``), > 0; default ``params``'.
        seq_ids, advantages: unused (the registered signature).
    Returns:
        (weights [N] in old_logprobs' dtype, stats): logprob_gap_stats(...) plus ``is_weight_mean`` and
        ``is_truncated_fraction`` (share of masked tokens with ``r_t > C``).
    """
    del seq_ids, advantages
    coef = truncation_coef if truncation_coef is not None else (params or CorrectionParams()).truncation_coef
    raw = torch.exp(_log_ratio(old_logprobs, inference_logprobs, mask))
    return _truncated(raw, coef, old_logprobs, inference_logprobs, mask)


@IS_CORRECTIONS.register("masked")
def masked_is_weights(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                      seq_ids: Optional[torch.Tensor] = None, params: CorrectionParams | None = None,
                      advantages: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Token-level masked IS: ``w_t = r_t`` where ``lo <= r_t <= hi``, else 0 (the token leaves the loss).

    ``r_t = exp(old_t - inference_t)``; ``lo, hi`` = ``params.mask_low, params.mask_high`` (``0 <= lo <= hi``).
    Shapes [N]. Returns (weights [N], stats): logprob_gap_stats(...) plus ``is_weight_mean`` and
    ``is_masked_fraction`` (share of masked tokens whose ratio left the band).
    """
    del seq_ids, advantages
    p = params or CorrectionParams()
    if not 0 <= p.mask_low <= p.mask_high:
        raise ValueError(f"masked IS needs 0 <= --rl-importance-sampling-mask-low <= --rl-importance-sampling-mask-high,"
                         f" got [{p.mask_low}, {p.mask_high}]")
    raw = torch.exp(_log_ratio(old_logprobs, inference_logprobs, mask))
    inside = (raw >= p.mask_low) & (raw <= p.mask_high)
    weights = torch.where(inside, raw, torch.zeros_like(raw)) * mask.reshape(raw.shape)
    stats = logprob_gap_stats(old_logprobs, inference_logprobs, mask)
    stats.update(_weight_stats(weights, mask, is_masked_fraction=~inside))
    return weights.to(old_logprobs.dtype).detach(), stats


@IS_CORRECTIONS.register("sequence")
def sequence_is_weights(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                        seq_ids: Optional[torch.Tensor] = None, params: CorrectionParams | None = None,
                        advantages: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Sequence-level IS, truncated: every token of sequence ``s`` gets ``min(exp(mean_{u in s} log r_u), C)``.

    The geometric mean of the sequence's token ratios (a length-normalised sequence ratio, so long answers do not
    get astronomically large or small weights). ``seq_ids`` [N]: sequence index of every token (packed rows: the
    packing's sequence ids). Returns (weights [N], stats): logprob_gap_stats(...) plus ``is_weight_mean`` and
    ``is_truncated_fraction`` (share of masked tokens whose sequence ratio exceeds ``C``).
    """
    del advantages
    log_r = _log_ratio(old_logprobs, inference_logprobs, mask)
    seg = segments_of(mask, seq_ids, "sequence-level IS (--rl-importance-sampling-mode sequence)")
    raw = seg.broadcast(torch.exp(seg.mean(log_r.reshape(-1)))).reshape(log_r.shape)
    return _truncated(raw, (params or CorrectionParams()).truncation_coef, old_logprobs, inference_logprobs, mask)


@IS_CORRECTIONS.register("trust_region")
def trust_region_is_weights(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                            seq_ids: Optional[torch.Tensor] = None, params: CorrectionParams | None = None,
                            advantages: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Truncated IS inside a trust region around the behaviour policy (see the module docstring).

    ``w_t = min(r_t, C)``, 0 where ``(A_t > 0 and r_t > hi) or (A_t < 0 and r_t < lo)``; ``advantages`` [N]
    (required), ``lo, hi`` = ``params.mask_low, params.mask_high``. Returns (weights [N], stats):
    logprob_gap_stats(...) plus ``is_weight_mean``, ``is_truncated_fraction`` (``r_t > C``) and
    ``is_masked_fraction`` (share of masked tokens outside the trust region).
    """
    del seq_ids
    if advantages is None:
        raise ValueError("--rl-importance-sampling-mode trust_region needs the advantages (advantages=None)")
    p = params or CorrectionParams()
    if not 0 <= p.mask_low <= 1 <= p.mask_high:
        raise ValueError(f"the trust region needs --rl-importance-sampling-mask-low <= 1 <= "
                         f"--rl-importance-sampling-mask-high, got [{p.mask_low}, {p.mask_high}]")
    raw = torch.exp(_log_ratio(old_logprobs, inference_logprobs, mask))
    adv = advantages.detach().reshape(raw.shape)
    outside = ((adv > 0) & (raw > p.mask_high)) | ((adv < 0) & (raw < p.mask_low))
    kept = torch.where(outside, torch.zeros_like(raw), raw)
    return _truncated(kept, p.truncation_coef, old_logprobs, inference_logprobs, mask, is_masked_fraction=outside)


def is_correction_weights(mode: str, old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                          mask: torch.Tensor, seq_ids: Optional[torch.Tensor], params: CorrectionParams,
                          advantages: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The registered correction ``mode``'s weights and stats (see the module docstring)."""
    return IS_CORRECTIONS.get(mode)(old_logprobs, inference_logprobs, mask, seq_ids=seq_ids, params=params,
                                    advantages=advantages)


def reject_sequences(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                     seq_ids: Optional[torch.Tensor], max_abs: float | None = None, mean_abs: float | None = None,
                     ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Drop whole sequences whose mismatch is extreme.

    A sequence ``s`` is rejected when ``max_{t in s} |old_t - inference_t| > max_abs`` or
    ``mean_{t in s} |old_t - inference_t| > mean_abs`` (a threshold of None is off). Shapes [N].
    Returns (keep [N]: 1.0 on the masked tokens of kept sequences, 0 elsewhere, in old_logprobs' dtype; stats
    ``num_sequences``, ``num_rejected`` (int64 scalars: sum them over micro-batches and ranks)).
    """
    seg = segments_of(mask, seq_ids, "sequence rejection (--rl-reject-sequence-*-log-ratio)")
    gap = _log_ratio(old_logprobs, inference_logprobs, mask).abs().reshape(-1)
    rejected = torch.zeros(seg.count, dtype=torch.bool, device=gap.device)
    if max_abs is not None:
        rejected |= seg.max(gap) > max_abs
    if mean_abs is not None:
        rejected |= seg.mean(gap) > mean_abs
    keep = seg.broadcast((~rejected).to(old_logprobs.dtype)).reshape(old_logprobs.shape)
    return keep, {"num_sequences": torch.tensor(seg.count, dtype=torch.int64),
                  "num_rejected": rejected.sum().to(torch.int64)}


def mismatch_sums(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                  mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Sums for the per-step mismatch metrics over masked tokens (float64 scalars; combine by summing, max of max).

    ``abs_sum`` = sum |log r_t|, ``abs_max`` = max |log r_t| (0 when empty), ``k3_sum`` = sum (r_t - 1 - log r_t)
    (k3 of KL(inference || old): the tokens were sampled by the inference policy), ``num_tokens``.
    Means are the sums over ``num_tokens``.
    """
    log_r = _masked(_log_ratio(old_logprobs, inference_logprobs, mask).double(), mask)
    return {"abs_sum": log_r.abs().sum(), "abs_max": log_r.abs().max() if log_r.numel() else _ZERO(),
            "k3_sum": (torch.expm1(log_r) - log_r).sum(), "num_tokens": torch.tensor(float(log_r.numel()),
                                                                                     dtype=torch.float64)}
