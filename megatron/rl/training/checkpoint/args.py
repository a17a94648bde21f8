"""The model flags a checkpoint carries, and ``--use-checkpoint-args`` (Megatron-LM's flag) to reuse them.

:func:`checkpoint_flags` records every flag that defines the model (architecture, position embedding,
vocabulary, sequence lengths) as ``model_args["flags"]``; :func:`read_checkpoint_flags` reads them back from
``--load`` or ``--pretrained-checkpoint`` and fills what the command line does not give. An explicit flag that
differs is a :class:`~megatron.rl.base.errors.ConfigError` when it shapes the weights, a warning for
:data:`OVERRIDABLE`. Run flags: :mod:`~megatron.rl.training.checkpoint.run_flags`.

Details: docs/training.md.
"""
from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any, Sequence

from megatron.rl.base.errors import ConfigError
from megatron.rl.base.flags import add_flags
from megatron.rl.training.checkpoint.paths import CheckpointError, latest_checkpoint, resolve_checkpoint_dir
from megatron.rl.training.checkpoint.run_flags import RUN_FLAGS_KEY, run_flags_argv
from megatron.rl.training.config_sections import CheckpointConfig

log = logging.getLogger(__name__)

__all__ = ["MODEL_FLAGS", "OVERRIDABLE", "checkpoint_flags", "read_checkpoint_flags", "read_model_args",
           "merge_checkpoint_args", "flags_to_argv", "has_model_flags"]

FLAG = "--use-checkpoint-args"
FLAGS_KEY = "flags"  # the key under the checkpoint's model_args

# argparse destinations of the model-defining flags (ModelConfig / TokenizerConfig fields)
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
               "num_query_groups", "kv_channels", "seq_length", "max_position_embeddings", "swiglu",
               "normalization", "norm_epsilon", "position_embedding_type", "rotary_base", "rotary_percent",
               "use_rope_scaling", "rope_scaling_factor", "untie_embeddings_and_output_weights", "add_qkv_bias",
               "disable_bias_linear", "qk_layernorm", "make_vocab_size_divisible_by", "num_experts",
               "moe_router_topk", "moe_ffn_hidden_size", "moe_router_load_balancing_type", "tokenizer_type",
               "tokenizer_model", "vocab_size")
OVERRIDABLE = ("seq_length", "tokenizer_model", "make_vocab_size_divisible_by")
_REQUIRED = ("--num-layers", "--hidden-size", "--num-attention-heads")


def checkpoint_flags(cfg: Any, vocab_size: int | None) -> dict[str, Any]:
    """The model-defining flags of ``cfg`` (a parsed TrainingConfig) as stored in checkpoints.

    ``vocab_size``: the unpadded vocabulary the model was built for (the tokenizer's unless --vocab-size).
    A ``--tokenizer-model`` path is stored absolute, so it resolves from any working directory.
    """
    out: dict[str, Any] = {}
    for key in MODEL_FLAGS:
        section = cfg.tokenizer if hasattr(cfg.tokenizer, key) else cfg.model
        out[key] = getattr(section, key)
    if out["tokenizer_model"] is not None and os.path.exists(out["tokenizer_model"]):
        out["tokenizer_model"] = os.path.abspath(out["tokenizer_model"])
    out["vocab_size"] = vocab_size if vocab_size is not None else out["vocab_size"]
    return out


def read_model_args(load_dir: str | os.PathLike, newest: bool = False) -> dict[str, Any]:
    """The ``model_args`` of the checkpoint ``load_dir`` resolves to (see ``--load``; {} when it has none;
    ``newest``: ``--load-newest-checkpoint``). Reads the common state only (no tensors, no process group). Raises
    CheckpointError for a missing or unreadable checkpoint."""
    from megatron.core import dist_checkpointing

    ckpt = resolve_checkpoint_dir(load_dir, newest)
    try:
        common = dist_checkpointing.load_common_state_dict(str(ckpt))
    except Exception as e:  # noqa: BLE001 - any failure means the common state cannot be read
        raise CheckpointError(f"cannot read the common state of checkpoint {ckpt}: {type(e).__name__}: {e}") from e
    return dict(common.get("model_args") or {})


def read_checkpoint_flags(load_dir: str | os.PathLike, newest: bool = False) -> dict[str, Any] | None:
    """The stored model flags of the checkpoint ``load_dir`` resolves to, or None when it predates them."""
    flags = read_model_args(load_dir, newest).get(FLAGS_KEY)
    return dict(flags) if flags else None


def has_model_flags(argv: Sequence[str]) -> bool:
    """Whether ``argv`` gives any of the flags every model needs (--num-layers, --hidden-size, ...)."""
    return any(a.split("=", 1)[0] in _REQUIRED for a in argv)


def _actions_by_dest(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings}  # noqa: SLF001 - argparse has no public API


def _explicit_dests(argv: Sequence[str], parser: argparse.ArgumentParser) -> set[str]:
    by_option = {s: a.dest for a in parser._actions for s in a.option_strings}  # noqa: SLF001
    return {by_option[a.split("=", 1)[0]] for a in argv if a.split("=", 1)[0] in by_option}


def _flag_groups(flags: dict[str, Any], parser: argparse.ArgumentParser, skip: set[str]) -> list[list[str]]:
    actions = _actions_by_dest(parser)
    out: list[list[str]] = []
    for dest, value in flags.items():
        if dest in skip or value is None or dest not in actions:
            continue
        action = actions[dest]
        option = action.option_strings[0]
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value:
                out.append([option])
        else:
            out.append([option, str(value)])
    return out


def flags_to_argv(flags: dict[str, Any], parser: argparse.ArgumentParser, skip: set[str] = frozenset()) -> list[str]:
    """Command-line flags reproducing ``flags`` (destination -> value) for ``parser``; None values are left out."""
    return [token for group in _flag_groups(flags, parser, skip) for token in group]


def _load_source(argv: Sequence[str]) -> tuple[str, str, bool]:
    """(flag, path) of the checkpoint to read: --load when it holds one, else --pretrained-checkpoint; and
    whether --load-newest-checkpoint was given."""
    # Only the checkpoint flags: the model flags (some required) may be the very ones to come from it.
    p = add_flags(argparse.ArgumentParser(add_help=False, allow_abbrev=False), CheckpointConfig)
    ns, _ = p.parse_known_args(list(argv))
    if ns.load and Path(ns.load).is_dir() and latest_checkpoint(ns.load, ns.load_newest_checkpoint) is not None:
        return "--load", ns.load, ns.load_newest_checkpoint
    if ns.pretrained_checkpoint:
        return "--pretrained-checkpoint", ns.pretrained_checkpoint, ns.load_newest_checkpoint
    if ns.load:
        return "--load", ns.load, ns.load_newest_checkpoint
    raise ConfigError(f"{FLAG} reads the model flags from a checkpoint: pass --load DIR or "
                      f"--pretrained-checkpoint DIR.")


def merge_checkpoint_args(argv: Sequence[str], parser: argparse.ArgumentParser
                          ) -> tuple[list[str], dict, set, list[str]]:
    """``argv`` with the checkpoint's model and run flags added where ``argv`` gives none.

    Returns (new argv, the stored model flags, the destinations ``argv`` gave explicitly, the flags added as
    ``"--option value"`` strings); the middle two are for :func:`check_explicit_flags`. Raises ConfigError when
    there is no checkpoint or it stores no flags.
    """
    flag, path, newest = _load_source(argv)
    try:
        model_args = read_model_args(path, newest)
    except CheckpointError as e:
        raise ConfigError(f"{FLAG}: cannot read the model flags from {flag}={path}: {e}") from e
    stored = dict(model_args.get(FLAGS_KEY) or {})
    if not stored:
        raise ConfigError(f"{FLAG}: the checkpoint in {flag}={path} stores no model flags (it was saved before "
                          f"checkpoints carried them); drop {FLAG} and pass the model flags (--num-layers, "
                          f"--hidden-size, ... as in the run that saved it).")
    explicit = _explicit_dests(argv, parser)
    groups = _flag_groups(stored, parser, explicit)
    groups += run_flags_argv(model_args.get(RUN_FLAGS_KEY), parser, explicit, f"{flag}={path}")
    log.debug("%s: flags from %s: %s", FLAG, path, " ".join(" ".join(g) for g in groups))
    return [token for g in groups for token in g] + list(argv), stored, explicit, [" ".join(g) for g in groups]


def check_explicit_flags(ns: argparse.Namespace, stored: dict, explicit: set[str],
                         parser: argparse.ArgumentParser) -> None:
    """ConfigError for an explicit flag that contradicts the checkpoint's value (warning when overridable)."""
    actions = _actions_by_dest(parser)
    rope = stored.get("position_embedding_type") != "learned_absolute"
    for dest in sorted(explicit & set(stored)):
        given, saved = getattr(ns, dest, None), stored[dest]
        if given == saved or dest not in actions:
            continue
        option = actions[dest].option_strings[0]
        if dest in OVERRIDABLE or (dest == "max_position_embeddings" and rope):
            log.warning("%s: %s=%s overrides the checkpoint's %s", FLAG, option, given, saved)
            continue
        raise ConfigError(f"{FLAG}: {option}={given} contradicts the checkpoint, which was saved with {option}="
                          f"{saved}; drop {option} (the checkpoint's value is used) or drop {FLAG}.")
