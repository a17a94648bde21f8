"""The packing plan: which sequences share a row ("bin"), and which rows each data-parallel rank and micro-batch
gets (pure functions, the same on every rank).

0. :func:`split_evenly`: an iteration's sequences split into its optimizer steps, each planned on its own.
1. :func:`plan_packing` -> :class:`PackingInfo`: first-fit decreasing (deterministic) into bins of
   ``bin_capacity`` tokens with at most ``max_sequences_per_bin`` sequences each. With
   ``max_sequences_per_bin=1`` the same code gives the ordinary unpacked (one sequence per row) layout.
2. :func:`distribute_bins` -> :class:`BinDistribution`: bins dealt to data-parallel ranks and micro-batches,
   by a registered algorithm (:data:`PACKING_ALGOS`, ``--rl-sequence-packing-algo``: ``fifo`` or
   ``round-robin``), padded with empty bins so every rank runs the same number of micro-batches.

The packed tensors built from a plan: :mod:`megatron.rl.packing.batch`.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron.rl.base.registry import Registry

logger = logging.getLogger(__name__)

SEQ_LENGTH_FLAG = "--seq-length"
MAX_SEQS_FLAG = "--rl-sequence-packing-max-sequences-per-bin"


def split_evenly(n: int, parts: int) -> list[range]:
    """``parts`` contiguous ranges covering ``range(n)``, sizes differing by at most one (earlier ones larger)."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    base, extra = divmod(n, parts)
    out, start = [], 0
    for i in range(parts):
        size = base + (1 if i < extra else 0)
        out.append(range(start, start + size))
        start += size
    return out


# ----------------------------------------------------------------------------------------------
# 1. The packing plan
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PackingInfo:
    """Where every sequence goes. All fields are plain tuples of ints (deterministic, picklable).

    bin_capacity: tokens per bin (``--seq-length``).
    seq_lengths: [num_seqs] tokens of each sequence.
    seq_to_bin_idx: [num_seqs] bin holding each sequence.
    seq_starts: [num_seqs] offset of each sequence inside its bin.
    bins: [num_bins] bin membership: the sequence indices of each bin, in their order in the bin.
    shared_prefix: [num_seqs] or empty (no sharing): how many leading tokens sequence ``s`` does not store but
        reads, as attention keys, from ``prefix_holder[s]`` earlier in the same bin (its prompt but the last
        token; :mod:`megatron.rl.packing.prefix_sharing`). ``seq_lengths`` counts the tokens *stored*.
    prefix_holder: [num_seqs] or empty: the sequence holding that prefix (-1: none).
    """

    bin_capacity: int
    seq_lengths: tuple[int, ...]
    seq_to_bin_idx: tuple[int, ...]
    seq_starts: tuple[int, ...]
    bins: tuple[tuple[int, ...], ...]
    shared_prefix: tuple[int, ...] = ()
    prefix_holder: tuple[int, ...] = ()

    def skipped(self, s: int) -> int:
        """Leading tokens of sequence ``s`` not stored (read from its prefix holder); 0 without sharing."""
        return self.shared_prefix[s] if self.shared_prefix else 0

    @property
    def num_sequences(self) -> int:
        return len(self.seq_lengths)

    @property
    def num_bins(self) -> int:
        return len(self.bins)

    @property
    def bin_token_counts(self) -> list[int]:
        """Tokens used in each bin."""
        return [sum(self.seq_lengths[s] for s in b) for b in self.bins]

    @property
    def efficiency(self) -> float:
        """Packing efficiency: real tokens / (num_bins * bin_capacity), in (0, 1]; 1.0 for no sequences."""
        if not self.bins:
            return 1.0
        return sum(self.seq_lengths) / (self.num_bins * self.bin_capacity)


def plan_packing(seq_lengths: Sequence[int], bin_capacity: int,
                 max_sequences_per_bin: Optional[int] = None) -> PackingInfo:
    """First-fit decreasing packing of sequences (token counts) into bins of ``bin_capacity`` tokens.

    Sequences are taken longest first (ties: lower index first) and each goes into the lowest-index
    bin that has room for its tokens and fewer than ``max_sequences_per_bin`` sequences; otherwise a
    new bin is opened. Inside a bin, sequences are laid out in increasing sequence index. The result
    depends only on the inputs (deterministic on every rank).

    Raises ValueError for a sequence longer than ``bin_capacity`` (naming its index, its length and
    ``--seq-length``), a non-positive length, or ``max_sequences_per_bin < 1``.
    """
    lengths = [int(x) for x in seq_lengths]
    check_plan_inputs(lengths, bin_capacity, max_sequences_per_bin)
    members = first_fit_decreasing(lengths, [1] * len(lengths), bin_capacity,
                                   max_sequences_per_bin or len(lengths) or 1)
    seq_to_bin, starts, bins = layout_bins([sorted(seqs) for seqs in members], lengths)
    info = PackingInfo(bin_capacity, tuple(lengths), seq_to_bin, starts, bins)
    logger.debug("packed %d sequences into %d bins of %d tokens (efficiency %.3f)", info.num_sequences,
                 info.num_bins, bin_capacity, info.efficiency)
    return info


def check_plan_inputs(lengths: Sequence[int], bin_capacity: int, max_sequences_per_bin: Optional[int]) -> None:
    """The named errors of a packing plan's inputs: a bin capacity or count limit below 1, a sequence with no
    token or longer than a bin."""
    if bin_capacity < 1:
        raise ValueError(f"{SEQ_LENGTH_FLAG} (bin capacity) must be >= 1, got {bin_capacity}")
    if max_sequences_per_bin is not None and max_sequences_per_bin < 1:
        raise ValueError(f"{MAX_SEQS_FLAG} must be >= 1, got {max_sequences_per_bin}")
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} has length {n}; every sequence needs at least one token")
        if n > bin_capacity:
            raise ValueError(f"sequence {i} has {n} tokens, more than {SEQ_LENGTH_FLAG}={bin_capacity}; "
                             f"raise {SEQ_LENGTH_FLAG} or shorten prompts/generations (max_tokens)")


def layout_bins(ordered: Sequence[Sequence[int]], stored_lengths: Sequence[int]
                ) -> tuple[tuple[int, ...], tuple[int, ...], tuple[tuple[int, ...], ...]]:
    """(seq_to_bin_idx, seq_starts, bins) of :class:`PackingInfo` for bins holding the sequences ``ordered[b]``
    one after the other, in that order, each taking ``stored_lengths[s]`` positions."""
    seq_to_bin = [0] * len(stored_lengths)
    starts = [0] * len(stored_lengths)
    for b, seqs in enumerate(ordered):
        offset = 0
        for s in seqs:
            seq_to_bin[s], starts[s] = b, offset
            offset += stored_lengths[s]
    return tuple(seq_to_bin), tuple(starts), tuple(tuple(seqs) for seqs in ordered)


def first_fit_decreasing(lengths: Sequence[int], counts: Sequence[int], capacity: int,
                         max_count: int) -> list[list[int]]:
    """Items (``lengths`` tokens, ``counts`` sequences each) into bins of ``capacity`` tokens and at most
    ``max_count`` sequences: longest first (ties: lower index first), each into the lowest-index bin with room,
    else a new bin. Returns the item indices of each bin, in placement order (pure, deterministic)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    free: list[int] = []
    used: list[int] = []
    members: list[list[int]] = []
    # Bins that are full (no room for even the shortest remaining item, or at the count limit)
    # are skipped by starting the scan at the first bin that is still open.
    first_open = 0
    shortest_left = lengths[order[-1]] if order else 0
    fewest_left = min(counts) if counts else 1
    for i in order:
        n, c = lengths[i], counts[i]
        target = -1
        for b in range(first_open, len(members)):
            if free[b] >= n and used[b] + c <= max_count:
                target = b
                break
        if target < 0:
            target = len(members)
            free.append(capacity)
            used.append(0)
            members.append([])
        free[target] -= n
        used[target] += c
        members[target].append(i)
        while first_open < len(members) and (free[first_open] < shortest_left
                                             or used[first_open] + fewest_left > max_count):
            first_open += 1
    return members


# ----------------------------------------------------------------------------------------------
# 2. Dealing bins to DP ranks and micro-batches
# ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BinDistribution:
    """``assignment[rank][microbatch]`` = the bin indices (``None`` = empty padding bin) of that micro-batch.

    Every rank has ``num_microbatches`` micro-batches of exactly ``micro_batch_size`` bins.
    """

    algo: str
    dp_size: int
    micro_batch_size: int
    num_microbatches: int
    assignment: tuple[tuple[tuple[Optional[int], ...], ...], ...]

    def for_rank(self, rank: int) -> list[Optional[int]]:
        """This rank's bins, micro-batch after micro-batch (rows of its :class:`PackedBatch`)."""
        return [b for mb in self.assignment[rank] for b in mb]

    @property
    def num_padding_bins(self) -> int:
        return sum(b is None for rank in self.assignment for mb in rank for b in mb)


DistributionFn = Callable[[list[Optional[int]], int, int, int], list[list[list[Optional[int]]]]]

PACKING_ALGOS: Registry[DistributionFn] = Registry("sequence packing algorithm", "--rl-sequence-packing-algo")


@PACKING_ALGOS.register("fifo")
def _fifo(bins: list[Optional[int]], dp_size: int, mbs: int, num_mb: int) -> list[list[list[Optional[int]]]]:
    """Bins in order: rank r takes the r-th contiguous block, each micro-batch the next ``mbs`` bins.

    Keeps FFD's order (fullest bins first), so the first ranks/micro-batches get the fullest bins.
    """
    per_rank = mbs * num_mb
    return [[bins[r * per_rank + m * mbs: r * per_rank + (m + 1) * mbs] for m in range(num_mb)]
            for r in range(dp_size)]


@PACKING_ALGOS.register("round-robin")
def _round_robin(bins: list[Optional[int]], dp_size: int, mbs: int, num_mb: int) -> list[list[list[Optional[int]]]]:
    """Dealt like cards, twice: bin i goes to rank ``i % dp_size``; that rank's j-th bin goes to
    micro-batch ``j % num_microbatches`` (slot ``j // num_microbatches``). Balances the token load,
    since FFD puts the fullest bins first and the padding bins last."""
    out = [[[None] * mbs for _ in range(num_mb)] for _ in range(dp_size)]
    for i, b in enumerate(bins):
        rank, j = i % dp_size, i // dp_size
        out[rank][j % num_mb][j // num_mb] = b
    return out


def distribute_bins(num_bins: int, dp_size: int, micro_batch_size: int, algo: str = "fifo",
                    min_num_microbatches: int = 1) -> BinDistribution:
    """Deal bins ``0..num_bins-1`` to ``dp_size`` ranks in micro-batches of ``micro_batch_size`` bins.

    ``num_microbatches = max(ceil(num_bins / (dp_size * micro_batch_size)), min_num_microbatches)``;
    the missing bins are empty padding bins (``None``: all padding, loss mask 0) appended after the
    real ones. Pass ``min_num_microbatches`` (all-reduced MAX) when ranks pack separately and must
    still agree on the number of micro-batches.
    """
    fn = PACKING_ALGOS.get(algo)
    if dp_size < 1 or micro_batch_size < 1:
        raise ValueError(f"dp_size ({dp_size}) and --micro-batch-size ({micro_batch_size}) must be >= 1")
    per_step = dp_size * micro_batch_size
    num_mb = max(math.ceil(num_bins / per_step), min_num_microbatches, 1)
    bins: list[Optional[int]] = list(range(num_bins)) + [None] * (num_mb * per_step - num_bins)
    assignment = fn(bins, dp_size, micro_batch_size, num_mb)
    return BinDistribution(algo, dp_size, micro_batch_size, num_mb,
                           tuple(tuple(tuple(mb) for mb in rank) for rank in assignment))
