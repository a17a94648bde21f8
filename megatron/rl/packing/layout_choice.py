"""Which rows an optimizer step's rollouts are laid out in, resolved once from the flags into a
:class:`TrainingLayout`: ``--rl-layout``, ``--rl-packing-row-length``, ``--rl-use-sequence-packing``.

*padded*: one rollout per row of ``--seq-length``. *packed* (``auto``, the default): several rollouts per row,
rows of one group where prompt sharing applies, else ``--seq-length`` tokens; same loss and gradients as padded.
``--micro-batch-size x --seq-length`` stays each micro-batch's position budget in every layout.
Pure: plain values in, a frozen dataclass out; errors are :class:`ConfigError` naming the flag.

Why packed by default, and the row length: docs/packing.md.
"""
from __future__ import annotations

import dataclasses
import math

from megatron.rl.base.errors import ConfigError
from megatron.rl.packing.prefix_sharing import sharing_blocker

__all__ = ["LAYOUTS", "ROW_MULTIPLE", "TrainingLayout", "LayoutInputs", "choose_layout", "group_row_length",
           "parse_row_length"]

LAYOUTS = ("auto", "padded", "packed")
ROW_MULTIPLE = 32  # auto rows are rounded up to this many positions (and to the TP size with sequence parallelism)


@dataclasses.dataclass(frozen=True)
class TrainingLayout:
    """The resolved layout of a step's rows.

    packed: several rollouts per row (else one per row).
    row_length: positions per row (the packing's bin capacity; ``--seq-length`` for padded rows).
    microbatch_rows: rows per micro-batch.
    shares_prompts: a group's rollouts packed into a row compute their prompt once.
    reason: why this layout, for the start-up summary (names the flags that decided it).
    """

    packed: bool
    row_length: int
    microbatch_rows: int
    shares_prompts: bool
    reason: str

    def describe(self) -> str:
        """One line for the start-up summary: the layout, then why."""
        if not self.packed:
            what = f"padded, one rollout per row of {self.row_length} tokens, {self.microbatch_rows} per micro-batch"
        else:
            share = "a group's prompt computed once per row" if self.shares_prompts else "no prompt sharing"
            what = f"packed, rows of {self.row_length} tokens, {self.microbatch_rows} per micro-batch, {share}"
        return f"{what}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class LayoutInputs:
    """What the choice reads: the layout flags and the run's shape.

    layout, use_sequence_packing, row_length: ``--rl-layout``, ``--rl-use-sequence-packing``,
        ``--rl-packing-row-length`` (as typed: ``"auto"`` or a whole number).
    share_prompt_prefix: ``--rl-share-prompt-prefix``; use_thd: TransformerEngine's THD packing;
        pipeline_parallel: the pipeline size; length_multiple: positions a row must be a multiple of (the TP
        size with sequence parallelism, else 1).
    """

    layout: str
    use_sequence_packing: bool
    row_length: str
    seq_length: int
    micro_batch_size: int
    group_size: int
    max_new_tokens: int
    max_sequences_per_bin: int
    share_prompt_prefix: str = "auto"
    use_thd: bool = False
    pipeline_parallel: int = 1
    length_multiple: int = 1


def parse_row_length(text: str, seq_length: int, length_multiple: int = 1) -> int | None:
    """``--rl-packing-row-length``: None for ``auto``, else the whole number it names, checked: at least
    ``--seq-length`` (every rollout must fit a row) and a multiple of ``length_multiple``."""
    if str(text).strip().lower() == "auto":
        return None
    try:
        n = int(str(text).strip())
    except ValueError:
        raise ConfigError(f"--rl-packing-row-length={text}: must be auto or a whole number of tokens (at least "
                          f"--seq-length={seq_length}).") from None
    if n < seq_length:
        raise ConfigError(f"--rl-packing-row-length={n} is shorter than --seq-length={seq_length}: a rollout may "
                          f"take --seq-length tokens and must fit one row; pass at least {seq_length}, or auto.")
    if n % length_multiple:
        raise ConfigError(f"--rl-packing-row-length={n} must be a multiple of {length_multiple} (sequence "
                          f"parallelism splits each row over the tensor-parallel ranks); e.g. "
                          f"{-(-n // length_multiple) * length_multiple}.")
    return n


def group_row_length(seq_length: int, group_size: int, max_new_tokens: int, max_sequences_per_bin: int,
                     length_multiple: int = 1) -> int:
    """Positions of a row that holds one group with its prompt shared, for any prompt the engine admits.

    The first rollout is stored whole (prompt + completion <= ``seq_length``); each other rollout stores its
    completion and the prompt's last token (<= ``max_new_tokens + 1``; :mod:`megatron.rl.packing.prefix_sharing`).
    A group larger than ``max_sequences_per_bin`` is split anyway, so the row holds that many rollouts. Rounded up
    to :data:`ROW_MULTIPLE` and ``length_multiple``.
    """
    rollouts = max(1, min(group_size, max_sequences_per_bin))
    need = seq_length + (rollouts - 1) * (max_new_tokens + 1)
    multiple = math.lcm(ROW_MULTIPLE, max(1, length_multiple))
    return -(-need // multiple) * multiple


def _check_flags(x: LayoutInputs, explicit_row: int | None) -> None:
    if x.layout not in LAYOUTS:
        raise ConfigError(f"--rl-layout={x.layout}: must be one of {', '.join(LAYOUTS)}.")
    if x.layout == "padded" and x.use_sequence_packing:
        raise ConfigError("--rl-layout padded contradicts --rl-use-sequence-packing (packed rows): drop one of them.")
    if x.layout == "padded" and explicit_row is not None:
        raise ConfigError(f"--rl-packing-row-length={explicit_row} sets packed rows, but --rl-layout padded puts one "
                          f"rollout per --seq-length row: drop one of them.")


def choose_layout(x: LayoutInputs) -> TrainingLayout:
    """The layout the flags ask for (see the module docstring); ``reason`` says which flag or rule decided it."""
    explicit_row = parse_row_length(x.row_length, x.seq_length, x.length_multiple)
    _check_flags(x, explicit_row)
    budget = x.micro_batch_size * x.seq_length
    if x.layout == "padded":
        return TrainingLayout(False, x.seq_length, x.micro_batch_size, False, "--rl-layout padded")
    blocker = sharing_blocker(x.share_prompt_prefix, x.use_thd, x.pipeline_parallel)
    if x.use_sequence_packing:
        decided = "--rl-use-sequence-packing"
    else:
        decided = "--rl-layout packed" if x.layout == "packed" else "--rl-layout auto (the loss of padded rows in " \
                  "fewer positions; --rl-layout padded: one rollout per row)"
    if explicit_row is not None:
        row, why = explicit_row, f"rows of --rl-packing-row-length {explicit_row}"
    elif x.use_sequence_packing:
        row, why = x.seq_length, "rows of --seq-length (--rl-packing-row-length N for others)"
    elif blocker is not None:
        row, why = x.seq_length, f"rows of --seq-length, not of one group: {blocker}"
    else:
        group = group_row_length(x.seq_length, x.group_size, x.max_new_tokens, x.max_sequences_per_bin,
                                 x.length_multiple)
        row = min(group, max(budget, x.seq_length))
        why = (f"a row fits one group, --seq-length {x.seq_length} + {min(x.group_size, x.max_sequences_per_bin) - 1}"
               f" x (--rl-max-new-tokens {x.max_new_tokens} + 1) rounded up to {group}")
        if row < group:
            why += f", capped at --micro-batch-size x --seq-length = {row} (a group may span rows)"
    rows = max(1, budget // row)
    return TrainingLayout(True, row, rows, blocker is None, f"{decided}; {why}")
