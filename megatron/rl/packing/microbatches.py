"""Micro-batches of a rank's packed rows, each at the shape it needs.

Without pipeline parallelism each micro-batch drops its trailing empty rows and the positions after its longest
row (*dynamic shapes*; same loss up to rounding). With pipeline parallelism every micro-batch keeps the fixed
``(seq_length, micro_batch_size)`` shape the schedule allocates from. Where forwards exchange activations across
DP ranks (expert parallelism) micro-batch ``i`` is cropped to the largest shape over those ranks
(:func:`shared_microbatch_shapes`).

Why: docs/packing.md.
"""
from __future__ import annotations

from typing import Iterator, Optional, Sequence

from megatron.rl.packing.plan import BinDistribution, PackingInfo
from megatron.rl.packing.batch import PackedBatch


def microbatch_shape(info: PackingInfo, bin_ids: Sequence[Optional[int]], length_multiple: int = 1) -> tuple[int, int]:
    """(rows, positions) a micro-batch holding bins ``bin_ids`` needs with dynamic shapes.

    Rows: up to its last non-empty bin (at least one, so every rank still runs the micro-batch).
    Positions: its fullest bin's tokens rounded up to ``length_multiple`` (sequence parallelism splits
    the sequence dimension over tensor-parallel ranks), at least 1, at most the bin capacity.
    """
    used = [0 if b is None else sum(info.seq_lengths[s] for s in info.bins[b]) for b in bin_ids]
    rows = max((i + 1 for i, n in enumerate(used) if n), default=1)
    length = max(max(used[:rows], default=0), 1)
    length = -(-length // length_multiple) * length_multiple
    return rows, min(length, info.bin_capacity)


def shared_microbatch_shapes(info: PackingInfo, distribution: BinDistribution,
                             length_multiple: int = 1) -> list[tuple[int, int]]:
    """Per micro-batch index: the (rows, positions) that hold every data-parallel rank's micro-batch there.

    Pure: computed from the whole distribution, so all ranks agree without communicating.
    """
    shapes = []
    for i in range(distribution.num_microbatches):
        per_rank = [microbatch_shape(info, rank[i], length_multiple) for rank in distribution.assignment]
        shapes.append((max(r for r, _ in per_rank), max(n for _, n in per_rank)))
    return shapes


class MicrobatchDataLoader:
    """Re-iterable: each ``iter()`` yields the micro-batches (``micro_batch_size`` rows each, cropped with
    ``dynamic_shapes``) again, so ``--grpo-iterations`` passes and megatron's ``forward_backward_func``
    (which calls ``next()`` ``num_microbatches`` times) can share it. Micro-batches are views into
    ``batch``: values written into ``mb.values`` land in the batch. ``shapes`` (with ``dynamic_shapes``):
    the (rows, positions) of each micro-batch, e.g. :func:`shared_microbatch_shapes`; default each one's own."""

    def __init__(self, batch: PackedBatch, micro_batch_size: int, dynamic_shapes: bool = False,
                 length_multiple: int = 1, shapes: Optional[Sequence[tuple[int, int]]] = None):
        if micro_batch_size < 1 or batch.num_rows % micro_batch_size:
            raise ValueError(f"{batch.num_rows} packed rows cannot be split into micro-batches of "
                             f"--micro-batch-size={micro_batch_size}")
        self.batch = batch
        self.micro_batch_size = micro_batch_size
        self.dynamic_shapes = dynamic_shapes
        self.length_multiple = length_multiple
        if shapes is not None and len(shapes) != len(self):
            raise ValueError(f"{len(shapes)} micro-batch shapes for {len(self)} micro-batches")
        self.shapes = shapes

    def __len__(self) -> int:
        return self.batch.num_rows // self.micro_batch_size

    def __iter__(self) -> Iterator[PackedBatch]:
        for i in range(len(self)):
            mb = self.batch.rows(i * self.micro_batch_size, (i + 1) * self.micro_batch_size)
            if self.dynamic_shapes:
                shape = self.shapes[i] if self.shapes is not None else None
                mb = mb.crop(*(shape or microbatch_shape(mb.info, mb.bin_ids, self.length_multiple)))
            yield mb


def get_microbatch_dataloader(batch: PackedBatch, micro_batch_size: int, dynamic_shapes: bool = False,
                              length_multiple: int = 1,
                              shapes: Optional[Sequence[tuple[int, int]]] = None) -> MicrobatchDataLoader:
    """Micro-batches of ``micro_batch_size`` consecutive rows of ``batch`` (see :class:`MicrobatchDataLoader`)."""
    return MicrobatchDataLoader(batch, micro_batch_size, dynamic_shapes, length_multiple, shapes)


def token_slots(info: PackingInfo, distribution: BinDistribution, dynamic_shapes: bool,
                length_multiple: int = 1, shared: bool = False) -> int:
    """Positions the model computes for one optimizer step over all ranks (padding included): the
    denominator of the packing efficiency. ``shared``: shapes from :func:`shared_microbatch_shapes`."""
    if not dynamic_shapes:
        return distribution.dp_size * distribution.num_microbatches * distribution.micro_batch_size * info.bin_capacity
    if shared:
        shapes = shared_microbatch_shapes(info, distribution, length_multiple)
        return distribution.dp_size * sum(rows * length for rows, length in shapes)
    total = 0
    for rank in distribution.assignment:
        for mb in rank:
            rows, length = microbatch_shape(info, mb, length_multiple)
            total += rows * length
    return total
