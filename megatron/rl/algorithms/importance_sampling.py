"""Truncated importance-sampling correction between the inference engine and the trainer.

Rollouts are sampled by the inference engine, whose log-probs (``inference_logprobs``) can differ
from the trainer's recomputation of the same policy (``old_logprobs``): different kernels, batch
shapes, precision, or a stale weight copy. The PPO ratio is taken against ``old_logprobs``; this
module re-weights each token by ``w = min(exp(old - inference), truncation_coef)`` (truncated IS,
so a token the engine thought unlikely cannot blow the update up). ``w`` is a constant: detached.
"""
from __future__ import annotations

import torch


def _masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return x[mask.reshape(x.shape).bool()]


def logprob_gap_stats(train_logprobs: torch.Tensor, inference_logprobs: torch.Tensor,
                      mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Train-inference log-prob gap over masked tokens: mean and max of |train - inference|.

    Shapes [N] (any shape, all equal). Returns float64 scalar tensors plus ``num_tokens`` so the
    caller can combine micro-batches (weighted mean; max of max). Empty mask -> zeros.
    """
    gap = _masked((train_logprobs.detach() - inference_logprobs.detach()).abs().double(), mask)
    if gap.numel() == 0:
        zero = torch.zeros((), dtype=torch.float64)
        return {"logprob_gap_mean_abs": zero, "logprob_gap_max_abs": zero.clone(),
                "num_tokens": torch.zeros((), dtype=torch.int64)}
    return {"logprob_gap_mean_abs": gap.mean(), "logprob_gap_max_abs": gap.max(),
            "num_tokens": torch.tensor(gap.numel(), dtype=torch.int64)}


def truncated_is_weights(old_logprobs: torch.Tensor, inference_logprobs: torch.Tensor, mask: torch.Tensor,
                         truncation_coef: float) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per-token weights ``min(exp(old - inference), truncation_coef)``, detached, 0 where mask is 0.

    Args:
        old_logprobs: [N] trainer log-probs of the sampled tokens under the sampling policy.
        inference_logprobs: [N] the inference engine's log-probs of the same tokens.
        mask: [N] 1 for tokens that enter the loss.
        truncation_coef: upper bound on the weight (``--rl-importance-sampling-truncation-coef``), > 0.
    Returns:
        (weights [N], stats) with stats = logprob_gap_stats(...) plus ``is_weight_mean`` and
        ``is_truncated_fraction`` over masked tokens.
    """
    if not truncation_coef > 0:
        raise ValueError(f"--rl-importance-sampling-truncation-coef must be > 0, got {truncation_coef}")
    if old_logprobs.shape != inference_logprobs.shape:
        raise ValueError(f"inference_logprobs shape {tuple(inference_logprobs.shape)} != "
                         f"old_logprobs shape {tuple(old_logprobs.shape)}")
    # at least float32 (bf16 exp would quantise the weight), float64 inputs stay float64
    dtype = torch.promote_types(old_logprobs.dtype, torch.float32)
    log_w = (old_logprobs.detach() - inference_logprobs.detach()).to(dtype)
    raw = torch.exp(log_w)
    weights = raw.clamp(max=truncation_coef).to(old_logprobs.dtype) * mask.reshape(old_logprobs.shape)
    stats = logprob_gap_stats(old_logprobs, inference_logprobs, mask)
    w_sel, raw_sel = _masked(weights.double(), mask), _masked(raw.double(), mask)
    if w_sel.numel():
        stats["is_weight_mean"] = w_sel.mean()
        stats["is_truncated_fraction"] = (raw_sel > truncation_coef).double().mean()
    else:
        stats["is_weight_mean"] = torch.zeros((), dtype=torch.float64)
        stats["is_truncated_fraction"] = torch.zeros((), dtype=torch.float64)
    return weights.detach(), stats
