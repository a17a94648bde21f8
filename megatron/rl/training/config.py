"""Megatron-LM-style command-line flags, parsed once into a typed :class:`TrainingConfig` and validated up front.

Flag names and meanings follow Megatron-LM (``--num-layers``, ``--tensor-model-parallel-size``, ...), so
existing launch scripts carry over. Every section of the config is a plain dataclass whose field names equal
the argparse destinations; derived values (data-parallel size, FFN size, ...) are filled in by
:func:`parse_args`, which also rejects inconsistent settings with a :class:`ConfigError` that names the flag,
the value and what to do, before any process group or model exists.

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


class ConfigError(ValueError):
    """A flag value (or combination) that cannot work; the message names the flag and what to do."""


# --------------------------------------------------------------------------- typed sections


@dataclasses.dataclass
class ModelConfig:
    """Architecture and numerics of the GPT (everything that shapes the weights, plus precision)."""

    num_layers: int
    hidden_size: int
    num_attention_heads: int
    ffn_hidden_size: int | None = None        # derived: 4*hidden, or Megatron's SwiGLU rule
    num_query_groups: int | None = None       # derived: num_attention_heads unless --group-query-attention
    group_query_attention: bool = False
    kv_channels: int | None = None            # derived: hidden_size // num_attention_heads
    seq_length: int = 1024
    max_position_embeddings: int | None = None  # derived: seq_length
    swiglu: bool = False
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    position_embedding_type: str = "learned_absolute"
    rotary_base: int = 10000
    rotary_percent: float = 1.0
    use_rope_scaling: bool = False             # Llama-3.x RoPE frequency scaling (megatron-core's rope_scaling)
    rope_scaling_factor: float = 8.0
    untie_embeddings_and_output_weights: bool = False
    add_qkv_bias: bool = False
    disable_bias_linear: bool = False
    qk_layernorm: bool = False
    make_vocab_size_divisible_by: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    # mixture of experts
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None     # derived: ffn_hidden_size
    moe_token_dispatcher_type: str = "allgather"
    moe_aux_loss_coeff: float = 0.0
    moe_router_load_balancing_type: str = "aux_loss"
    moe_grouped_gemm: bool = False
    # numerics / implementation
    bf16: bool = False
    fp16: bool = False
    transformer_impl: str | None = None        # derived: transformer_engine when importable and on CUDA, else local
    use_cpu_initialization: bool | None = None  # derived: True on CPU
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear


@dataclasses.dataclass
class ParallelConfig:
    """Parallel layout. ``world_size`` and ``data_parallel_size`` are derived at parse time."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    num_layers_per_virtual_pipeline_stage: int | None = None
    expert_model_parallel_size: int = 1
    expert_tensor_parallel_size: int | None = None  # derived: tensor_model_parallel_size
    sequence_parallel: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    accumulate_allreduce_grads_in_fp32: bool = False
    world_size: int = 1                         # derived: $WORLD_SIZE
    data_parallel_size: int = 1                 # derived: world / (TP * PP)
    virtual_pipeline_model_parallel_size: int | None = None  # derived from --num-layers-per-virtual-pipeline-stage


@dataclasses.dataclass
class OptimConfig:
    """Optimizer and learning-rate / weight-decay schedule."""

    optimizer: str = "adam"
    lr: float | None = None
    min_lr: float = 0.0
    lr_decay_style: str = "linear"
    lr_warmup_iters: int = 0
    lr_warmup_init: float = 0.0
    lr_decay_iters: int | None = None           # derived: train_iters
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "exponential"
    weight_decay: float = 0.01
    start_weight_decay: float | None = None     # derived: weight_decay
    end_weight_decay: float | None = None       # derived: weight_decay
    weight_decay_incr_style: str = "constant"
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    sgd_momentum: float = 0.9
    clip_grad: float = 1.0
    loss_scale: float | None = None
    initial_loss_scale: float = 2.0 ** 32
    min_loss_scale: float = 1.0
    loss_scale_window: int = 1000
    hysteresis: int = 2
    override_opt_param_scheduler: bool = False
    use_checkpoint_opt_param_scheduler: bool = False


@dataclasses.dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None        # derived: micro_batch_size * data_parallel_size
    train_iters: int | None = None
    seed: int = 1234
    eval_interval: int | None = None
    eval_iters: int = 0
    exit_interval: int | None = None
    exit_signal_handler: bool = False           # save and exit cleanly on --exit-signal (Slurm preemption)
    exit_signal: str = "SIGTERM"
    num_microbatches: int = 1                   # derived: global / (micro * DP), per DP rank per iteration


@dataclasses.dataclass
class CheckpointConfig:
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    pretrained_checkpoint: str | None = None
    finetune: bool = False
    no_load_optim: bool = False
    no_load_rng: bool = False
    no_save_optim: bool = False
    no_save_rng: bool = False
    ckpt_format: str = "torch_dist"
    dist_ckpt_optim_format: str = "fully_reshardable"
    use_checkpoint_args: bool = False           # model flags filled from the checkpoint (checkpoint_args.py)
    # checkpoint integrity (issue 10): skip the checksum manifest check on load
    no_verify_checkpoint_checksums: bool = False


@dataclasses.dataclass
class LoggingConfig:
    log_interval: int = 100
    tensorboard_dir: str | None = None
    tensorboard_log_interval: int = 1
    wandb_project: str | None = None
    wandb_exp_name: str | None = None
    wandb_save_dir: str | None = None
    log_level: str = "INFO"


@dataclasses.dataclass
class TokenizerConfig:
    tokenizer_type: str = "ByteLevelTokenizer"
    tokenizer_model: str | None = None
    vocab_size: int | None = None               # optional: unpadded vocab size to use instead of the tokenizer's


@dataclasses.dataclass
class DataConfig:
    data_path: list[str] | None = None
    mock_data: bool = False
    split: str = "969,30,1"
    data_cache_path: str | None = None
    num_workers: int = 0


@dataclasses.dataclass
class TrainingConfig:
    """Everything parsed from the command line. Pass it (or its sections) down explicitly; no globals."""

    model: ModelConfig
    parallel: ParallelConfig
    optim: OptimConfig
    train: TrainConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    tokenizer: TokenizerConfig
    data: DataConfig
    extra: argparse.Namespace = dataclasses.field(default_factory=argparse.Namespace)
    argv: list[str] = dataclasses.field(default_factory=list)

    def model_args(self) -> dict:
        """JSON-able architecture flags stored with checkpoints and compared on load.

        ``max_position_embeddings`` only shapes weights with learned absolute positions (with RoPE it is a
        generation limit that e.g. Base and Instruct releases set differently), so it is compared only then.
        The padded vocab size is added by the training loops (it needs the tokenizer; see
        ``model_provider.checkpoint_model_args``).
        """
        m = self.model
        keys = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "swiglu", "normalization", "position_embedding_type", "rotary_base",
                "use_rope_scaling", "untie_embeddings_and_output_weights", "add_qkv_bias", "disable_bias_linear",
                "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_router_topk")
        out = {k: getattr(m, k) for k in keys}
        if m.position_embedding_type == "learned_absolute":
            out["max_position_embeddings"] = m.max_position_embeddings
        if m.use_rope_scaling:
            out["rope_scaling_factor"] = m.rope_scaling_factor
        out["vocab_size"] = self.tokenizer.vocab_size
        return out


_SECTIONS = {"model": ModelConfig, "parallel": ParallelConfig, "optim": OptimConfig, "train": TrainConfig,
             "checkpoint": CheckpointConfig, "logging": LoggingConfig, "tokenizer": TokenizerConfig,
             "data": DataConfig}
_DERIVED = {"world_size", "data_parallel_size", "virtual_pipeline_model_parallel_size", "num_microbatches"}

ArgsProvider = Callable[[argparse.ArgumentParser], argparse.ArgumentParser]


# --------------------------------------------------------------------------- parser


def build_parser(extra_args_providers: Iterable[ArgsProvider] = ()) -> argparse.ArgumentParser:
    """The argparse parser with Megatron-LM flag names; ``extra_args_providers`` may add groups."""
    p = argparse.ArgumentParser(description="megatron-rl training", allow_abbrev=False)

    g = p.add_argument_group("model")
    g.add_argument("--num-layers", type=int, required=True)
    g.add_argument("--hidden-size", type=int, required=True)
    g.add_argument("--ffn-hidden-size", type=int, help="default 4*hidden (SwiGLU: 8/3*hidden rounded down to 64)")
    g.add_argument("--num-attention-heads", type=int, required=True)
    g.add_argument("--group-query-attention", action="store_true")
    g.add_argument("--num-query-groups", type=int, help="KV head groups; only used with --group-query-attention")
    g.add_argument("--kv-channels", type=int, help="per-head dim; default hidden/heads")
    g.add_argument("--seq-length", type=int, default=1024)
    g.add_argument("--max-position-embeddings", type=int, help="default --seq-length")
    g.add_argument("--swiglu", action="store_true")
    g.add_argument("--normalization", choices=["LayerNorm", "RMSNorm"], default="LayerNorm")
    g.add_argument("--norm-epsilon", type=float, default=1e-5)
    g.add_argument("--position-embedding-type", choices=["rope", "learned_absolute", "none"],
                   default="learned_absolute")
    g.add_argument("--rotary-base", type=int, default=10000)
    g.add_argument("--rotary-percent", type=float, default=1.0)
    g.add_argument("--use-rope-scaling", action="store_true", help="Llama-3.x RoPE frequency scaling")
    g.add_argument("--rope-scaling-factor", type=float, default=8.0, help="with --use-rope-scaling")
    g.add_argument("--untie-embeddings-and-output-weights", action="store_true")
    g.add_argument("--add-qkv-bias", action="store_true")
    g.add_argument("--disable-bias-linear", action="store_true")
    g.add_argument("--qk-layernorm", action="store_true")
    g.add_argument("--make-vocab-size-divisible-by", type=int, default=128)
    g.add_argument("--hidden-dropout", type=float, default=0.1)
    g.add_argument("--attention-dropout", type=float, default=0.1)
    g.add_argument("--init-method-std", type=float, default=0.02)
    g.add_argument("--transformer-impl", choices=["local", "transformer_engine"],
                   help="default: transformer_engine when importable on a CUDA machine, else local")
    g.add_argument("--use-cpu-initialization", action="store_true", default=None,
                   help="initialise weights on CPU (default on CPU runs; makes TP init equal to TP=1)")
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--fp16", action="store_true")
    g.add_argument("--recompute-granularity", choices=["full", "selective"])
    g.add_argument("--recompute-method", choices=["uniform", "block"])
    g.add_argument("--recompute-num-layers", type=int)

    g = p.add_argument_group("mixture of experts")
    g.add_argument("--num-experts", type=int)
    g.add_argument("--moe-router-topk", type=int, default=2)
    g.add_argument("--moe-ffn-hidden-size", type=int, help="default --ffn-hidden-size")
    g.add_argument("--moe-token-dispatcher-type", choices=["allgather", "alltoall", "flex"], default="allgather")
    g.add_argument("--moe-aux-loss-coeff", type=float, default=0.0)
    g.add_argument("--moe-router-load-balancing-type", choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"],
                   default="aux_loss")
    g.add_argument("--moe-grouped-gemm", action="store_true")

    g = p.add_argument_group("parallelism")
    g.add_argument("--tensor-model-parallel-size", type=int, default=1)
    g.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    g.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    g.add_argument("--expert-model-parallel-size", type=int, default=1)
    g.add_argument("--expert-tensor-parallel-size", type=int, help="default --tensor-model-parallel-size")
    g.add_argument("--sequence-parallel", action="store_true")
    g.add_argument("--use-distributed-optimizer", action="store_true")
    g.add_argument("--overlap-grad-reduce", action="store_true")
    g.add_argument("--overlap-param-gather", action="store_true")
    g.add_argument("--accumulate-allreduce-grads-in-fp32", action="store_true")

    g = p.add_argument_group("training")
    g.add_argument("--micro-batch-size", type=int, default=1)
    g.add_argument("--global-batch-size", type=int, help="default micro-batch-size * data-parallel size")
    g.add_argument("--train-iters", type=int)
    g.add_argument("--seed", type=int, default=1234)
    g.add_argument("--eval-interval", type=int)
    g.add_argument("--eval-iters", type=int, default=0)
    g.add_argument("--exit-interval", type=int)
    g.add_argument("--exit-signal-handler", action="store_true",
                   help="on --exit-signal: finish the iteration, save (with --save) and exit 0")
    g.add_argument("--exit-signal", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"], default="SIGTERM")

    g = p.add_argument_group("optimizer")
    g.add_argument("--optimizer", choices=["adam", "sgd"], default="adam")
    g.add_argument("--lr", type=float)
    g.add_argument("--min-lr", type=float, default=0.0)
    g.add_argument("--lr-decay-style", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"],
                   default="linear")
    g.add_argument("--lr-warmup-iters", type=int, default=0)
    g.add_argument("--lr-warmup-init", type=float, default=0.0)
    g.add_argument("--lr-decay-iters", type=int, help="default --train-iters")
    g.add_argument("--lr-wsd-decay-iters", type=int)
    g.add_argument("--lr-wsd-decay-style", choices=["exponential", "linear", "cosine", "minus_sqrt"],
                   default="exponential")
    g.add_argument("--weight-decay", type=float, default=0.01)
    g.add_argument("--start-weight-decay", type=float)
    g.add_argument("--end-weight-decay", type=float)
    g.add_argument("--weight-decay-incr-style", choices=["constant", "linear", "cosine"], default="constant")
    g.add_argument("--adam-beta1", type=float, default=0.9)
    g.add_argument("--adam-beta2", type=float, default=0.999)
    g.add_argument("--adam-eps", type=float, default=1e-8)
    g.add_argument("--sgd-momentum", type=float, default=0.9)
    g.add_argument("--clip-grad", type=float, default=1.0)
    g.add_argument("--loss-scale", type=float, help="fp16 static loss scale (default: dynamic)")
    g.add_argument("--initial-loss-scale", type=float, default=2.0 ** 32)
    g.add_argument("--min-loss-scale", type=float, default=1.0)
    g.add_argument("--loss-scale-window", type=int, default=1000)
    g.add_argument("--hysteresis", type=int, default=2)
    g.add_argument("--override-opt-param-scheduler", action="store_true")
    g.add_argument("--use-checkpoint-opt-param-scheduler", action="store_true")

    g = p.add_argument_group("checkpointing")
    g.add_argument("--save", type=str)
    g.add_argument("--load", type=str)
    g.add_argument("--save-interval", type=int)
    g.add_argument("--pretrained-checkpoint", type=str)
    g.add_argument("--finetune", action="store_true",
                   help="load model weights only; reset iteration, optimizer and RNG")
    g.add_argument("--no-load-optim", action="store_true")
    g.add_argument("--no-load-rng", action="store_true")
    g.add_argument("--no-save-optim", action="store_true")
    g.add_argument("--no-save-rng", action="store_true")
    g.add_argument("--ckpt-format", choices=["torch_dist"], default="torch_dist")
    g.add_argument("--dist-ckpt-optim-format", choices=["fully_reshardable", "dp_reshardable"],
                   default="fully_reshardable")
    # --use-checkpoint-args (megatron/rl/training/checkpoint_args.py)
    g.add_argument("--use-checkpoint-args", action="store_true",
                   help="take the model flags (architecture, tokenizer, vocab, lengths) stored in the checkpoint "
                        "of --load (else --pretrained-checkpoint); an explicit conflicting flag is an error")
    # checkpoint integrity (issue 10)
    g.add_argument("--no-verify-checkpoint-checksums", action="store_true",
                   help="load without checking the checkpoint's files against the checksum manifest written at "
                        "save (for huge checkpoints on trusted storage); loaded values are still scanned for NaN/Inf")

    g = p.add_argument_group("logging")
    g.add_argument("--log-interval", type=int, default=100)
    g.add_argument("--tensorboard-dir", type=str)
    g.add_argument("--tensorboard-log-interval", type=int, default=1)
    g.add_argument("--wandb-project", type=str)
    g.add_argument("--wandb-exp-name", type=str)
    g.add_argument("--wandb-save-dir", type=str)
    g.add_argument("--log-level", choices=["DEBUG", "INFO", "WARNING", "ERROR"], default="INFO")

    g = p.add_argument_group("tokenizer")
    g.add_argument("--tokenizer-type", type=str, default="ByteLevelTokenizer")
    g.add_argument("--tokenizer-model", type=str)
    g.add_argument("--vocab-size", type=int, help="unpadded vocab size to use instead of the tokenizer's")

    g = p.add_argument_group("data")
    g.add_argument("--data-path", nargs="*", default=None)
    g.add_argument("--mock-data", action="store_true")
    g.add_argument("--split", type=str, default="969,30,1")
    g.add_argument("--data-cache-path", type=str)
    g.add_argument("--num-workers", type=int, default=0)

    for provider in extra_args_providers:
        p = provider(p) or p
    return p


def _section(cls, ns: argparse.Namespace, used: set[str]):
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name in _DERIVED:
            continue
        kw[f.name] = getattr(ns, f.name)
        used.add(f.name)
    return cls(**kw)


def parse_args(argv: Sequence[str] | None = None, extra_args_providers: Iterable[ArgsProvider] = (),
               world_size: int | None = None, ignore_unknown_args: bool = False) -> TrainingConfig:
    """Parse Megatron-LM flags into a validated :class:`TrainingConfig`.

    ``argv``: the flags (``None``: ``sys.argv[1:]``). ``world_size``: number of processes the job will run
    on (default: ``$WORLD_SIZE`` as set by torchrun, else 1). Raises :class:`ConfigError` on inconsistent
    settings; argparse itself exits on unknown flags unless ``ignore_unknown_args``.
    """
    parser = build_parser(extra_args_providers)
    given = list(sys.argv[1:] if argv is None else argv)
    from_ckpt = None
    if "--use-checkpoint-args" in given:
        from megatron.rl.training.checkpoint_args import check_explicit_flags, merge_checkpoint_args

        given, *from_ckpt = merge_checkpoint_args(given, parser)
    if ignore_unknown_args:
        ns, _ = parser.parse_known_args(given)
    else:
        ns = parser.parse_args(given)
    if from_ckpt:
        check_explicit_flags(ns, *from_ckpt, parser)
    used: set[str] = set()
    sections = {name: _section(cls, ns, used) for name, cls in _SECTIONS.items()}
    extra = argparse.Namespace(**{k: v for k, v in vars(ns).items() if k not in used})
    cfg = TrainingConfig(**sections, extra=extra, argv=list(argv) if argv is not None else [])
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "1"))
    derive_and_validate(cfg, world_size)
    return cfg


def transformer_engine_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


# --------------------------------------------------------------------------- derivation and validation


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _positive(name: str, value) -> None:
    _need(value is None or value > 0, f"{name}={value}: must be a positive integer.")


def _derive_model(m: ModelConfig, cuda: bool) -> None:
    for flag, v in (("--num-layers", m.num_layers), ("--hidden-size", m.hidden_size),
                    ("--num-attention-heads", m.num_attention_heads), ("--seq-length", m.seq_length),
                    ("--ffn-hidden-size", m.ffn_hidden_size), ("--kv-channels", m.kv_channels),
                    ("--num-query-groups", m.num_query_groups), ("--num-experts", m.num_experts),
                    ("--moe-router-topk", m.moe_router_topk),
                    ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by)):
        _positive(flag, v)
    if m.ffn_hidden_size is None:
        # Megatron's rule: SwiGLU has 3 matrices, so 2/3 of 4h keeps the parameter count (rounded to 64).
        m.ffn_hidden_size = int(4 * m.hidden_size * 2 / 3 / 64) * 64 if m.swiglu else 4 * m.hidden_size
        _need(m.ffn_hidden_size > 0, f"--hidden-size={m.hidden_size} is too small for the SwiGLU default FFN size; "
                                     f"pass --ffn-hidden-size.")
    if m.kv_channels is None:
        _need(m.hidden_size % m.num_attention_heads == 0,
              f"--hidden-size={m.hidden_size} is not divisible by --num-attention-heads={m.num_attention_heads}; "
              f"change one of them or pass --kv-channels.")
        m.kv_channels = m.hidden_size // m.num_attention_heads
    if m.group_query_attention:
        _need(m.num_query_groups is not None, "--group-query-attention needs --num-query-groups N.")
    else:
        _need(m.num_query_groups is None or m.num_query_groups == m.num_attention_heads,
              f"--num-query-groups={m.num_query_groups} has no effect without --group-query-attention; add it.")
        m.num_query_groups = m.num_attention_heads
    _need(m.num_attention_heads % m.num_query_groups == 0,
          f"--num-attention-heads={m.num_attention_heads} is not divisible by --num-query-groups="
          f"{m.num_query_groups}; every query group must hold the same number of heads.")
    if m.max_position_embeddings is None:
        m.max_position_embeddings = m.seq_length
    _need(m.position_embedding_type != "learned_absolute" or m.max_position_embeddings >= m.seq_length,
          f"--max-position-embeddings={m.max_position_embeddings} is smaller than --seq-length={m.seq_length}; "
          f"learned absolute positions need one embedding per position.")
    _need(not m.use_rope_scaling or (m.position_embedding_type == "rope" and m.rope_scaling_factor > 0),
          f"--use-rope-scaling needs --position-embedding-type rope (got {m.position_embedding_type}) and "
          f"--rope-scaling-factor > 0 (got {m.rope_scaling_factor}).")
    for flag, v in (("--hidden-dropout", m.hidden_dropout), ("--attention-dropout", m.attention_dropout)):
        _need(0.0 <= v < 1.0, f"{flag}={v}: must be in [0, 1).")
    _need(not (m.bf16 and m.fp16), "--bf16 and --fp16 were both given; choose one.")
    if m.num_experts is not None:
        if m.moe_ffn_hidden_size is None:
            m.moe_ffn_hidden_size = m.ffn_hidden_size
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
        m.transformer_impl = "transformer_engine" if (te and cuda) else "local"
    elif m.transformer_impl == "transformer_engine":
        _need(te, "--transformer-impl transformer_engine was requested but transformer_engine is not importable; "
                  "install it (pip install 'megatron-rl[gpu]') or use --transformer-impl local.")
        _need(cuda, "--transformer-impl transformer_engine needs a CUDA GPU; use --transformer-impl local on CPU.")
    if m.use_cpu_initialization is None:
        m.use_cpu_initialization = not cuda
    _need(not (m.fp16 and not cuda), "--fp16 needs a CUDA GPU (CPU kernels lack fp16 coverage); use --bf16 or fp32.")


def _derive_parallel(cfg: TrainingConfig, world_size: int) -> None:
    m, p = cfg.model, cfg.parallel
    tp, pp, ep = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.expert_model_parallel_size
    for flag, v in (("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp),
                    ("--expert-model-parallel-size", ep), ("--expert-tensor-parallel-size",
                                                          p.expert_tensor_parallel_size),
                    ("--num-layers-per-virtual-pipeline-stage", p.num_layers_per_virtual_pipeline_stage)):
        _positive(flag, v)
    p.world_size = world_size
    _need(world_size % (tp * pp) == 0,
          f"world size {world_size} is not divisible by --tensor-model-parallel-size={tp} x "
          f"--pipeline-model-parallel-size={pp} = {tp * pp}; launch a multiple of {tp * pp} processes "
          f"(torchrun --nproc-per-node) or change the parallel sizes.")
    p.data_parallel_size = world_size // (tp * pp)
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
        p.virtual_pipeline_model_parallel_size = per_stage // vl if per_stage // vl > 1 else None
    if p.expert_tensor_parallel_size is None:
        p.expert_tensor_parallel_size = tp
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


def _derive_train(cfg: TrainingConfig) -> None:
    t, p, o = cfg.train, cfg.parallel, cfg.optim
    _positive("--micro-batch-size", t.micro_batch_size)
    _positive("--global-batch-size", t.global_batch_size)
    _positive("--train-iters", t.train_iters)
    dp = p.data_parallel_size
    if t.global_batch_size is None:
        t.global_batch_size = t.micro_batch_size * dp
    _need(t.global_batch_size % (t.micro_batch_size * dp) == 0,
          f"--global-batch-size={t.global_batch_size} is not divisible by --micro-batch-size={t.micro_batch_size} "
          f"x data-parallel size {dp} (= world {p.world_size} / (TP*PP)) = {t.micro_batch_size * dp}; "
          f"use a multiple of {t.micro_batch_size * dp}.")
    t.num_microbatches = t.global_batch_size // (t.micro_batch_size * dp)
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
        o.lr_decay_iters = t.train_iters
    if o.lr_decay_iters is not None:
        _need(o.lr_warmup_iters < o.lr_decay_iters or o.lr_decay_style == "constant",
              f"--lr-warmup-iters={o.lr_warmup_iters} must be smaller than --lr-decay-iters (or --train-iters)"
              f"={o.lr_decay_iters}.")
    if o.lr_decay_style == "WSD":
        _need(o.lr_wsd_decay_iters is not None, "--lr-decay-style WSD needs --lr-wsd-decay-iters.")
    if o.start_weight_decay is None:
        o.start_weight_decay = o.weight_decay
    if o.end_weight_decay is None:
        o.end_weight_decay = o.weight_decay
    _need(o.clip_grad >= 0, f"--clip-grad={o.clip_grad}: must be >= 0 (0 disables clipping).")
    _need(not (o.override_opt_param_scheduler and o.use_checkpoint_opt_param_scheduler),
          "--override-opt-param-scheduler and --use-checkpoint-opt-param-scheduler are mutually exclusive.")


def _derive_io(cfg: TrainingConfig) -> None:
    c, d, lg = cfg.checkpoint, cfg.data, cfg.logging
    _positive("--save-interval", c.save_interval)
    _positive("--log-interval", lg.log_interval)
    _need(c.save_interval is None or c.save is not None, "--save-interval needs --save DIR.")
    _need(not (d.mock_data and d.data_path), "--mock-data and --data-path were both given; choose one.")
    if d.data_path is not None:
        _need(len(d.data_path) > 0, "--data-path was given without paths.")
    if cfg.tokenizer.tokenizer_type == "HuggingFaceTokenizer":
        _need(cfg.tokenizer.tokenizer_model is not None,
              "--tokenizer-type HuggingFaceTokenizer needs --tokenizer-model DIR (a local directory).")
    _positive("--vocab-size", cfg.tokenizer.vocab_size)
    if lg.wandb_project is not None:
        _need(importlib.util.find_spec("wandb") is not None,
              f"--wandb-project={lg.wandb_project} needs the wandb package: pip install wandb "
              f"(or 'megatron-rl[wandb]'), or drop the flag.")
    if lg.tensorboard_dir is not None:
        _need(importlib.util.find_spec("tensorboard") is not None
              or importlib.util.find_spec("tensorboardX") is not None,
              f"--tensorboard-dir={lg.tensorboard_dir} needs the tensorboard package: pip install tensorboard.")


def derive_and_validate(cfg: TrainingConfig, world_size: int, cuda: bool | None = None) -> TrainingConfig:
    """Fill derived fields in place and raise :class:`ConfigError` for settings that cannot work.

    ``cuda``: whether this job runs on CUDA (default: what the runtime would choose).
    """
    if cuda is None:
        from megatron.rl.runtime import cuda_usable

        cuda = cuda_usable()
    _positive("world size", world_size)
    _derive_model(cfg.model, cuda)
    _derive_parallel(cfg, world_size)
    _derive_train(cfg)
    _derive_io(cfg)
    return cfg
