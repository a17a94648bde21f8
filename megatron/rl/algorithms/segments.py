"""Per-sequence reductions over flat or packed token tensors, keyed by sequence ids.

Packed rows hold several sequences; every position carries the index of its sequence (``seq_ids``, -1 on
padding) and a 0/1 ``mask`` of the tokens that enter the loss. A *segment* is the set of masked tokens of one
sequence. Sequence-level quantities (GSPO's ratio, sequence-level IS, sequence rejection, the ``sequence``
loss aggregation) reduce over segments and broadcast back to their tokens. A sequence never spans two
micro-batches (packing places whole sequences in bins and micro-batches are whole rows), so segments computed
inside one micro-batch are whole sequences.
"""
from __future__ import annotations

import dataclasses
from typing import Optional

import torch

__all__ = ["Segments", "segments_of"]


@dataclasses.dataclass(frozen=True)
class Segments:
    """The masked tokens of a flat [N] tensor grouped by sequence.

    sel: [N] bool, the masked tokens. inverse: [n] segment index (0 .. count - 1) of each selected token, in
    the order of ``x[sel]``. count: number of segments (sequences with at least one masked token).
    """

    sel: torch.Tensor
    inverse: torch.Tensor
    count: int

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """[count] sum of ``values`` [N] over each segment (differentiable)."""
        out = torch.zeros(self.count, dtype=values.dtype, device=values.device)
        return out.index_add(0, self.inverse, values[self.sel])

    def sizes(self) -> torch.Tensor:
        """[count] number of tokens of each segment (int64)."""
        return torch.bincount(self.inverse, minlength=self.count)

    def mean(self, values: torch.Tensor) -> torch.Tensor:
        """[count] mean of ``values`` over each segment (differentiable)."""
        return self.sum(values) / self.sizes().to(values.dtype)

    def max(self, values: torch.Tensor) -> torch.Tensor:
        """[count] maximum of ``values`` over each segment (no gradient)."""
        out = torch.full((self.count,), float("-inf"), dtype=values.dtype, device=values.device)
        return out.scatter_reduce(0, self.inverse, values.detach()[self.sel], reduce="amax")

    def broadcast(self, per_segment: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
        """[N] each selected token gets its segment's value; unselected tokens get ``fill``."""
        out = torch.full(self.sel.shape, fill, dtype=per_segment.dtype, device=per_segment.device)
        return out.masked_scatter(self.sel, per_segment[self.inverse])


def segments_of(mask: torch.Tensor, seq_ids: Optional[torch.Tensor], what: str = "this") -> Segments:
    """The :class:`Segments` of flat ``mask`` / ``seq_ids`` [N] (any equal shapes are flattened).

    ``what`` names the caller in the error raised when ``seq_ids`` is missing (sequence-level math needs it).
    """
    if seq_ids is None:
        raise ValueError(f"{what} needs seq_ids (the sequence index of every token) for its per-sequence reductions")
    if seq_ids.shape != mask.shape:
        raise ValueError(f"seq_ids {tuple(seq_ids.shape)} and mask {tuple(mask.shape)} must have the same shape")
    sel = mask.reshape(-1).bool()
    ids = seq_ids.reshape(-1)[sel]
    if ids.numel() == 0:
        return Segments(sel, torch.zeros(0, dtype=torch.long, device=mask.device), 0)
    _, inverse = torch.unique(ids, return_inverse=True)
    return Segments(sel, inverse, int(inverse.max()) + 1)
