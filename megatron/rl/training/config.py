"""Megatron-LM-style command-line flags, parsed once into a typed, frozen :class:`TrainingConfig`.

Flag names and meanings follow Megatron-LM (``--num-layers``, ``--tensor-model-parallel-size``, ...), so
existing launch scripts carry over. Each flag is declared once, on its field in
:mod:`megatron.rl.training.config_sections` (how: :mod:`megatron.rl.base.flags`); :func:`build_parser`
is generated from those fields. :func:`parse_args` then resolves the values that depend on other flags
(data-parallel size, FFN size, ...) into a new frozen config and rejects inconsistent settings with a
:class:`ConfigError` that names the flag, the value and what to do, before any process group or model exists.

Extra flags (e.g. the RL flags of ``train_rl.py``) come from ``extra_args_providers``: callables that take
the ``argparse.ArgumentParser`` and return it; their values land in ``TrainingConfig.extra``.
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import os
import sys
from typing import Callable, Iterable, Sequence

from megatron.rl.training.config_sections import (CheckpointConfig, DataConfig, LoggingConfig, ModelConfig,
                                                  OptimConfig, ParallelConfig, TokenizerConfig, TrainConfig,
                                                  TrainingConfig)
from megatron.rl.base.errors import ConfigError
from megatron.rl.base.flags import add_flags, dests, from_namespace, refuse_removed_flags
from megatron.rl.training.checkpoint.args import check_explicit_flags, merge_checkpoint_args
from megatron.rl.training.checkpoint.retention import RetentionPolicy

__all__ = ["ConfigError", "ModelConfig", "ParallelConfig", "OptimConfig", "TrainConfig", "CheckpointConfig",
           "LoggingConfig", "TokenizerConfig", "DataConfig", "TrainingConfig", "build_parser", "parse_args",
           "resolve_config", "transformer_engine_importable", "parse_cpu_threads"]


ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# --------------------------------------------------------------------------- parser


def build_parser(extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.ArgumentParser:
    """The argparse parser with Megatron-LM flag names; ``extra_args_providers`` may add groups."""
    p = argparse.ArgumentParser(description="megatron-rl training", allow_abbrev=False)
    add_flags(p, TrainingConfig)
    for provider in extra_args_providers:
        p = provider(p) or p
    return p


def parse_args(argv: Sequence[str] | None = None, extra_args_providers: Iterable[ArgsProvider] = (),
               world_size: int | None = None, ignore_unknown_args: bool = False) -> TrainingConfig:
    """Parse Megatron-LM flags into a validated :class:`TrainingConfig`.

    ``argv``: the flags (``None``: ``sys.argv[1:]``). ``world_size``: number of processes the job will run
    on (default: ``$WORLD_SIZE`` as set by torchrun, else 1). Raises :class:`ConfigError` on inconsistent
    settings; argparse itself exits on unknown flags unless ``ignore_unknown_args``.
    """
    parser = build_parser(extra_args_providers)
    given = list(sys.argv[1:] if argv is None else argv)
    refuse_removed_flags(parser, given)
    from_ckpt, added = None, []
    if "--use-checkpoint-args" in given:
        given, *from_ckpt, added = merge_checkpoint_args(given, parser)
    if ignore_unknown_args:
        ns, _ = parser.parse_known_args(given)
    else:
        ns = parser.parse_args(given)
    if from_ckpt:
        check_explicit_flags(ns, *from_ckpt, parser)
    own = dests(TrainingConfig)
    extra = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in own})
    raw = from_namespace(TrainingConfig, ns, extra=extra, argv=list(argv) if argv is not None else [],
                         checkpoint_args=tuple(added))
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    return resolve_config(raw, world_size)


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# --------------------------------------------------------------------------- derivation and validation


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


_set = dataclasses.replace  # every resolved value goes into a new frozen object, never into the parsed one


def _positive(name: str, value) -> None:
    _need(value is None or value > 0, f"{name}={value}: must be a positive integer.")


def _resolve_model(m: ModelConfig, cuda: bool) -> ModelConfig:
    """``m`` with every default that depends on other flags filled in (checked on the way)."""
    for flag, v in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                    ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                    ("--ffn-hidden-size", m.ffn_hidden_size), ("--kv-channels", m.kv_channels),
                    ("--num-query-groups", m.num_query_groups), ("--num-experts", m.num_experts),
                    ("--moe-router-topk", m.moe_router_topk),
                    ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)):
        _positive(flag, v)
    if m.ffn_hidden_size is None:
        # Megatron's rule: SwiGLU has 3 matrices, so 2/3 of 4h keeps the parameter count (rounded to 64).
        m = _set(m, ffn_hidden_size=int(4 * m.hidden_size * 2 / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size)
        _need(m.ffn_hidden_size > 0, f"--hidden-size={m.hidden_size} is too small for the SwiGLU default FFN size; "
                                     f"pass --ffn-hidden-size.")
    if m.kv_channels is None:
        _need(m.hidden_size % m.num_attention_heads == 0,
              f"--hidden-size={m.hidden_size} is not divisible by --num-attention-heads={m.num_attention_heads}; "
              f"change one of them or pass --kv-channels.")
        m = _set(m, kv_channels=m.hidden_size // m.num_attention_heads)
    if m.group_query_attention:
        _need(m.num_query_groups is not None, "--group-query-attention needs --num-query-groups N.")
    else:
        _need(m.num_query_groups is None or m.num_query_groups == m.num_attention_heads,
              f"--num-query-groups={m.num_query_groups} has no effect without --group-query-attention; add it.")
        m = _set(m, num_query_groups=m.num_attention_heads)
    _need(m.num_attention_heads % m.num_query_groups == 0,
          f"--num-attention-heads={m.num_attention_heads} is not divisible by --num-query-groups="
          f"{m.num_query_groups}; every query group must hold the same number of heads.")
    if m.max_position_embeddings is None:
        m = _set(m, max_position_embeddings=m.seq_length)
    _need(m.position_embedding_type != "learned_absolute" or m.max_position_embeddings >= m.seq_length,
          f"--max-position-embeddings={m.max_position_embeddings} is smaller than --seq-length={m.seq_length}; "
          f"learned absolute positions need one embedding per position.")
    _need(not m.use_rope_scaling or (m.position_embedding_type == "rope" and m.rope_scaling_factor > 0),
          f"--use-rope-scaling needs --position-embedding-type rope (got {m.position_embedding_type}) and "
          f"--rope-scaling-factor > 0 (got {m.rope_scaling_factor}).")
    for flag, v in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        _need(0.0 <= v < 1.0, f"{flag}={v}: must be in [0, 1).")
    _need(not (m.bf16 and m.fp16), "--bf16 and --fp16 were both given; choose one.")
    return _resolve_experts_and_kernels(m, cuda)


def _resolve_experts_and_kernels(m: ModelConfig, cuda: bool) -> ModelConfig:
    """``m`` with the MoE defaults and the transformer implementation filled in, and what needs CUDA checked."""
    if m.num_experts is not None:
        if m.moe_ffn_hidden_size is None:
            m = _set(m, moe_ffn_hidden_size=m.ffn_hidden_size)
        _need(m.moe_router_topk <= m.num_experts,
              f"--moe-router-topk={m.moe_router_topk} exceeds --num-experts={m.num_experts}.")
    else:
        _need(not m.moe_grouped_gemm, "--moe-grouped-gemm needs --num-experts.")
    if m.moe_grouped_gemm:
        _need(cuda, "--moe-grouped-gemm needs a CUDA GPU (grouped GEMM kernels); drop the flag on CPU.")
    _need(m.moe_token_dispatcher_type != "flex" or cuda,
          "--moe-token-dispatcher-type flex needs DeepEP on CUDA; use alltoall or allgather on CPU.")
    te = transformer_engine_importable()
    if m.transformer_impl is None:
        m = _set(m, transformer_impl="transformer_engine" if (te and cuda) else "local")
    elif m.transformer_impl == "transformer_engine":
        _need(te, "--transformer-impl transformer_engine was requested but transformer_engine is not importable; "
                  "install it (pip install 'megatron-rl[gpu]') or use --transformer-impl local.")
        _need(cuda, "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local on CPU.")
    if m.use_cpu_initialization is None:
        m = _set(m, use_cpu_initialization=not cuda)
    _need(not (m.fp16 and not cuda), "--fp16 needs a CUDA GPU (CPU kernels lack fp16 coverage); use --bf16 or fp32.")
    return m


def _resolve_parallel(m: ModelConfig, p: ParallelConfig, world_size: int) -> ParallelConfig:
    """``p`` with world, data-parallel, virtual-pipeline and expert-TP sizes filled in (checked on the way)."""
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size",
                                                          p.expert_tensor_parallel_size),
                    ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage)):
        _positive(flag, v)
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
          f"--pipeline-model-parallel-size={pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
          f"(torchrun --nproc-per-node) or change the parallel sizes.")
    p = _set(p, world_size=world_size, data_parallel_size=world_size // (tp * pp))
    _need(m.num_attention_heads % tp == 0,
          f"--num-attention-heads={m.num_attention_heads} is not divisible by --tensor-model-parallel-size={tp}; "
          f"each tensor-parallel rank must hold whole heads.")
    _need(m.num_query_groups % tp == 0,
          f"--num-query-groups={m.num_query_groups} is not divisible by --tensor-model-parallel-size={tp}.")
    _need(m.ffn_hidden_size % tp == 0,
          f"--ffn-hidden-size={m.ffn_hidden_size} is not divisible by --tensor-model-parallel-size={tp}.")
    if p.sequence_parallel:
        _need(m.seq_length % tp == 0, f"--seq-length={m.seq_length} is not divisible by "
                                      f"--tensor-model-parallel-size={tp}, which --sequence-parallel requires.")
    _need(m.num_layers % pp == 0,
          f"--num-layers={m.num_layers} is not divisible by --pipeline-model-parallel-size={pp}.")
    vl = p.num_layers_per_virtual_pipeline_stage
    if vl is not None:
        _need(pp > 1, "--num-layers-per-virtual-pipeline-stage needs --pipeline-model-parallel-size > 1.")
        per_stage = m.num_layers // pp
        _need(per_stage % vl == 0,
              f"--num-layers-per-virtual-pipeline-stage={vl} does not divide the {per_stage} layers of each "
              f"pipeline stage (--num-layers={m.num_layers} / --pipeline-model-parallel-size={pp}).")
        p = _set(p, virtual_pipeline_model_parallel_size=per_stage // vl if per_stage // vl > 1 else None)
    if p.expert_tensor_parallel_size is None:
        p = _set(p, expert_tensor_parallel_size=tp)
    etp = p.expert_tensor_parallel_size
    if m.num_experts is None:
        _need(ep == 1, f"--expert-model-parallel-size={ep} needs a MoE model: pass --num-experts.")
    else:
        _need(m.num_experts % ep == 0, f"--num-experts={m.num_experts} is not divisible by "
                                       f"--expert-model-parallel-size={ep}; each EP rank must hold whole experts.")
        _need(world_size % (etp * ep * pp) == 0,
              f"world size {world_size} is not divisible by --expert-tensor-parallel-size={etp} x "
              f"--expert-model-parallel-size={ep} x --pipeline-model-parallel-size={pp}; megatron-core lays the "
              f"expert groups over the same ranks, so launch a multiple of {etp * ep * pp} processes.")
        _need(tp == 1 or p.sequence_parallel,
              f"MoE with --tensor-model-parallel-size={tp} needs --sequence-parallel (megatron-core requirement).")
        _need(m.disable_bias_linear or etp == 1,
              f"MoE experts with bias need --expert-tensor-parallel-size=1 (got {etp}); pass --disable-bias-linear "
              f"or --expert-tensor-parallel-size 1.")
    _need(not p.overlap_param_gather or p.use_distributed_optimizer,
          "--overlap-param-gather needs --use-distributed-optimizer.")
    return p


def _resolve_train(t: TrainConfig, p: ParallelConfig, o: OptimConfig) -> tuple[TrainConfig, OptimConfig]:
    """``t`` and ``o`` with batch sizes and schedule defaults filled in (checked on the way)."""
    _positive("--micro-batch-size", t.micro_batch_size)
    _positive("--global-batch-size", t.global_batch_size)
    _positive("--train-iters", t.train_iters)
    dp = p.data_parallel_size
    if t.global_batch_size is None:
        t = _set(t, global_batch_size=t.micro_batch_size * dp)
    _need(t.global_batch_size % (t.micro_batch_size * dp) == 0,
          f"--global-batch-size={t.global_batch_size} is not divisible by --micro-batch-size={t.micro_batch_size} "
          f"x data-parallel size {dp} (= world {p.world_size} / (TP*PP)) = {t.micro_batch_size * dp}; "
          f"use a multiple of {t.micro_batch_size * dp}.")
    t = _set(t, num_microbatches=t.global_batch_size // (t.micro_batch_size * dp))
    vpp, pp = p.virtual_pipeline_model_parallel_size, p.pipeline_model_parallel_size
    if vpp is not None:
        m = t.num_microbatches
        _need(m >= pp and (m % pp == 0 or m % pp >= pp),
              f"the interleaved pipeline schedule needs the microbatches per iteration ({m} = --global-batch-size / "
              f"(--micro-batch-size x DP)) to be a multiple of --pipeline-model-parallel-size={pp}.")
    _need(t.eval_iters >= 0, f"--eval-iters={t.eval_iters}: must be >= 0.")
    _positive("--eval-interval", t.eval_interval)
    if o.lr is not None:
        _need(o.lr >= 0 and o.min_lr >= 0 and o.min_lr <= o.lr,
              f"--lr={o.lr} / --min-lr={o.min_lr}: need 0 <= min-lr <= lr.")
    if o.lr_decay_iters is None:
        o = _set(o, lr_decay_iters=t.train_iters)
    if o.lr_decay_iters is not None:
        _need(o.lr_warmup_iters < o.lr_decay_iters or o.lr_decay_style == "constant",
              f"--lr-warmup-iters={o.lr_warmup_iters} must be smaller than --lr-decay-iters (or --train-iters)"
              f"={o.lr_decay_iters}.")
    if o.lr_decay_style == "WSD":
        _need(o.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters.")
    if o.start_weight_decay is None:
        o = _set(o, start_weight_decay=o.weight_decay)
    if o.end_weight_decay is None:
        o = _set(o, end_weight_decay=o.weight_decay)
    _need(o.clip_grad >= 0, f"--clip-grad={o.clip_grad}: must be >= 0 (0 disables clipping).")
    _need(not (o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler),
          "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive.")
    return t, o


def parse_cpu_threads(value: str) -> int | None:
    """``--cpu-threads``: None for ``auto``, else the fixed count (a positive integer)."""
    if value == "auto":
        return None
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise ConfigError(f"--cpu-threads {value!r}: expected 'auto' or a positive number of threads "
                          "(e.g. --cpu-threads 1 on a machine shared with other jobs)")
    return n


def _check_io(cfg: TrainingConfig) -> None:
    c, d, lg = cfg.checkpoint, cfg.data, cfg.logging
    _positive("--save-interval", c.save_interval)
    _positive("--log-interval", lg.log_interval)
    _need(c.save_interval is None or c.save is not None, "--save-interval needs --save DIR.")
    RetentionPolicy.from_flags(c.save, c.save_retain_last, c.save_retain_best)  # ConfigError naming the flag
    _need(not (d.mock_data and d.data_path), "--mock-data and --data-path were both given; choose one.")
    if d.data_path is not None:
        _need(len(d.data_path) > 0, "--data-path was given without paths.")
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        _need(cfg.tokenizer.tokenizer_model is not None,
              "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory).")
    _positive("--vocab-size", cfg.tokenizer.vocab_size)
    parse_cpu_threads(cfg.train.cpu_threads)
    if lg.wandb_project is not None:
        _need(importlib.util.find_spec("wandb") is not None,
              f"--wandb-project={lg.wandb_project} needs the wandb package: pip install wandb "
              f"(or 'megatron-rl[wandb]'), or drop the flag.")
    if lg.tensorboard_dir is not None:
        _need(importlib.util.find_spec("tensorboard") is not None
              or importlib.util.find_spec("tensorboardX") is not None,
              f"--tensorboard-dir={lg.tensorboard_dir} needs the tensorboard package: pip install tensorboard.")


def resolve_config(cfg: TrainingConfig, world_size: int, cuda: bool | None = None) -> TrainingConfig:
    """The config with every derived value resolved (a new frozen object); :class:`ConfigError` for settings
    that cannot work.

    ``cuda``: whether this job runs on CUDA (default: what the runtime would choose).
    """
    if cuda is None:
        from megatron.rl.runtime import cuda_usable  # torch: flag parsing stays torch-free

        cuda = cuda_usable()
    _positive("world size", world_size)
    model = _resolve_model(cfg.model, cuda)
    parallel = _resolve_parallel(model, cfg.parallel, world_size)
    train, optim = _resolve_train(cfg.train, parallel, cfg.optim)
    cfg = _set(cfg, model=model, parallel=parallel, train=train, optim=optim)
    _check_io(cfg)
    return cfg
