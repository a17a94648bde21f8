"""Packed tensors from a packing plan: rows of several sequences, and per-token values moved in and out of them.

:func:`build_packed_batch` -> :class:`PackedBatch`: tokens, labels, position ids (reset to 0 at every sequence
start), loss mask and per-token values aligned with the labels, sequence ids, and the boundaries for attention
(``packed_seq_params()`` for THD, or ``attention_mask()``). :func:`pack_per_token` / :func:`unpack_per_token` move
per-token values (log-probs) between the packed layout and per-sequence tensors. The plan itself (which sequences
share a row, which rows each rank gets) is :mod:`megatron.rl.packing.plan`; nothing here touches process groups.

Layout: a sequence of ``L`` tokens has ``L - 1`` predicted entries; in its row, position ``start + j - 1`` holds
``labels = token j`` and every label-aligned value of token ``j`` (megatron's convention: the logits at position
``p`` score ``labels[p]``); its last position has no label (``pad``, loss mask 0).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Mapping, Optional, Sequence

import torch

from megatron.rl.packing.plan import BinDistribution, PackingInfo

__all__ = ["PackedBatch", "align_generated_values", "build_packed_batch", "build_rank_batch", "pack_per_token",
           "unpack_per_token"]


@dataclass
class PackedBatch:
    """Rows of packed sequences; every tensor is [num_rows, seq_length] (``seq_length`` = bin capacity).

    tokens: input ids (``pad`` on padding). labels: the next token *within the same sequence*
    (``pad`` at a sequence's last position and on padding). position_ids: 0 at every sequence start
    (padding counts up from 0 too). loss_mask: float, 1 where ``labels`` is a trained token.
    seq_ids: global sequence index of each position, -1 on padding. values: per-token values aligned
    with ``labels`` (advantages, old/ref/inference log-probs, ...). bin_ids: the global bin of each
    row (``None`` = empty padding bin). row_segments: lengths of the attention segments of each row
    (its sequences, then the padding as one extra segment if any); they sum to ``seq_length``.
    token_values: per-token values aligned with ``tokens`` ([num_rows, seq_length, ...], any dtype, ``-1`` on
    padding), e.g. ``routes`` (the MoE routes a forward replays).
    """

    tokens: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    seq_ids: torch.Tensor
    values: dict[str, torch.Tensor]
    bin_ids: tuple[Optional[int], ...]
    row_segments: tuple[tuple[int, ...], ...]
    info: PackingInfo = field(repr=False)
    token_values: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_length(self) -> int:
        return self.tokens.shape[1]

    def rows(self, start: int, stop: int) -> "PackedBatch":
        """Rows ``start:stop`` as a PackedBatch (views, no copies)."""
        return PackedBatch(self.tokens[start:stop], self.labels[start:stop], self.position_ids[start:stop],
                           self.loss_mask[start:stop], self.seq_ids[start:stop],
                           {k: v[start:stop] for k, v in self.values.items()}, self.bin_ids[start:stop],
                           self.row_segments[start:stop], self.info,
                           {k: v[start:stop] for k, v in self.token_values.items()})

    def crop(self, num_rows: int, length: int) -> "PackedBatch":
        """The first ``num_rows`` rows cut to their first ``length`` positions (views, no copies).

        Only padding may be cut: every sequence of the kept rows must end within ``length``; the padding
        segment of each row is shortened (or dropped) to match.
        """
        segments = []
        for row in self.row_segments[:num_rows]:
            kept, total = [], 0
            for n in row:
                if total < length:
                    kept.append(min(n, length - total))
                    total += kept[-1]
            segments.append(tuple(kept))
        cut = self.seq_ids[:num_rows, length:]
        if cut.numel() and bool((cut >= 0).any()):
            raise ValueError(f"cropping to {num_rows} rows x {length} positions would cut real tokens")
        return PackedBatch(self.tokens[:num_rows, :length], self.labels[:num_rows, :length],
                           self.position_ids[:num_rows, :length], self.loss_mask[:num_rows, :length],
                           self.seq_ids[:num_rows, :length], {k: v[:num_rows, :length] for k, v in self.values.items()},
                           self.bin_ids[:num_rows], tuple(segments), self.info,
                           {k: v[:num_rows, :length] for k, v in self.token_values.items()})

    def to(self, device: torch.device | str) -> "PackedBatch":
        """A copy with every tensor on ``device`` (plans and segment lengths are host-side metadata)."""
        return PackedBatch(self.tokens.to(device), self.labels.to(device), self.position_ids.to(device),
                           self.loss_mask.to(device), self.seq_ids.to(device),
                           {k: v.to(device) for k, v in self.values.items()}, self.bin_ids, self.row_segments,
                           self.info, {k: v.to(device) for k, v in self.token_values.items()})

    def cu_seqlens(self) -> torch.Tensor:
        """int32 [num_segments + 1]: cumulative segment lengths over the flattened rows (``[1, rows * S]``)."""
        lengths = [n for row in self.row_segments for n in row]
        cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        cu[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        return cu

    def sequence_spans(self) -> tuple[tuple[tuple[int, ...], ...], ...]:
        """Per row: (start, length) of each real sequence, in row order (padding excluded); a sequence stored
        after a shared prefix has (start, length, prefix start, prefix length): its queries also attend to those
        positions (its prefix holder's first tokens)."""
        info = self.info
        return tuple(() if b is None else tuple(
            (info.seq_starts[s], info.seq_lengths[s]) if not info.skipped(s) else
            (info.seq_starts[s], info.seq_lengths[s], info.seq_starts[info.prefix_holder[s]], info.skipped(s))
            for s in info.bins[b]) for b in self.bin_ids)

    def max_seqlen(self) -> int:
        return max(n for row in self.row_segments for n in row)

    def packed_seq_params(self):
        """megatron-core ``PackedSeqParams`` (``qkv_format="thd"``) for the flattened rows.

        Feed the model ``tokens.reshape(1, -1)`` and ``position_ids.reshape(1, -1)`` with it; padding
        forms its own segments, so no real token attends across a sequence boundary. With pipeline
        parallelism the schedule's tensor shape is then ``seq_length = rows * S``, ``micro_batch_size = 1``.
        No context-parallel padding (``cu_seqlens_*_padded``) is produced. Needs an
        attention implementation that honours THD packing (TransformerEngine); megatron-core's local
        ``DotProductAttention`` asserts ``packed_seq_params is None`` - use :meth:`attention_mask` there.
        """
        from megatron.core.packed_seq_params import PackedSeqParams

        if self.info.shared_prefix:
            raise ValueError("THD packing cannot express shared prompt prefixes (a segment attends to its own "
                             "tokens only): plan without them (--rl-share-prompt-prefix off)")
        cu = self.cu_seqlens().to(self.tokens.device)
        max_len = self.max_seqlen()
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=max_len, max_seqlen_kv=max_len)

    def attention_mask(self) -> torch.Tensor:
        """Bool [num_rows, 1, S, S], True = masked (megatron's convention): causal within each segment.

        For attention implementations without THD support (the local spec on CPU): pass it as
        ``attention_mask`` with the ``[num_rows, S]`` tokens. Memory O(rows * S^2).
        """
        s = self.seq_length
        # Segment id of every position: how many segment ends (cumulative lengths) lie at or before it. One
        # vectorised comparison for all rows (a repeat_interleave per row cost ~1 ms per row on CPU).
        width = max(len(row) for row in self.row_segments)
        ends = torch.tensor([[*itertools.accumulate(row), *[s] * (width - len(row))] for row in self.row_segments])
        seg = (torch.arange(s)[None, :, None] >= ends[:, None, :]).sum(-1).to(self.tokens.device)
        same = seg[:, :, None] == seg[:, None, :]
        causal = torch.ones(s, s, dtype=torch.bool, device=self.tokens.device).tril()
        allowed = same & causal
        for r, row in enumerate(self.sequence_spans()):  # queries after a shared prefix also see its keys
            for span in row:
                if len(span) == 4:
                    start, n, prefix_start, prefix_n = span
                    allowed[r, start:start + n, prefix_start:prefix_start + prefix_n] = True
        return ~allowed[:, None]

    def efficiency(self) -> float:
        """Real tokens / (rows * seq_length), counting empty padding rows."""
        return float((self.seq_ids >= 0).sum()) / max(self.tokens.numel(), 1)


def align_generated_values(values: Sequence[float] | torch.Tensor, prompt_length: int, num_tokens: int,
                           fill: float = 0.0) -> torch.Tensor:
    """Per-generated-token values (e.g. inference log-probs, one per generated token) -> predicted layout.

    Returns float [num_tokens - 1]: generated token k is token ``prompt_length + k``, at entry
    ``prompt_length + k - 1``; the prompt's entries are ``fill``.
    """
    values = torch.as_tensor(values, dtype=torch.float32) if not isinstance(values, torch.Tensor) else values
    if prompt_length < 1 or prompt_length + values.numel() != num_tokens:
        raise ValueError(f"{values.numel()} generated values + prompt length {prompt_length} != {num_tokens} tokens "
                         f"(the prompt needs >= 1 token)")
    out = torch.full((num_tokens - 1,), fill, dtype=values.dtype)
    out[prompt_length - 1:] = values
    return out


def _check_lengths(name: str, items: Sequence, info: PackingInfo, offset: int) -> None:
    if len(items) != info.num_sequences:
        raise ValueError(f"{name}: {len(items)} sequences, the packing plan has {info.num_sequences}")
    for s, item in enumerate(items):
        full = info.seq_lengths[s] + info.skipped(s)
        if len(item) != full + offset:
            raise ValueError(f"{name}[{s}] has {len(item)} entries, expected {full + offset} "
                             f"(sequence of {full} tokens)")


def build_packed_batch(info: PackingInfo, bin_ids: Sequence[Optional[int]], token_ids: Sequence[Sequence[int]],
                       loss_masks: Sequence[Sequence[int]], pad_token_id: int, *,
                       per_token: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
                       per_sequence: Optional[Mapping[str, torch.Tensor]] = None,
                       token_aligned: Optional[Mapping[str, Sequence[torch.Tensor]]] = None,
                       dtype: torch.dtype = torch.float32) -> PackedBatch:
    """Build the rows ``bin_ids`` (global bin indices; ``None`` = empty padding row) of a packed batch.

    Args:
        info: the packing plan over all sequences.
        token_ids: [num_seqs] token ids of every sequence (prompt + generation), whole: a sequence sharing a prefix
            (``info.shared_prefix``) is stored without it, and its positions count on from it.
        loss_masks: [num_seqs] token-aligned masks (same lengths as ``token_ids``): 1 for tokens that are
            trained (generated tokens). Entry 0 must be 0: the first token is never predicted.
        pad_token_id: id for padding and for the label of a sequence's last position.
        per_token: name -> [num_seqs] tensors in predicted layout (``L_s - 1`` entries each), e.g.
            ``old_logprobs``, ``inference_logprobs``, ``ref_logprobs``.
        per_sequence: name -> tensor [num_seqs], broadcast to every position of the sequence (e.g.
            ``advantages``).
        token_aligned: name -> [num_seqs] tensors aligned with the tokens ([L_s, ...], kept in their dtype, whole
            like ``token_ids``), placed at the tokens' positions (``-1`` elsewhere): ``PackedBatch.token_values``.
    Returns: PackedBatch with ``len(bin_ids)`` rows of ``info.bin_capacity`` positions.
    """
    per_token, per_sequence, token_aligned = dict(per_token or {}), dict(per_sequence or {}), dict(token_aligned or {})
    _check_inputs(info, token_ids, loss_masks, per_token, per_sequence, token_aligned)
    rows, s_len = len(bin_ids), info.bin_capacity
    at = _Placement.of(info, bin_ids)
    flat_ids = _concat([_stored(token_ids[s], k) for s, k in zip(at.order, at.skip)], torch.long)
    flat_mask = _concat([_stored(loss_masks[s], k) for s, k in zip(at.order, at.skip)], dtype)
    if len(at.order) and bool(flat_mask[at.first].any()):
        bad = at.order[int(flat_mask[at.first].nonzero()[0])]
        raise ValueError(f"loss_masks[{bad}][0] is set, but the first token of a sequence has no "
                         f"prediction; only generated tokens (after the prompt) can be trained")
    pred_where = at.where[at.predicted]
    tokens = torch.full((rows * s_len,), pad_token_id, dtype=torch.long)
    tokens[at.where] = flat_ids
    labels = torch.full((rows * s_len,), pad_token_id, dtype=torch.long)
    # a predicted position holds the next token's label and mask (never past its sequence's end)
    labels[pred_where] = flat_ids.roll(-1)[at.predicted]
    loss_mask = torch.zeros(rows * s_len, dtype=dtype)
    loss_mask[pred_where] = flat_mask.roll(-1)[at.predicted]
    seq_ids = torch.full((rows * s_len,), -1, dtype=torch.long)
    seq_ids[at.where] = torch.repeat_interleave(at.order_t, at.lengths)
    # positions count from 0 in every sequence and in each row's padding tail
    row_lengths = [[info.seq_lengths[s] for s in seqs] for seqs in at.row_seqs]
    used = [sum(ls) for ls in row_lengths]
    segment_start = torch.repeat_interleave(torch.tensor([r * s_len + u for r, u in enumerate(used)],
                                                         dtype=torch.long), s_len)
    segment_start[at.where] = at.seq_start
    position_ids = torch.arange(rows * s_len) - segment_start
    if any(at.skip):  # a sequence stored after its shared prefix counts its positions on from it
        position_ids[at.where] += torch.repeat_interleave(torch.tensor(at.skip, dtype=torch.long), at.lengths)
    values = _placed_values(at, rows * s_len, per_token, per_sequence, dtype)
    aligned = {k: flat.view(rows, s_len, *flat.shape[1:]) for k, flat in _placed_aligned(at, rows * s_len,
                                                                                          token_aligned).items()}
    segments = [tuple(ls + ([s_len - u] if u < s_len else [])) for ls, u in zip(row_lengths, used)]
    return PackedBatch(tokens.view(rows, s_len), labels.view(rows, s_len), position_ids.view(rows, s_len),
                       loss_mask.view(rows, s_len), seq_ids.view(rows, s_len),
                       {k: v.view(rows, s_len) for k, v in values.items()}, tuple(bin_ids), tuple(segments), info,
                       aligned)


def _check_inputs(info: PackingInfo, token_ids: Sequence, loss_masks: Sequence, per_token: dict,
                  per_sequence: dict, token_aligned: dict) -> None:
    """Every input has one entry per sequence of the plan, of the lengths :func:`build_packed_batch` documents."""
    _check_lengths("token_ids", token_ids, info, 0)
    _check_lengths("loss_masks", loss_masks, info, 0)
    for name, vals in per_token.items():
        _check_lengths(f"per_token[{name!r}]", vals, info, -1)
    for name, vals in per_sequence.items():
        if vals.shape != (info.num_sequences,):
            raise ValueError(f"per_sequence[{name!r}] must have shape [{info.num_sequences}], got {tuple(vals.shape)}")
    for name, vals in token_aligned.items():
        _check_lengths(f"token_aligned[{name!r}]", vals, info, 0)
    if set(per_token) & set(per_sequence):
        raise ValueError(f"names used twice: {sorted(set(per_token) & set(per_sequence))}")


@dataclass
class _Placement:
    """Every real token's flat position (row * S + offset + i) in the rows, laid out sequence after sequence: each
    tensor is then filled by one scatter instead of ~10 small slice assignments per sequence (this runs on every
    iteration's whole batch)."""

    row_seqs: list  # [rows] the sequences of each row
    order: list[int]  # the sequences in placement order
    order_t: torch.Tensor
    lengths: torch.Tensor  # [sequences] stored lengths, in placement order
    skip: list[int]  # [sequences] shared-prefix tokens not stored, in placement order
    seq_start: torch.Tensor  # [tokens] flat position of the token's sequence start
    first: torch.Tensor  # [sequences] index of each sequence's first token among all tokens
    where: torch.Tensor  # [tokens] flat position of every token
    predicted: torch.Tensor  # [tokens] every token but each sequence's last

    @classmethod
    def of(cls, info: PackingInfo, bin_ids: Sequence[Optional[int]]) -> "_Placement":
        s_len = info.bin_capacity
        row_seqs = [() if b is None else info.bins[b] for b in bin_ids]
        placed = [(r, s) for r, seqs in enumerate(row_seqs) for s in seqs]
        order = [s for _, s in placed]
        lengths = torch.tensor([info.seq_lengths[s] for s in order], dtype=torch.long)
        starts = torch.tensor([r * s_len + info.seq_starts[s] for r, s in placed], dtype=torch.long)
        seq_start = torch.repeat_interleave(starts, lengths)
        first = torch.cumsum(lengths, 0) - lengths
        within = torch.arange(int(lengths.sum())) - torch.repeat_interleave(first, lengths)  # index in the sequence
        return cls(row_seqs=row_seqs, order=order, order_t=torch.tensor(order, dtype=torch.long), lengths=lengths,
                   skip=[info.skipped(s) for s in order], seq_start=seq_start, first=first,
                   where=seq_start + within, predicted=within < torch.repeat_interleave(lengths - 1, lengths))


def _placed_values(at: _Placement, size: int, per_token: dict, per_sequence: dict,
                   dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Flat [size] tensors: per-token values at the predicted positions, per-sequence ones at every position."""
    values = {}
    for k, v in per_token.items():
        flat = torch.zeros(size, dtype=dtype)
        flat[at.where[at.predicted]] = _concat([_stored(v[s], n) for s, n in zip(at.order, at.skip)], dtype)
        values[k] = flat
    for k, v in per_sequence.items():
        flat = torch.zeros(size, dtype=dtype)
        flat[at.where] = torch.repeat_interleave(v.to(dtype)[at.order_t], at.lengths)
        values[k] = flat
    return values


def _placed_aligned(at: _Placement, size: int, token_aligned: dict) -> dict[str, torch.Tensor]:
    """Flat [size, ...] tensors of the token-aligned values at their tokens' positions, -1 elsewhere."""
    aligned = {}
    for k, v in token_aligned.items():
        stored = [_stored(v[s], n) for s, n in zip(at.order, at.skip)]
        like = v[0] if len(v) else torch.zeros(0, dtype=torch.long)  # trailing shape and dtype of every sequence's
        flat = torch.full((size, *like.shape[1:]), -1, dtype=like.dtype)
        if stored:
            flat[at.where] = torch.cat(stored).to(like.dtype)
        aligned[k] = flat
    return aligned


def _stored(item: Sequence, skipped: int) -> Sequence:
    """The part of a sequence's tokens (or token-aligned values) that is stored: all but a shared prefix."""
    return item[skipped:] if skipped else item


def _concat(items: Sequence, dtype: torch.dtype) -> torch.Tensor:
    """Sequences of numbers (lists or tensors) -> one tensor of ``dtype``, each converted as
    ``torch.as_tensor(item).to(dtype)`` would (Python floats through float32 first), in two or three torch calls
    instead of three per item (each costs a torch-function dispatch on CPU)."""
    if not items:
        return torch.zeros(0, dtype=dtype)
    tensors = sum(isinstance(x, torch.Tensor) for x in items)
    if tensors == len(items):
        return torch.cat([x.reshape(-1) for x in items]).to(dtype)
    if tensors:  # a mix: item by item
        return torch.cat([torch.as_tensor(x).reshape(-1).to(dtype) for x in items])
    flat = list(itertools.chain.from_iterable(items))
    if any(isinstance(v, float) for v in flat):
        return torch.tensor(flat, dtype=torch.float32).to(dtype)
    return torch.tensor(flat, dtype=torch.long).to(dtype)


def build_rank_batch(info: PackingInfo, distribution: BinDistribution, rank: int,
                     token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                     pad_token_id: int, **kwargs) -> PackedBatch:
    """:func:`build_packed_batch` for the rows of ``rank`` (micro-batch after micro-batch)."""
    return build_packed_batch(info, distribution.for_rank(rank), token_ids, loss_masks, pad_token_id, **kwargs)


# ----------------------------------------------------------------------------------------------
# Per-token values <-> sequences
# ----------------------------------------------------------------------------------------------
def pack_per_token(values: Sequence[torch.Tensor], info: PackingInfo, bin_ids: Sequence[Optional[int]],
                   fill: float = 0.0) -> torch.Tensor:
    """Per-sequence predicted-layout values ([L_s - 1] each, all sequences) -> [len(bin_ids), S]."""
    if info.shared_prefix:
        raise ValueError("per-sequence values of a plan with shared prefixes: sequences are stored without them")
    _check_lengths("values", values, info, -1)
    dtype = values[0].dtype if len(values) else torch.float32
    out = torch.full((len(bin_ids), info.bin_capacity), fill, dtype=dtype)
    for r, b in enumerate(bin_ids):
        for s in (() if b is None else info.bins[b]):
            o, n = info.seq_starts[s], info.seq_lengths[s]
            out[r, o:o + n - 1] = values[s]
    return out


def unpack_per_token(packed: torch.Tensor, info: PackingInfo,
                     bin_ids: Sequence[Optional[int]]) -> dict[int, torch.Tensor]:
    """Packed label-aligned values [len(bin_ids), S] -> {sequence index: [L_s - 1]} for the sequences
    in those rows (views into ``packed``; gradients flow through). Merge the dicts of all micro-
    batches to get every sequence."""
    if info.shared_prefix:
        raise ValueError("per-sequence values of a plan with shared prefixes: sequences are stored without them")
    if packed.shape[0] != len(bin_ids) or packed.shape[-1] != info.bin_capacity:
        raise ValueError(f"packed values {tuple(packed.shape)} do not match {len(bin_ids)} rows of "
                         f"{info.bin_capacity} positions")
    out = {}
    for r, b in enumerate(bin_ids):
        for s in (() if b is None else info.bins[b]):
            o, n = info.seq_starts[s], info.seq_lengths[s]
            out[s] = packed[r, o:o + n - 1]
    return out
