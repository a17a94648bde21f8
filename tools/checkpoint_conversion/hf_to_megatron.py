"""Hugging Face -> Megatron (torch_dist, model-only "release" form) conversion.

The model is built in one process at TP=1/PP=1 and saved as global tensors, which reshard on load to any TP/PP.
The target layout given here fixes what cannot be resharded (the vocabulary padding) and is validated before
anything is written. Output: the tracker, ``release/``, ``megatron_args.txt`` (flags to train with),
``tokenizer/``, ``hf_config/config.json`` (to convert back) and ``conversion.json`` (provenance).

Output layout: docs/checkpoint_conversion.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import shutil
import sys
import time
from pathlib import Path
from typing import Iterable

import torch

from tools.checkpoint_conversion.families import ArchSpec, ConversionError, Family, config_dtype, family_for_config
from tools.checkpoint_conversion.hf_io import HFTensorReader, copy_tokenizer, read_hf_config
from tools.checkpoint_conversion.mapping import hf_tensor_names, iter_hf_to_megatron

log = logging.getLogger(__name__)

TP_FLAG = "--target-tensor-parallel-size"
PP_FLAG = "--target-pipeline-parallel-size"
ARGS_TXT = "megatron_args.txt"
ARGS_SH = "megatron_args.sh"
HF_CONFIG_DIR = "hf_config"
TOKENIZER_DIR = "tokenizer"
PROVENANCE = "conversion.json"
_DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
           "float16": torch.float16, "fp16": torch.float16}


@dataclasses.dataclass
class ConversionPlan:
    """Everything decided (and validated) before anything is written."""

    hf_dir: Path
    hf_config: dict
    family: Family
    flags: list[str]                 # Megatron architecture flags (what training must pass)
    spec: ArchSpec
    padded_vocab: int
    target_tp: int
    target_pp: int
    dtype: torch.dtype
    compatible_tp: list[int]         # TP sizes at which this checkpoint's padded vocab is what Megatron computes


def torch_dtype(name: str | None, default: torch.dtype = torch.float32) -> torch.dtype:
    if name is None:
        return default
    if name not in _DTYPES:
        raise ConversionError(f"--dtype={name}: unknown dtype; use one of {sorted(_DTYPES)}")
    return _DTYPES[name]


def parse_megatron_flags(flags: list[str], tp: int = 1, pp: int = 1, extra: list[str] = ()):
    """Our training parser on ``flags`` for a world of ``tp*pp`` ranks."""
    from megatron.rl.training.config import parse_args

    argv = [*flags, "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp), *extra]
    return parse_args(argv, world_size=tp * pp)


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    from megatron.rl.training.tokenizer import padded_vocab_size

    return padded_vocab_size(vocab, divisible_by, tp)


def layout_problems(spec: ArchSpec, tp: int, pp: int, padded: int) -> list[str]:
    """Why ``spec`` cannot be laid out at TP=tp / PP=pp (empty list: it can). Pure."""
    out = []
    for what, n in (("attention heads", spec.num_heads), ("query groups (KV heads)", spec.num_groups),
                    ("FFN size", spec.ffn_hidden_size), ("padded vocabulary", padded)):
        if n % tp:
            out.append(f"{TP_FLAG}={tp} does not divide the {n} {what}")
    if spec.num_layers % pp:
        out.append(f"{PP_FLAG}={pp} does not divide the {spec.num_layers} layers")
    return out


def compatible_tp_sizes(spec: ArchSpec, vocab_divisible_by: int, padded: int, limit: int = 64) -> list[int]:
    """Powers of two TP at which Megatron computes the same padded vocab and the shapes divide."""
    out, tp = [], 1
    while tp <= limit:
        if not layout_problems(spec, tp, 1, padded) and padded_vocab(spec.vocab_size, vocab_divisible_by, tp) == padded:
            out.append(tp)
        tp *= 2
    return out


def plan_conversion(hf_dir: str | os.PathLike, target_tp: int = 1, target_pp: int = 1, dtype: str | None = None,
                    make_vocab_size_divisible_by: int = 128) -> ConversionPlan:
    """Read and validate the Hugging Face model and the target layout. Writes nothing.

    Raises ConversionError (missing/invalid directory, bad layout: names the flag) or its subclass
    UnsupportedModelError (unsupported model_type or feature: names it).
    """
    for flag, v in ((TP_FLAG, target_tp), (PP_FLAG, target_pp),
                    ("--make-vocab-size-divisible-by", make_vocab_size_divisible_by)):
        if not isinstance(v, int) or v < 1:
            raise ConversionError(f"{flag}={v}: must be a positive integer")
    cfg = read_hf_config(hf_dir)
    family = family_for_config(cfg)
    family.check(cfg)
    spec = family.arch_spec(cfg)
    padded = padded_vocab(spec.vocab_size, make_vocab_size_divisible_by, target_tp)
    problems = layout_problems(spec, target_tp, target_pp, padded)
    if problems:
        raise ConversionError("target layout refused: " + "; ".join(problems) + ". Choose sizes that divide them.")
    flags = family.megatron_flags(cfg, make_vocab_size_divisible_by)
    from megatron.rl.training.config import ConfigError

    # megatron-core runs MoE with TP > 1 only with sequence parallelism
    runtime = ["--sequence-parallel"] if spec.num_experts and target_tp > 1 else []
    try:  # Megatron's own validation of the flags at the target layout
        parse_megatron_flags(flags, target_tp, target_pp, extra=runtime)
    except ConfigError as e:
        raise ConversionError(f"the Megatron flags for this model are refused at {TP_FLAG}={target_tp} "
                              f"{PP_FLAG}={target_pp}: {e}") from e
    chosen = torch_dtype(dtype or config_dtype(cfg) or "float32")
    return ConversionPlan(hf_dir=Path(hf_dir), hf_config=cfg, family=family, flags=flags, spec=spec,
                          padded_vocab=padded, target_tp=target_tp, target_pp=target_pp, dtype=chosen,
                          compatible_tp=compatible_tp_sizes(spec, make_vocab_size_divisible_by, padded))


def build_tp1_model(flags: list[str], padded: int, dtype: torch.dtype):
    """This process's TP=1/PP=1 ``GPTModel`` for ``flags`` (uninitialised weights, local spec, CPU)."""
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, unwrap_model

    cfg = parse_megatron_flags(flags, 1, 1, extra=["--transformer-impl", "local"])
    initialize_megatron(cfg)
    chunks = build_model(cfg, wrap_with_ddp=False, vocab_size=padded, perform_initialization=False,
                         params_dtype=dtype)
    return cfg, unwrap_model(chunks)[0]


def fill_model(model: torch.nn.Module, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy ``(name, tensor)`` pairs into ``model``'s parameters/buffers by state-dict name, one at a time.

    Every tensor of the model (except ``_extra_state``) must be given exactly once, with its shape.
    """
    targets = {k: v for k, v in model.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    seen: set[str] = set()
    with torch.no_grad():
        for name, src in tensors:
            if name not in targets or name in seen:
                raise ConversionError(f"state-dict mismatch between the mapping and the Megatron model: "
                                      f"{name!r} is {'given twice' if name in seen else 'not in the model'}")
            dst = targets[name]
            if tuple(dst.shape) != tuple(src.shape):
                raise ConversionError(f"{name}: Megatron expects shape {tuple(dst.shape)}, the Hugging Face "
                                      f"weights give {tuple(src.shape)}")
            dst.copy_(src)
            seen.add(name)
    missing = sorted(k for k in set(targets) - seen if not k.endswith("._extra_state"))
    if missing:
        raise ConversionError(f"the mapping left {len(missing)} Megatron tensor(s) unset, e.g. {missing[:5]}")


def _flags_text(flags: list[str]) -> str:
    out, line = [], []
    for tok in flags:  # one flag (with its value) per line
        if tok.startswith("--") and line:
            out.append(" ".join(line))
            line = []
        line.append(shlex.quote(tok))
    out.append(" ".join(line))
    return "\n".join(out)


def tokenizer_settings(hf_dir: Path, save: Path) -> dict[str, str | None]:
    """``tokenizer_type`` / ``tokenizer_model`` of a model converted from ``hf_dir``: ``ByteLevelTokenizer`` when its
    tokenizer is our byte-level one (written by Megatron -> HF), else the Hugging Face tokenizer copied to
    ``save/tokenizer``; empty when ``hf_dir`` has no tokenizer files."""
    from tools.checkpoint_conversion.byte_tokenizer import is_byte_level_tokenizer
    from tools.checkpoint_conversion.hf_io import tokenizer_files

    if is_byte_level_tokenizer(hf_dir):
        return {"tokenizer_type": "ByteLevelTokenizer", "tokenizer_model": None}
    if tokenizer_files(hf_dir):
        return {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": str((save / TOKENIZER_DIR).resolve())}
    return {}


def _tokenizer_argv(settings: dict[str, str | None]) -> str:
    return shlex.join([arg for key, value in settings.items() if value
                       for arg in ("--" + key.replace("_", "-"), value)])


def write_sidecars(plan: ConversionPlan, save: Path, tokenizer: dict[str, str | None]) -> None:
    """Flags files, original HF config, tokenizer and provenance next to the checkpoint. ``tokenizer``: the
    checkpoint's :func:`tokenizer_settings`."""
    tok_flags = _tokenizer_argv(tokenizer)
    hint = (f"# Megatron flags for this checkpoint (converted from {plan.hf_dir}, model_type "
            f"{plan.hf_config.get('model_type')}).\n# Train with: <these flags> --load/--pretrained-checkpoint {save} "
            f"{tok_flags}\n"
            f"# Converted for --tensor-model-parallel-size {plan.target_tp} --pipeline-model-parallel-size "
            f"{plan.target_pp}; the padded vocab ({plan.padded_vocab}) fits TP in {plan.compatible_tp}.\n")
    (save / ARGS_TXT).write_text(hint + _flags_text(plan.flags) + "\n")
    sh_lines = "\n".join(f"    {line}" for line in _flags_text(plan.flags).splitlines())
    (save / ARGS_SH).write_text(
        hint + f"MODEL_ARGS=(\n{sh_lines}\n)\nPARALLEL_ARGS=(--tensor-model-parallel-size {plan.target_tp} "
        f"--pipeline-model-parallel-size {plan.target_pp})\nTOKENIZER_ARGS=({tok_flags})\n")
    hf_cfg_dir = save / HF_CONFIG_DIR
    hf_cfg_dir.mkdir(exist_ok=True)
    shutil.copy2(plan.hf_dir / "config.json", hf_cfg_dir / "config.json")
    if (plan.hf_dir / "generation_config.json").is_file():
        shutil.copy2(plan.hf_dir / "generation_config.json", hf_cfg_dir / "generation_config.json")
    tok_dir = save / TOKENIZER_DIR
    if tok_dir.exists():
        shutil.rmtree(tok_dir)
    copy_tokenizer(plan.hf_dir, tok_dir)
    (save / PROVENANCE).write_text(json.dumps({
        "source": str(plan.hf_dir.resolve()), "model_type": plan.hf_config.get("model_type"),
        "family": plan.family.name, "dtype": str(plan.dtype).replace("torch.", ""),
        "vocab_size": plan.spec.vocab_size, "padded_vocab_size": plan.padded_vocab,
        "target_tensor_parallel_size": plan.target_tp, "target_pipeline_parallel_size": plan.target_pp,
        "compatible_tensor_parallel_sizes": plan.compatible_tp, "megatron_flags": plan.flags}, indent=2) + "\n")


def convert_hf_to_megatron(hf_dir: str | os.PathLike, save: str | os.PathLike, target_tp: int = 1,
                           target_pp: int = 1, dtype: str | None = None,
                           make_vocab_size_divisible_by: int = 128) -> Path:
    """Convert a local Hugging Face Llama/Qwen2/Qwen3(-MoE) directory into a Megatron release checkpoint.

    ``dtype``: parameter dtype of the checkpoint (default: the Hugging Face config's, else float32).
    Needs a 1-process torch.distributed group (created if absent) and runs megatron-core on CPU-sized
    memory: one copy of the model in ``dtype`` plus one layer of temporaries. Returns ``save/release``.
    """
    t0 = time.perf_counter()
    plan = plan_conversion(hf_dir, target_tp, target_pp, dtype, make_vocab_size_divisible_by)
    reader = HFTensorReader(plan.hf_dir)
    absent = sorted(set(hf_tensor_names(plan.spec)) - set(reader.names()))
    if absent:
        raise ConversionError(f"the weights in {plan.hf_dir} lack {len(absent)} tensor(s) config.json implies, "
                              f"e.g. {absent[:3]}")
    save = Path(save)
    if save.exists() and not save.is_dir():
        raise ConversionError(f"--save={save} exists and is not a directory")

    from megatron.rl.training.checkpoint.save_load import save_checkpoint

    train_cfg, model = build_tp1_model(plan.flags, plan.padded_vocab, plan.dtype)
    fill_model(model, iter_hf_to_megatron(reader.get, plan.spec, plan.padded_vocab))
    target_cfg = parse_megatron_flags(plan.flags, plan.target_tp, plan.target_pp,
                                      extra=["--sequence-parallel"] if plan.spec.num_experts and plan.target_tp > 1
                                      else [])
    # the padded vocab is stored so a run that pads differently is refused on load (not silently mis-sized);
    # the model flags (with the tokenizer copied next to it) let --use-checkpoint-args work on the checkpoint alone
    from megatron.rl.training.checkpoint.args import checkpoint_flags

    flags = checkpoint_flags(target_cfg, plan.spec.vocab_size)
    tokenizer = tokenizer_settings(plan.hf_dir, save)
    flags.update(tokenizer)
    out = save_checkpoint(save, "release", [model], model_args={
        **target_cfg.model_args(), "padded_vocab_size": plan.padded_vocab, "flags": flags})
    write_sidecars(plan, save, tokenizer)
    log.info("converted %s (%s, %.1fM parameters, %s) to %s in %.1f s", plan.hf_dir, plan.family.name,
             sum(p.numel() for p in model.parameters()) / 1e6, plan.dtype, out, time.perf_counter() - t0)
    return out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Convert a Hugging Face Llama 3.x / Qwen2 / Qwen2.5 / Qwen3 / Qwen3-MoE "
                                            "model to a Megatron torch_dist release checkpoint.", allow_abbrev=False)
    p.add_argument("--hf-dir", required=True, help="local Hugging Face model directory (config.json + weights)")
    p.add_argument("--save", required=True, help="output directory (Megatron --load / --pretrained-checkpoint)")
    p.add_argument(TP_FLAG, type=int, default=1, help="TP the checkpoint is meant for (validated; fixes vocab padding)")
    p.add_argument(PP_FLAG, type=int, default=1, help="PP the checkpoint is meant for (validated)")
    p.add_argument("--dtype", choices=sorted(_DTYPES), help="parameter dtype (default: the HF config's)")
    p.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_arg_parser().parse_args(argv)
    # conversion is memory-bound work; keep megatron-core on the CPU even on GPU nodes
    os.environ.setdefault("MEGATRON_RL_FORCE_CPU", "1")
    from megatron.rl.logging import setup_distributed_logging

    setup_distributed_logging("INFO")
    try:
        out = convert_hf_to_megatron(args.hf_dir, args.save, args.target_tensor_parallel_size,
                                     args.target_pipeline_parallel_size, args.dtype,
                                     args.make_vocab_size_divisible_by)
    except ConversionError as e:
        log.error("%s", e)
        return 2
    log.info("done: %s (flags in %s)", out, Path(args.save) / ARGS_TXT)
    return 0


if __name__ == "__main__":
    sys.exit(main())
