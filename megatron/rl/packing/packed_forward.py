"""Packed rows computed as if each sequence ran alone: RoPE at its own positions, attention over its own keys.

For the local layer spec (no THD), :func:`isolate_sequences` wraps one forward with two hooks on megatron-core's
own modules (no copy of their math): :func:`rope_at_positions` rotates at each sequence's ``position_ids``, and
:func:`attention_per_sequence` runs attention per sequence, per group of length classes or masked over the row,
as :func:`choose_attention` picks (``--rl-packed-attention``); with ``exact`` packed log-probs equal the
one-sequence-per-row forward's bit for bit. Under activation recomputation only the RoPE hook applies; context
parallelism and fused RoPE are refused. Why each choice: docs/packing.md; timings: docs/benchmarks.md.
"""
from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch

from megatron.rl.runtime.attention_override import attention_forward_per_call
from megatron.rl.runtime.length_groups import length_class_groups
from megatron.rl.runtime.torch_attention import MIN_KEY_SLOTS

# per row: (start, length) of each real sequence, in row order; (start, length, prefix start, prefix length) for a
# sequence whose queries also attend to a shared prefix earlier in the row (megatron.rl.packing.prefix_sharing)
Spans = Sequence[Sequence[tuple[int, ...]]]


def _transformer_config(model: torch.nn.Module):
    """The model's TransformerConfig (wrappers such as DDP carry configs of their own: skip those)."""
    for m in model.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "apply_rope_fusion"):
            return config
    return None


def gather_rotary_table(table: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """The RoPE table's rows at each token's position.

    Args:
        table: [S_table, 1, 1, dim] megatron-core's table (``RotaryEmbedding(S)``), row p = angles of position p.
        position_ids: [rows, S] int64, each < S_table.
    Returns: [S, rows, 1, dim], for queries/keys laid out [S, rows, heads, dim].
    """
    if table.dim() != 4 or table.shape[1] != 1 or table.shape[2] != 1:
        raise ValueError(f"expected a shared RoPE table [S, 1, 1, dim], got {tuple(table.shape)}")
    if position_ids.numel() and int(position_ids.max()) >= table.shape[0]:
        raise ValueError(f"position id {int(position_ids.max())} is outside the RoPE table of {table.shape[0]} "
                         f"positions")
    return table[:, 0, 0, :][position_ids.t().to(table.device)].unsqueeze(2)


@contextlib.contextmanager
def rope_at_positions(model: torch.nn.Module, position_ids: torch.Tensor) -> Iterator[None]:
    """While active, every ``RotaryEmbedding`` in ``model`` returns its table gathered at ``position_ids``.

    Wrap one [rows, S] (non-THD) forward call; ``position_ids`` [rows, S] are the ones given to the model. A model
    without RoPE is left alone.
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    modules = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
    if not modules:
        yield
        return
    config = _transformer_config(model)
    if config is not None:
        if getattr(config, "context_parallel_size", 1) > 1:
            raise NotImplementedError("per-sequence RoPE positions in packed rows do not support context "
                                      "parallelism (megatron-core slices the RoPE table per CP rank)")
        if getattr(config, "apply_rope_fusion", False):
            raise NotImplementedError("per-sequence RoPE positions need the unfused RoPE (apply_rope_fusion="
                                      "False); fused RoPE comes with TransformerEngine, whose packed forward is "
                                      "THD and needs no override")

    def hook(module, args, output):
        if not isinstance(output, torch.Tensor):
            raise TypeError(f"{type(module).__name__} returned {type(output).__name__}; per-sequence RoPE "
                            f"positions support the plain [S, 1, 1, dim] table only")
        return gather_rotary_table(output, position_ids)

    handles = [m.register_forward_hook(hook) for m in modules]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _sequences(spans: Spans) -> list[tuple[int, int, int, int, int]]:
    """(row, start, length, prefix start, prefix length) of every real sequence (prefix length 0: none; see
    :meth:`~megatron.rl.packing.batch.PackedBatch.sequence_spans`), checking that each row's spans are
    contiguous from 0 and that a prefix lies before its sequence in the row."""
    out = []
    for r, row in enumerate(spans):
        used = 0
        for span in row:
            start, n = span[0], span[1]
            prefix_start, prefix_n = (span[2], span[3]) if len(span) == 4 else (start, 0)
            if start != used or n < 1:
                raise ValueError(f"row {r}: sequence spans {list(row)} are not contiguous from position 0")
            if prefix_n and (prefix_n < 0 or prefix_start < 0 or prefix_start + prefix_n > start):
                raise ValueError(f"row {r}: the shared prefix {span[2:]} of the sequence at {start} is not before it")
            out.append((r, start, n, prefix_start, prefix_n))
            used += n
    return out


def attention_groups(lengths: Sequence[int], grouping: str, overhead: int = 0,
                     prefixes: Sequence[int] | None = None) -> list[list[int]]:
    """Which sequences (by their ``lengths``, and the shared-prefix lengths their queries also attend to)
    share one attention call (pure).

    ``"exact"``: one group per distinct (length, prefix length) (each call is the sequences' own product).
    ``"grouped"``: power-of-two classes of key length (prefix + length), adjacent classes merged where that is
    cheaper (:func:`~megatron.rl.runtime.length_groups.length_class_groups`): a group costs ``overhead + count
    x longest^2`` score elements per head (its queries x its padded keys), and the split minimising the total is
    found exactly. Groups come out shortest first, each in sequence order.
    """
    prefixes = prefixes or [0] * len(lengths)
    if grouping == "exact":
        by_shape: dict[tuple[int, int], list[int]] = {}
        for i, (n, prefix) in enumerate(zip(lengths, prefixes)):
            by_shape.setdefault((n, prefix), []).append(i)
        return list(by_shape.values())
    if grouping != "grouped":
        raise ValueError(f"grouping must be 'exact' or 'grouped', got {grouping!r}")
    keys = [n + prefix for n, prefix in zip(lengths, prefixes)]
    if not any(prefixes):
        return length_class_groups(keys, overhead, power=2)
    # A call pads every sequence's queries to its longest own length. A sequence after a shared prefix has few
    # queries (its completion) against many keys (the prompt): next to a whole sequence of the same key length it
    # would be padded to that sequence's queries (a 65-token completion after a 511-token prompt: 576 query rows
    # instead of 65). Sequences with and without a prefix therefore never share a call.
    split = [[i for i, p in enumerate(prefixes) if not p], [i for i, p in enumerate(prefixes) if p]]
    groups = [[part[j] for j in group] for part in split if part
              for group in length_class_groups([keys[i] for i in part], overhead, power=2)]
    return sorted(groups, key=lambda g: (max(keys[i] for i in g), g[0]))


def grouped_attention_cost(lengths: Sequence[int], overhead: int) -> int:
    """Score elements per head, plus ``overhead`` per call, of the ``"grouped"`` attention of ``lengths``."""
    return sum(overhead + len(g) * max(lengths[i] for i in g) ** 2
               for g in attention_groups(lengths, "grouped", overhead))


# What one more attention call costs, in score elements per head: a call's ~30 small ops (forward and backward)
# against the per-element cost of the products, the masked softmax and their backward. CPU: fitted to forward +
# backward times of masked and grouped rows on 2 cores (hidden 64-256, rows of 64-1024 tokens); GPUs: kernel
# launches against memory bandwidth.
_CALL_OVERHEAD_SCORES = {"cpu": 16 * 1024, "cuda": 4 * 1024 * 1024}


def call_overhead_scores(device: torch.device) -> int:
    return _CALL_OVERHEAD_SCORES.get(device.type, _CALL_OVERHEAD_SCORES["cuda"])


def choose_attention(spans: Spans, seq_length: int, mode: str, device: torch.device) -> str:
    """The attention of one [rows, S] packed forward: ``"masked"`` (one product over each whole row, the
    sequences kept apart by the block-diagonal mask), ``"exact"`` or ``"grouped"`` (:func:`attention_groups`).

    ``mode="auto"`` takes ``"grouped"`` where its estimated cost (its calls' padded products, one call overhead
    each and one more for gathering and scattering the rows) is below the masked product's ``rows x S^2``
    score elements per head: rows holding several sequences much shorter than the row. Rows of one sequence
    each, or of a few sequences filling short rows, stay masked. A sequence after a shared prefix counts as long
    as its keys (prefix + own tokens). A pure function of the spans, so every rank and pipeline stage chooses
    alike.
    """
    if mode != "auto":
        return mode
    seqs = _sequences(spans)
    if any(prefix for *_, prefix in seqs):
        # A shared prefix's keys lie apart from the sequence's own in the row: the masked product's sums then
        # run over another layout than the engine's (a larger train-inference gap)
        return "grouped"
    lengths = [n for _, _, n, _, _ in seqs]
    if not lengths:
        return "masked"
    overhead = call_overhead_scores(device)
    grouped = grouped_attention_cost(lengths, overhead) + overhead
    return "grouped" if grouped < len(spans) * seq_length ** 2 else "masked"


class _Plan:
    """The attention calls of one forward: per call its [Lq, count] query positions and [Lk, count] key positions
    (flat: ``p * rows + r``), its mask (None when all its sequences have length L and no prefix: megatron-core's
    causal default) and which of its outputs are real; all calls' positions concatenated (``gather`` for
    queries, ``kv_gather`` for keys and values: one gather per tensor and layer, whose backward is one scatter,
    instead of one per call) and where the real outputs go (``scatter``). A sequence after a shared prefix has
    the prefix's positions before its own as keys; its query ``i`` sees keys ``<= prefix + i``. Built once per
    forward, shared by every layer."""

    def __init__(self, spans: Spans, grouping: str, device: torch.device):
        seqs = _sequences(spans)
        self.rows = len(spans)
        self.calls: list[tuple[tuple[int, int], tuple[int, int], torch.Tensor | None, torch.Tensor | None]] = []
        gather, kv_gather, dest = [], [], []
        calls = attention_groups([n for _, _, n, _, _ in seqs], grouping, call_overhead_scores(device),
                                 [prefix for *_, prefix in seqs])
        for group in calls:
            lens = torch.tensor([seqs[i][2] for i in group])
            starts = torch.tensor([seqs[i][1] for i in group])
            rows = torch.tensor([seqs[i][0] for i in group])
            prefix_starts = torch.tensor([seqs[i][3] for i in group])
            prefixes = torch.tensor([seqs[i][4] for i in group])
            pos = torch.arange(int(lens.max()))
            valid = pos[:, None] < lens[None, :]  # [Lq, count]
            # padding positions read the sequence's first token (finite): masked as keys, dropped as outputs
            index = torch.where(valid, starts[None, :] + pos[:, None], starts[None, :]) * self.rows + rows[None, :]
            flat = index.reshape(-1)
            gather.append(flat)
            dest.append(index[valid])
            keep = None if bool(valid.all()) else valid.reshape(-1).nonzero().squeeze(1)
            # Keys padded to MIN_KEY_SLOTS like the engine's (its softmax and product with V round differently below
            # 16 keys): grouped calls of short sequences and every call with a shared prefix. A call of exact mode
            # without prefixes stays the sequences' own product.
            short = grouping != "exact" and int((lens + prefixes).max()) < MIN_KEY_SLOTS
            if not bool(prefixes.any()) and not short:
                kv_gather.append(flat)
                mask = None
                if keep is not None:
                    allowed = (pos[None, :] <= pos[:, None])[None] & valid.t()[:, None, :]  # [count, Lq, Lk]
                    mask = ~allowed[:, None]
                self.calls.append((tuple(index.shape), tuple(index.shape), mask, keep))
                continue
            kpos = torch.arange(max(int((lens + prefixes).max()), MIN_KEY_SLOTS))
            in_prefix = kpos[:, None] < prefixes[None, :]  # [Lk, count]
            own = kpos[:, None] - prefixes[None, :]
            key_valid = kpos[:, None] < (prefixes + lens)[None, :]
            key_at = torch.where(in_prefix, prefix_starts[None, :] + kpos[:, None],
                                 torch.where(key_valid, starts[None, :] + own, starts[None, :]))
            key_index = key_at * self.rows + rows[None, :]
            kv_gather.append(key_index.reshape(-1))
            # query i of a sequence sees its prefix and its own keys up to i: key j <= prefix + i
            allowed = (key_valid.t()[:, None, :]
                       & (kpos[None, None, :] <= (pos[None, :, None] + prefixes[:, None, None])))  # [count, Lq, Lk]
            self.calls.append((tuple(index.shape), tuple(key_index.shape), ~allowed[:, None], keep))
        self.sizes = [a * b for (a, b), _, _, _ in self.calls]
        self.kv_sizes = [a * b for _, (a, b), _, _ in self.calls]
        # on the model's device once, not once per layer
        self.gather = torch.cat(gather).to(device) if gather else None
        self.kv_gather = None
        if kv_gather:
            shared = all(a is b for a, b in zip(gather, kv_gather))
            self.kv_gather = self.gather if shared else torch.cat(kv_gather).to(device)
        self.scatter = torch.cat(dest).to(device) if dest else None
        self.calls = [(q_shape, kv_shape, None if mask is None else mask.to(device),
                       None if keep is None else keep.to(device)) for q_shape, kv_shape, mask, keep in self.calls]


def _per_sequence(original, plan: _Plan):
    """A ``DotProductAttention.forward`` replacement: ``original`` once per call of ``plan``, over the call's
    sequences stacked as its batch (batch entries are independent products, so a sequence's result depends on
    its own queries and keys and the call's padded length only)."""

    def forward(query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        # query [S, rows, heads, dim]; key/value [S, rows, groups, dim]; output [S, rows, heads * dim]
        s_len, rows = query.shape[0], plan.rows
        if query.shape[1] != rows:
            raise ValueError(f"{rows} rows of sequence spans for attention over {query.shape[1]} rows")
        contexts = []
        if plan.calls:
            # index_select, not t[index]: its backward is an index_add, the latter's an accumulating index_put
            # (~10x slower on CPU)
            parts = [t.reshape(s_len * rows, *t.shape[2:]).index_select(0, index).split(sizes)
                     for t, index, sizes in ((query, plan.gather, plan.sizes), (key, plan.kv_gather, plan.kv_sizes),
                                             (value, plan.kv_gather, plan.kv_sizes))]
            for (q_shape, kv_shape, mask, keep), q, k, v in zip(plan.calls, *parts):
                q = q.view(*q_shape, *q.shape[1:])
                k, v = (t.view(*kv_shape, *t.shape[1:]) for t in (k, v))
                context = original(q, k, v, mask, attn_mask_type=attn_mask_type, attention_bias=attention_bias,
                                   packed_seq_params=packed_seq_params)
                context = context.reshape(-1, context.shape[-1])  # [L * count, heads * dim]
                contexts.append(context if keep is None else context.index_select(0, keep))
        width = query.shape[2] * value.shape[3]
        out = query.new_zeros((s_len * rows, contexts[0].shape[-1] if contexts else width))
        if contexts:  # padding keeps a zero output: nothing real attends to it and its loss mask is 0
            out = out.index_copy(0, plan.scatter, torch.cat(contexts))
        return out.reshape(s_len, rows, -1)

    return forward


@contextlib.contextmanager
def attention_per_sequence(model: torch.nn.Module, spans: Spans, grouping: str = "exact") -> Iterator[bool]:
    """While active, every local ``DotProductAttention`` in ``model`` attends within each span only (yields
    whether the model has any: other attention modules, TransformerEngine's, are left alone). The forward is
    replaced through the registered per-call patch
    (:func:`~megatron.rl.runtime.attention_override.attention_forward_per_call`).

    ``spans[r]``: (start, length) of the real sequences of row ``r``, contiguous from position 0; the positions
    after them are padding (zero attention output). Wrap one [rows, S] forward call.
    """
    plan: list[_Plan] = []  # built once, for the first module (none: nothing to plan)

    def per_sequence(original):
        if not plan:
            plan.append(_Plan(spans, grouping, next(model.parameters()).device))
        return _per_sequence(original, plan[0])

    with attention_forward_per_call(model, per_sequence) as modules:
        yield bool(modules)


def uses_recomputation(model: torch.nn.Module) -> bool:
    config = _transformer_config(model)
    return config is not None and getattr(config, "recompute_granularity", None) is not None


@contextlib.contextmanager
def isolate_sequences(model: torch.nn.Module, position_ids: torch.Tensor, spans: Spans,
                      attention: str = "exact") -> Iterator[bool]:
    """The hooks (the module doc) for one [rows, S] forward of packed rows: RoPE positions always; attention
    ``attention`` (:func:`choose_attention`: "masked", "exact", "grouped" or "auto"), where the per-sequence
    kinds fall back to the masked product under activation recomputation (the backward would re-run the
    attention without the hook). Yields whether the forward needs the block-diagonal attention mask (the
    masked product): the per-sequence attention ignores it."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(rope_at_positions(model, position_ids))
        kind = choose_attention(spans, position_ids.shape[-1], attention, position_ids.device)
        per_sequence = kind != "masked" and not uses_recomputation(model)
        hooked = per_sequence and stack.enter_context(attention_per_sequence(model, spans, kind))
        yield not hooked
