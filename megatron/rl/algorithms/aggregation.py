"""Reduce a per-token loss to the scalar a micro-batch back-propagates, with GLOBAL normalisers.

The normalisers (token and sequence counts) are counted over the whole optimizer step, all micro-batches of all
DP ranks (:func:`local_normalizers`, all-reduced by the caller), so the per-micro-batch losses sum to the global
loss whatever the micro-batch size, DP size or packing. Modes (``AGGREGATIONS``, ``--grpo-loss-aggregation``):
``token``, ``sequence``, ``drgrpo``. The caller sets megatron-core's ``calculate_per_token_loss = True`` and
returns a token count of 0.

Formulas and the megatron-core schedule: docs/algorithms.md.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch

from megatron.rl.algorithms.segments import segments_of
from megatron.rl.base.registry import Registry


@dataclass(frozen=True)
class LossNormalizers:
    """Global (all micro-batches, all DP ranks) denominators.

    num_tokens: loss tokens (mask == 1). num_sequences: sequences with at least one loss token.
    max_len: the Dr.GRPO constant length (only for ``drgrpo``).
    """

    num_tokens: Optional[float] = None
    num_sequences: Optional[float] = None
    max_len: Optional[float] = None


AggregationFn = Callable[[torch.Tensor, torch.Tensor, Optional[torch.Tensor], LossNormalizers], torch.Tensor]

AGGREGATIONS: Registry[AggregationFn] = Registry("loss aggregation", "--grpo-loss-aggregation")


def _require(value: Optional[float], name: str, mode: str) -> float:
    if value is None:
        raise ValueError(f"loss aggregation {mode!r} needs the global {name}; pass LossNormalizers({name}=...)")
    if not value > 0:
        raise ValueError(f"loss aggregation {mode!r}: global {name} must be > 0, got {value} "
                         f"(no loss tokens in the whole step?)")
    return float(value)


def local_normalizers(mask: torch.Tensor, seq_ids: Optional[torch.Tensor] = None) -> tuple[int, int]:
    """This micro-batch's (num loss tokens, num sequences with >= 1 loss token).

    ``mask`` [...] of 0/1, ``seq_ids`` [...] same shape (sequence index per token; padding any value
    with mask 0). Sum these over micro-batches and all-reduce over DP to get :class:`LossNormalizers`.
    """
    sel = mask.bool()
    num_tokens = int(sel.sum())
    num_sequences = 0 if seq_ids is None else int(torch.unique(seq_ids[sel]).numel())
    return num_tokens, num_sequences


@AGGREGATIONS.register("token")
def aggregate_token(loss: torch.Tensor, mask: torch.Tensor, seq_ids: Optional[torch.Tensor],
                    norm: LossNormalizers) -> torch.Tensor:
    """sum(loss * mask) / global num_tokens."""
    del seq_ids
    return (loss * mask.to(loss.dtype)).sum() / _require(norm.num_tokens, "num_tokens", "token")


@AGGREGATIONS.register("sequence")
def aggregate_sequence(loss: torch.Tensor, mask: torch.Tensor, seq_ids: Optional[torch.Tensor],
                       norm: LossNormalizers) -> torch.Tensor:
    """sum over sequences of (mean of its masked token losses) / global num_sequences.

    Needs ``seq_ids``: a sequence's tokens must all be in this micro-batch (packing never splits one).
    """
    seg = segments_of(mask.reshape(-1), None if seq_ids is None else seq_ids.reshape(-1), "loss aggregation 'sequence'")
    denom = _require(norm.num_sequences, "num_sequences", "sequence")
    if seg.count == 0:
        return loss.sum() * 0.0  # keeps the graph (and DDP's hooks) alive for an all-padding micro-batch
    return seg.mean(loss.reshape(-1)).sum() / denom


@AGGREGATIONS.register("drgrpo")
def aggregate_drgrpo(loss: torch.Tensor, mask: torch.Tensor, seq_ids: Optional[torch.Tensor],
                     norm: LossNormalizers) -> torch.Tensor:
    """sum(loss * mask) / (global num_sequences * max_len)."""
    del seq_ids
    denom = _require(norm.num_sequences, "num_sequences", "drgrpo") * _require(norm.max_len, "max_len", "drgrpo")
    return (loss * mask.to(loss.dtype)).sum() / denom


def aggregate_loss(loss: torch.Tensor, mask: torch.Tensor, mode: str, normalizers: LossNormalizers,
                   seq_ids: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Scalar loss of one micro-batch. loss/mask/seq_ids: same shape ([N] or [bins, seq_length]).

    Summing this over all micro-batches of all DP ranks gives the global loss (see module doc).
    """
    if loss.shape != mask.shape or (seq_ids is not None and seq_ids.shape != loss.shape):
        raise ValueError(f"loss {tuple(loss.shape)}, mask {tuple(mask.shape)} and seq_ids "
                         f"{None if seq_ids is None else tuple(seq_ids.shape)} must have the same shape")
    return AGGREGATIONS.get(mode)(loss, mask, seq_ids, normalizers)
