"""Concatenated integer ranges as tensors (pure): the elements of ``starts[i] .. ends[i] - 1`` for every ``i``, in
order, with the ``i`` each came from. Per-request token positions, KV-block columns and cache slots are all such
ranges; one ``repeat_interleave`` makes them for a whole batch, where a Python loop would make one tensor a range.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["concat_ranges"]


def concat_ranges(starts: Sequence[int], ends: Sequence[int], device: torch.device | str = "cpu"
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(owner, value)`` int64 tensors of length ``sum(ends[i] - starts[i])``: ``value`` runs through each range in
    turn (``torch.cat([torch.arange(s, e) for s, e in zip(starts, ends)])``) and ``owner`` is the index ``i`` of the
    range each element belongs to. Empty ranges contribute nothing."""
    counts = torch.tensor([e - s for s, e in zip(starts, ends)], dtype=torch.long, device=device)
    owner = torch.repeat_interleave(torch.arange(len(counts), device=device), counts)
    # each element's value: its flat index, shifted by where its range starts in the flat order and in value
    shift = torch.tensor(list(starts), dtype=torch.long, device=device) - (torch.cumsum(counts, 0) - counts)
    return owner, torch.arange(owner.numel(), device=device) + shift[owner]
