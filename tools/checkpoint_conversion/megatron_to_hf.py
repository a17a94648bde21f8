"""Megatron (torch_dist) -> Hugging Face conversion: ``config.json`` + safetensors (+ tokenizer files).

Takes release and training (``iter_*``, any TP/PP) checkpoints. The model flags, the Hugging Face config and the
tokenizer are looked up next to the checkpoint unless passed (``--megatron-args``, ``--hf-config``,
``--tokenizer-dir``); ``generation_config.json`` is always written. With the original config, HF -> Megatron ->
HF returns the same tensors bit for bit; a synthesised config keeps Megatron's padded vocabulary, so log-probs
stay the trainer's.

Lookup rules: docs/checkpoint_conversion.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path

import torch

from tools.checkpoint_conversion.families import (ConversionError, config_dtype, family_by_name, family_for_config,
                                                  family_for_megatron)
from tools.checkpoint_conversion.generation_config import write_generation_config
from tools.checkpoint_conversion.hf_io import copy_tokenizer, read_hf_config, tokenizer_files, write_safetensors
from tools.checkpoint_conversion.hf_to_megatron import (ARGS_TXT, HF_CONFIG_DIR, TOKENIZER_DIR, build_tp1_model,
                                                        parse_megatron_flags, torch_dtype)
from tools.checkpoint_conversion.mapping import megatron_to_hf

log = logging.getLogger(__name__)


def read_flags_file(path: str | os.PathLike) -> list[str]:
    """Flags from a ``megatron_args.txt``-style file: ``#`` comments, flags split like a shell would."""
    text = Path(path).read_text()
    return shlex.split(" ".join(line for line in text.splitlines() if not line.lstrip().startswith("#")))


def _search_dirs(load: Path, ckpt: Path) -> list[Path]:
    out = [load, ckpt, ckpt.parent]
    return list(dict.fromkeys(p.resolve() for p in out))


def _find(dirs: list[Path], name: str) -> Path | None:
    for d in dirs:
        if (d / name).exists():
            return d / name
    return None


def _checkpoint_vocab_rows(ckpt: Path) -> int:
    """Padded vocab of a torch_dist checkpoint: the global row count of its word embeddings."""
    from megatron.core import dist_checkpointing

    meta = dist_checkpointing.load_tensors_metadata(str(ckpt))
    for key, value in meta.items():
        if key.endswith("embedding.word_embeddings.weight"):
            return int(value.local_shape[0] if hasattr(value, "local_shape") else value.shape[0])
    raise ConversionError(f"{ckpt} has no embedding.word_embeddings.weight; is it a GPT checkpoint?")


def _rope_scaling_factor(cfg) -> float | None:
    """--rope-scaling-factor when --use-rope-scaling is on, else None."""
    return float(cfg.model.rope_scaling_factor) if cfg.model.use_rope_scaling else None


def _check_config_matches(hf_cfg: dict, flags: list[str], model_args: dict, source: str) -> None:
    family = family_for_config(hf_cfg)
    family.check(hf_cfg)
    from_hf = parse_megatron_flags(family.megatron_flags(hf_cfg)).model_args()
    diff = {k: (from_hf[k], model_args.get(k)) for k in from_hf if from_hf[k] != model_args.get(k)}
    if diff:
        raise ConversionError(f"the Hugging Face config {source} does not describe the Megatron model: "
                              + ", ".join(f"{k}: config {a!r} vs model {b!r}" for k, (a, b) in sorted(diff.items())))


def _is_byte_level(cfg) -> bool:
    """The model was trained with our byte-level tokenizer (its vocabulary, not another one under the default
    --tokenizer-type, e.g. a converted Hugging Face model whose tokenizer files were missing)."""
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    return cfg.tokenizer.tokenizer_type == "ByteLevelTokenizer" and \
        cfg.tokenizer.vocab_size in (None, ByteLevelTokenizer().vocab_size)


def _special_token_ids(cfg) -> dict[str, int | None]:
    """eos/pad ids (and bos: none) of our byte-level tokenizer, matching the tokenizer files written with it, so
    Hugging Face ``generate`` stops where our engine does; a Hugging Face tokenizer's own config already says them."""
    if not _is_byte_level(cfg):
        return {}
    from tools.checkpoint_conversion.byte_tokenizer import special_token_ids

    return special_token_ids()


def _tokenizer_source(cfg, dirs: list[Path], tokenizer_dir) -> Path | str | None:
    """Where the converted model's tokenizer comes from: --tokenizer-dir, else the Hugging Face tokenizer the model
    was trained with (its --tokenizer-model, else tokenizer/ next to the checkpoint), else ``"byte-level"`` for a
    model trained with our byte-level tokenizer; None when there is none (a warning says so)."""
    if tokenizer_dir:
        if not tokenizer_files(tokenizer_dir):
            raise ConversionError(f"--tokenizer-dir={tokenizer_dir}: no tokenizer files there (tokenizer.json, "
                                  f"tokenizer_config.json, vocab/merges or *.model)")
        return Path(tokenizer_dir)
    kind, model = cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model
    trained_with = Path(model) if kind == "HuggingFaceTokenizer" and model else None
    for src in (trained_with, _find(dirs, TOKENIZER_DIR)):
        if src is not None and tokenizer_files(src):
            return src
    if _is_byte_level(cfg):
        return "byte-level"
    gone = f" (its --tokenizer-model {trained_with} holds no tokenizer files)" if trained_with else ""
    log.warning("the converted model will carry no tokenizer: none found for --tokenizer-type %s%s; pass "
                "--tokenizer-dir DIR with the tokenizer files the model was trained with", kind, gone)
    return None


def _write_tokenizer(source: Path | str | None, save: Path, max_length: int | None) -> str:
    """Put the tokenizer of :func:`_tokenizer_source` into ``save``; returns what was written, for the log."""
    if source is None:
        return "no tokenizer"
    if source == "byte-level":
        from tools.checkpoint_conversion.byte_tokenizer import write_byte_level_tokenizer

        write_byte_level_tokenizer(save, max_length)
        return "the byte-level tokenizer (no BOS added, as in training)"
    copy_tokenizer(source, save)
    return f"the tokenizer of {source}"


def _flags_of(ckpt: Path, dirs: list[Path]) -> list[str]:
    """The model flags stored in the checkpoint itself, else those of a ``megatron_args.txt`` next to it."""
    from megatron.rl.training.checkpoint.args import flags_to_argv, read_checkpoint_flags
    from megatron.rl.training.config import build_parser

    from megatron.rl.training.checkpoint.paths import CheckpointError

    try:
        stored, why = read_checkpoint_flags(ckpt), "saved before checkpoints carried them"
    except CheckpointError as e:
        stored, why = None, str(e)
    if stored is not None:
        return flags_to_argv(stored, build_parser())
    args_file = _find(dirs, ARGS_TXT)
    if args_file is None:
        raise ConversionError(f"{ckpt} stores no model flags ({why}) and has no {ARGS_TXT} next to it: pass the "
                              f"model flags with --megatron-args FILE (e.g. the converted checkpoint's {ARGS_TXT}) "
                              f"or after '--'")
    return read_flags_file(args_file)


def _run_flags_of(ckpt: Path) -> dict | None:
    """The run flags a training checkpoint records (its environment config, for the stop strings), or None."""
    from megatron.rl.training.checkpoint.args import read_model_args
    from megatron.rl.training.checkpoint.paths import CheckpointError
    from megatron.rl.training.checkpoint.run_flags import RUN_FLAGS_KEY

    try:
        return read_model_args(ckpt).get(RUN_FLAGS_KEY)
    except CheckpointError:
        return None


def convert_megatron_to_hf(load: str | os.PathLike, save: str | os.PathLike, megatron_args: list[str] | None = None,
                           hf_config_dir: str | os.PathLike | None = None,
                           tokenizer_dir: str | os.PathLike | None = None,
                           dtype: str | None = None, model_type: str | None = None, newest: bool = False) -> Path:
    """Write the Hugging Face form of the Megatron checkpoint ``load`` into ``save``; returns ``save``.

    ``megatron_args``: the model flags (default: those stored in the checkpoint, else ``megatron_args.txt``
    next to it).
    Raises ConversionError when the checkpoint, its flags or a config that matches them cannot be found.
    """
    t0 = time.perf_counter()
    from megatron.rl.training.checkpoint.paths import CheckpointError, resolve_checkpoint_dir

    load = Path(load)
    if not load.exists():
        raise ConversionError(f"--load={load}: no such directory")
    try:
        ckpt = resolve_checkpoint_dir(load, newest)
    except CheckpointError as e:
        raise ConversionError(f"--load={load}: {e}") from e
    dirs = _search_dirs(load, ckpt)
    if megatron_args is None:
        megatron_args = _flags_of(ckpt, dirs)
    cfg = parse_megatron_flags(list(megatron_args))
    model_args = cfg.model_args()
    tokenizer = _tokenizer_source(cfg, dirs, tokenizer_dir)
    rows = _checkpoint_vocab_rows(ckpt)

    hf_cfg_path = Path(hf_config_dir) / "config.json" if hf_config_dir else _find(dirs, f"{HF_CONFIG_DIR}/config.json")
    if hf_cfg_path is not None:
        hf_cfg = read_hf_config(hf_cfg_path.parent, flag="--hf-config")
        _check_config_matches(hf_cfg, list(megatron_args), model_args, str(hf_cfg_path))
        family = family_for_config(hf_cfg)
    else:
        family = family_by_name(model_type) if model_type else family_for_megatron(cfg.model)
        # A model born in Megatron keeps its padded vocabulary rows: the trainer's and the engine's softmax run
        # over them, so dropping them would renormalise every log-prob (by the mass they hold).
        hf_cfg = family.hf_config(cfg.model, rows, dtype or "float32", _rope_scaling_factor(cfg))
        hf_cfg.update(_special_token_ids(cfg))
        _check_config_matches(hf_cfg, list(megatron_args), {**model_args, "vocab_size": rows},
                              f"synthesised for {family.name}")
        log.warning("no Hugging Face config found next to %s; writing a minimal %s config (vocabulary of %d rows: "
                    "Megatron's padded vocabulary, as the model was trained)", ckpt, family.name, rows)
    out_dtype = torch_dtype(dtype or config_dtype(hf_cfg) or "float32")
    spec = family.arch_spec(hf_cfg)

    _, model = build_tp1_model(list(megatron_args), rows, out_dtype)
    from megatron.rl.training.checkpoint.save_load import load_checkpoint

    try:
        load_checkpoint(ckpt, [model], load_optimizer=False, load_rng=False, model_args=model_args)
    except CheckpointError as e:
        raise ConversionError(f"cannot load {ckpt} with the given model flags: {e}") from e
    state = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
    tensors = {k: v.to(out_dtype) for k, v in megatron_to_hf(state, spec).items()}

    save = Path(save)
    save.mkdir(parents=True, exist_ok=True)
    write_safetensors(save, tensors)
    if hf_cfg_path is not None:
        shutil.copy2(hf_cfg_path, save / "config.json")
    else:
        (save / "config.json").write_text(json.dumps(hf_cfg, indent=2, sort_keys=True) + "\n")
    original_gen = hf_cfg_path.parent / "generation_config.json" if hf_cfg_path is not None else None
    stops = write_generation_config(save, hf_cfg, original_gen, cfg, _run_flags_of(ckpt))
    written = _write_tokenizer(tokenizer, save, hf_cfg.get("max_position_embeddings"))
    log.info("wrote Hugging Face %s model (%d tensors, %s) with %s to %s in %.1f s; generation_config.json: %s",
             family.name, len(tensors), out_dtype, written, save, time.perf_counter() - t0, stops)
    return save


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Convert a Megatron torch_dist checkpoint (release or iter_*) to a Hugging Face directory. "
                    "Model flags may follow '--'.", allow_abbrev=False)
    p.add_argument("--load", required=True, help="checkpoint save dir (tracker) or a checkpoint directory")
    p.add_argument("--save", required=True, help="output Hugging Face directory")
    p.add_argument("--load-newest-checkpoint", action="store_true",
                   help="when the tracker names an older iteration than complete checkpoints present, convert the "
                        "newest of them (with a warning) instead of refusing")
    p.add_argument("--megatron-args", help=f"file with the model flags (default: the flags stored in the checkpoint, "
                                           f"else {ARGS_TXT} next to it)")
    p.add_argument("--hf-config", help=f"directory with the original config.json (default: {HF_CONFIG_DIR}/ next "
                                       f"to the checkpoint)")
    p.add_argument("--tokenizer-dir",
                   help=f"tokenizer files to copy (default: the model's --tokenizer-model, else {TOKENIZER_DIR}/ next to "
                        f"the checkpoint; byte-level models get the byte-level tokenizer)")
    p.add_argument("--dtype", help="output dtype (default: the config's)")
    p.add_argument("--model-type", help="family when no config.json is available: llama, qwen2 or qwen3")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = None
    if "--" in argv:
        i = argv.index("--")
        argv, flags = argv[:i], argv[i + 1:]
    args = build_arg_parser().parse_args(argv)
    os.environ.setdefault("MEGATRON_RL_FORCE_CPU", "1")
    from megatron.rl.logging import setup_distributed_logging

    setup_distributed_logging("INFO")
    try:
        if args.megatron_args:
            if not Path(args.megatron_args).is_file():
                raise ConversionError(f"--megatron-args={args.megatron_args}: no such file")
            flags = read_flags_file(args.megatron_args)
        convert_megatron_to_hf(args.load, args.save, flags, args.hf_config, args.tokenizer_dir, args.dtype,
                               args.model_type, args.load_newest_checkpoint)
    except ConversionError as e:
        log.error("%s", e)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
