"""Does a checkpoint's model fit this run? Its architecture flags and its padded vocabulary, checked on load.

A checkpoint stores the flags that shape its weights (``model_args``). :func:`check_model_args` compares them
with this run's and names the first flag that differs (with the value to pass); :func:`check_padded_vocab`
refuses a padded vocabulary of another size (it would load into a larger embedding and leave random rows in
every softmax) and names the ``--make-vocab-size-divisible-by`` that matches. Both raise
:class:`~megatron.rl.training.checkpoint.paths.CheckpointError` before any tensor is read.
"""
from __future__ import annotations

import logging
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from megatron.rl import parallel_utils
from megatron.rl.training.checkpoint.paths import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["check_model_args", "check_padded_vocab", "divisible_by_for_padded_vocab"]


# model_args keys checked by dedicated code below (not by plain equality): the padded vocab may legitimately
# come from different --make-vocab-size-divisible-by / TP combinations, "vocab_padding" only feeds messages,
# "flags" (the model flags, read by --use-checkpoint-args; see checkpoint/args.py) holds run lengths too, and
# "run_flags" (a trainer's generation and environment flags; checkpoint/run_flags.py) never shapes the weights.
_SPECIAL_ARGS = ("padded_vocab_size", "vocab_padding", "flags", "run_flags")


# Values derived from other flags when not given (--ffn-hidden-size from --hidden-size, ...): compared after the
# flags they derive from, so a --hidden-size change is reported as --hidden-size, not as ffn_hidden_size.
_DERIVED_ARGS = ("ffn_hidden_size", "kv_channels", "num_query_groups", "moe_ffn_hidden_size")


def check_model_args(saved: dict, current: dict, ckpt_path: Path) -> None:
    """Raise CheckpointError on the first architecture flag whose value differs (flags before the values derived
    from them); log flags only one side has.

    ``vocab_size`` None on either side means "the tokenizer's" (older checkpoints, runs without --vocab-size):
    not compared here; the padded vocab check covers the shapes."""
    keys = sorted((set(saved) & set(current)) - set(_SPECIAL_ARGS), key=lambda k: (k in _DERIVED_ARGS, k))
    for key in keys:
        if key == "vocab_size" and None in (saved[key], current[key]):
            continue
        if saved[key] != current[key]:
            flag, value = "--" + key.replace("_", "-"), saved[key]
            fix = f"{'add' if value else 'drop'} {flag}" if isinstance(value, bool) else f"pass {flag} {value}"
            raise CheckpointError(
                f"architecture mismatch loading {ckpt_path}: {key} is {value!r} in the checkpoint but "
                f"{current[key]!r} in this run: {fix} (the checkpoint's value), or load a matching checkpoint.")
    only_saved = sorted(set(saved) - set(current) - set(_SPECIAL_ARGS))
    only_current = sorted(set(current) - set(saved) - set(_SPECIAL_ARGS))
    if (only_saved or only_current) and parallel_utils.is_rank0():
        logger.warning("model_args not compared (present on one side only): checkpoint-only %s, run-only %s",
                       only_saved, only_current)


def divisible_by_for_padded_vocab(vocab_size: int, padded: int, tp: int) -> int | None:
    """A ``--make-vocab-size-divisible-by`` value that pads ``vocab_size`` to exactly ``padded`` at TP ``tp``
    (Megatron's rule: round up to a multiple of divisible_by x tp), preferring the largest power of two;
    None when no value can (``padded`` not a multiple of ``tp``, or smaller than the vocab). Pure."""
    if padded < vocab_size or padded % tp:
        return None
    fits = [d for d in range(1, padded // tp + 1)
            if (padded // tp) % d == 0 and -(-vocab_size // (d * tp)) * d * tp == padded]
    if not fits:
        return None
    pow2 = [d for d in fits if d & (d - 1) == 0]
    return max(pow2) if pow2 else max(fits)


def _saved_padded_vocab(ckpt: Path, saved_args: dict) -> int | None:
    """The checkpoint's padded vocab: from its model_args, else from the embedding/output tensor metadata
    (checkpoints written before the key existed, or by other tools). Reads no tensor data."""
    if "padded_vocab_size" in saved_args:
        return int(saved_args["padded_vocab_size"])
    from megatron.core import dist_checkpointing  # heavy: megatron-core

    try:
        meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    except (Exception, CheckpointException):  # DCP's per-rank failures derive from BaseException
        return None
    for key in ("embedding.word_embeddings.weight", "output_layer.weight"):
        if key in meta:
            return int(meta[key].global_shape[0])
    return None


def check_padded_vocab(ckpt: Path, saved_args: dict, current: dict, layout: dict) -> None:
    """CheckpointError when the checkpoint's padded vocab differs from this run's (``current["padded_vocab_size"]``).

    A smaller saved embedding would otherwise load into a larger one and leave random rows in every softmax.
    ``current["vocab_padding"]`` ({"vocab_size", "make_vocab_size_divisible_by", "tensor_model_parallel_size"})
    makes the message name the --make-vocab-size-divisible-by value that matches.
    """
    want = current.get("padded_vocab_size")
    if want is None:
        return
    have = _saved_padded_vocab(ckpt, saved_args)
    if have is None or have == int(want):
        return
    saved_tp = (saved_args.get("vocab_padding") or {}).get("tensor_model_parallel_size") or layout.get("tp")
    msg = (f"vocabulary mismatch loading {ckpt}: the checkpoint was saved with padded vocab {have}"
           f"{f' (TP={saved_tp})' if saved_tp else ''}; this run pads to {want}")
    pad = current.get("vocab_padding") or {}
    vocab, tp = pad.get("vocab_size"), pad.get("tensor_model_parallel_size")
    div = pad.get("make_vocab_size_divisible_by")
    saved_vocab = (saved_args.get("vocab_padding") or {}).get("vocab_size")
    if vocab is not None and tp is not None:
        msg += f" ({vocab} tokens, --make-vocab-size-divisible-by {div} x TP={tp})"
        fix = divisible_by_for_padded_vocab(vocab, have, tp)
        if saved_vocab is not None and saved_vocab != vocab:
            msg += f". The checkpoint's tokenizer had {saved_vocab} tokens: use the tokenizer it was trained with"
        elif fix is not None:
            msg += f": pass --make-vocab-size-divisible-by {fix} to pad to {have} at TP={tp}"
        else:
            msg += (f"; no --make-vocab-size-divisible-by gives {have} at TP={tp}: use a TP that divides {have} "
                    f"(e.g. the saving run's)")
    raise CheckpointError(msg + ". Loading anyway would leave randomly initialised vocabulary rows.")
