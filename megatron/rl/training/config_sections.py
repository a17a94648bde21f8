"""The typed sections of :class:`TrainingConfig`: every Megatron-LM flag is declared here, once, on its field.

Field names equal the argparse destinations (``--num-layers`` -> ``num_layers``); the parser is generated
from the fields (:mod:`megatron.rl.base.flags`, which also says how to add a flag). A field declared
``flag(None, ...)`` whose help says "default ..." is resolved from other flags by
:func:`megatron.rl.training.config.parse_args` into a new frozen config; ``derived()`` fields have no flag.
"""
from __future__ import annotations

import argparse
import dataclasses

from megatron.rl.base.flags import derived, flag, section

__all__ = ["ModelConfig", "ParallelConfig", "OptimConfig", "TrainConfig", "CheckpointConfig", "LoggingConfig",
           "TokenizerConfig", "DataConfig", "TrainingConfig"]

_MOE = "mixture of experts"


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Architecture and numerics of the GPT (everything that shapes the weights, plus precision)."""

    _flag_group = "model"

    num_layers: int = flag()
    hidden_size: int = flag()
    num_attention_heads: int = flag()
    ffn_hidden_size: int | None = flag(None, help="default 4*hidden (SwiGLU: 8/3*hidden rounded down to 64)")
    num_query_groups: int | None = flag(None, help="KV head groups; only used with --group-query-attention")
    group_query_attention: bool = flag(False)
    kv_channels: int | None = flag(None, help="per-head dim; default hidden/heads")
    seq_length: int = flag(1024)
    max_position_embeddings: int | None = flag(None, help="default --seq-length")
    swiglu: bool = flag(False)
    normalization: str = flag("LayerNorm", choices=["LayerNorm", "RMSNorm"])
    norm_epsilon: float = flag(1e-5)
    position_embedding_type: str = flag("learned_absolute", choices=["rope", "learned_absolute", "none"])
    rotary_base: int = flag(10000)
    rotary_percent: float = flag(1.0)
    # Llama-3.x RoPE frequency scaling (megatron-core's rope_scaling)
    use_rope_scaling: bool = flag(False, help="Llama-3.x RoPE frequency scaling")
    rope_scaling_factor: float = flag(8.0, help="with --use-rope-scaling")
    untie_embeddings_and_output_weights: bool = flag(False)
    add_qkv_bias: bool = flag(False)
    disable_bias_linear: bool = flag(False)
    qk_layernorm: bool = flag(False)
    make_vocab_size_divisible_by: int = flag(128)
    hidden_dropout: float = flag(0.1)
    attention_dropout: float = flag(0.1)
    init_method_std: float = flag(0.02)
    num_experts: int | None = flag(None, group=_MOE)
    moe_router_topk: int = flag(2, group=_MOE)
    moe_ffn_hidden_size: int | None = flag(None, group=_MOE, help="default --ffn-hidden-size")
    moe_token_dispatcher_type: str = flag("allgather", group=_MOE, choices=["allgather", "alltoall", "flex"])
    moe_aux_loss_coeff: float = flag(0.0, group=_MOE)
    moe_router_load_balancing_type: str = flag("aux_loss", group=_MOE,
                                               choices=["aux_loss", "seq_aux_loss", "sinkhorn", "none"])
    moe_grouped_gemm: bool = flag(False, group=_MOE)
    transformer_impl: str | None = flag(None, choices=["local", "transformer_engine"],
                                        help="default: transformer_engine when importable on a CUDA machine, "
                                             "else local")
    use_cpu_initialization: bool | None = flag(
        None, help="initialise weights on CPU (default on CPU runs; makes TP init equal to TP=1)")
    bf16: bool = flag(False)
    fp16: bool = flag(False)
    recompute_granularity: str | None = flag(None, choices=["full", "selective"])
    recompute_method: str | None = flag(None, choices=["uniform", "block"])
    recompute_num_layers: int | None = flag(None)

    @property
    def add_bias_linear(self) -> bool:
        return not self.disable_bias_linear


@dataclasses.dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout. ``world_size``, ``data_parallel_size`` and the virtual pipeline size are derived."""

    _flag_group = "parallelism"

    tensor_model_parallel_size: int = flag(1)
    pipeline_model_parallel_size: int = flag(1)
    num_layers_per_virtual_pipeline_stage: int | None = flag(None)
    expert_model_parallel_size: int = flag(1)
    expert_tensor_parallel_size: int | None = flag(None, help="default --tensor-model-parallel-size")
    sequence_parallel: bool = flag(False)
    use_distributed_optimizer: bool = flag(False)
    overlap_grad_reduce: bool = flag(False)
    overlap_param_gather: bool = flag(False)
    accumulate_allreduce_grads_in_fp32: bool = flag(False)
    world_size: int = derived(1)                # $WORLD_SIZE
    data_parallel_size: int = derived(1)        # world / (TP * PP)
    virtual_pipeline_model_parallel_size: int | None = derived(None)  # from --num-layers-per-virtual-pipeline-stage


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    _flag_group = "training"

    micro_batch_size: int = flag(1)
    global_batch_size: int | None = flag(None, help="default micro-batch-size * data-parallel size")
    train_iters: int | None = flag(None)
    seed: int = flag(1234)
    eval_interval: int | None = flag(None)
    eval_iters: int = flag(0)
    exit_interval: int | None = flag(None)
    # save and exit cleanly on --exit-signal (Slurm preemption)
    exit_signal_handler: bool = flag(False, help="on --exit-signal: finish the iteration, save (with --save) and "
                                                 "exit 0")
    exit_signal: str = flag("SIGTERM", choices=["SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2"])
    cpu_threads: str = flag("auto", help="torch's CPU threads per process: 'auto' (the usable cores, fewer while "
                                         "other processes keep cores busy; OMP_NUM_THREADS fixes it) or a number. "
                                         "Ignored on GPUs.")
    cpu_malloc: str = flag("keep", choices=["keep", "system"],
                           help="glibc malloc on CPU runs: 'keep' reuses freed memory (blocks up to 1 GiB from the "
                                "heap, no trimming: a training step's large tensors are not faulted in afresh; the "
                                "resident memory stays at its peak), 'system' leaves glibc's defaults. A preloaded "
                                "allocator or glibc's malloc tuning variables (MALLOC_ARENA_MAX, ...) win. Ignored on GPUs.")
    num_microbatches: int = derived(1)          # global / (micro * DP), per DP rank per iteration


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """Optimizer and learning-rate / weight-decay schedule."""

    _flag_group = "optimizer"

    optimizer: str = flag("adam", choices=["adam", "sgd"])
    lr: float | None = flag(None)
    min_lr: float = flag(0.0)
    lr_decay_style: str = flag("linear", choices=["constant", "linear", "cosine", "inverse-square-root", "WSD"])
    lr_warmup_iters: int = flag(0)
    lr_warmup_init: float = flag(0.0)
    lr_decay_iters: int | None = flag(None, help="default --train-iters")
    lr_wsd_decay_iters: int | None = flag(None)
    lr_wsd_decay_style: str = flag("exponential", choices=["exponential", "linear", "cosine", "minus_sqrt"])
    weight_decay: float = flag(0.01)
    start_weight_decay: float | None = flag(None)     # default --weight-decay
    end_weight_decay: float | None = flag(None)       # default --weight-decay
    weight_decay_incr_style: str = flag("constant", choices=["constant", "linear", "cosine"])
    adam_beta1: float = flag(0.9)
    adam_beta2: float = flag(0.999)
    adam_eps: float = flag(1e-8)
    sgd_momentum: float = flag(0.9)
    clip_grad: float = flag(1.0)
    loss_scale: float | None = flag(None, help="fp16 static loss scale (default: dynamic)")
    initial_loss_scale: float = flag(2.0 ** 32)
    min_loss_scale: float = flag(1.0)
    loss_scale_window: int = flag(1000)
    hysteresis: int = flag(2)
    override_opt_param_scheduler: bool = flag(False)
    use_checkpoint_opt_param_scheduler: bool = flag(False)


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
    _flag_group = "checkpointing"

    save: str | None = flag(None)
    load: str | None = flag(None)
    save_interval: int | None = flag(None)
    pretrained_checkpoint: str | None = flag(None)
    finetune: bool = flag(False, help="load model weights only; reset iteration, optimizer and RNG")
    no_load_optim: bool = flag(False)
    no_load_rng: bool = flag(False)
    no_save_optim: bool = flag(False)
    no_save_rng: bool = flag(False)
    ckpt_format: str = flag("torch_dist", choices=["torch_dist"])
    dist_ckpt_optim_format: str = flag("fully_reshardable", choices=["fully_reshardable", "dp_reshardable"])
    # which checkpoints of --save to keep (megatron/rl/training/checkpoint/retention.py)
    save_retain_last: int | None = flag(
        None, help="after each save keep only the newest N checkpoints (with --save-retain-best: and the best ones); "
                   "the one a run would resume from is never deleted. Default: keep every checkpoint")
    save_retain_best: list[str] | None = flag(
        None, nargs=2, metavar=("METRIC", "N"),
        help="after each save keep the N checkpoints with the highest METRIC measured at their own iteration "
             "(e.g. eval/pass@1; min:NAME keeps the lowest), besides --save-retain-last's and the latest")
    # model flags filled from the checkpoint (megatron/rl/training/checkpoint/args.py)
    use_checkpoint_args: bool = flag(
        False, help="take the model flags (architecture, tokenizer, vocab, lengths) stored in the checkpoint of "
                    "--load (else --pretrained-checkpoint), and an RL run's generation and environment flags; an "
                    "explicit model flag that conflicts is an error, an explicit RL flag wins")
    # checkpoint integrity: skip the checksum manifest check on load
    no_verify_checkpoint_checksums: bool = flag(
        False, help="load without checking the checkpoint's files against the checksum manifest written at save "
                    "(for huge checkpoints on trusted storage); loaded values are still scanned for NaN/Inf")
    # a tracker behind complete checkpoints of later iterations is refused; this loads the newest instead
    load_newest_checkpoint: bool = flag(
        False, help="when latest_checkpointed_iteration.txt names an older iteration than complete checkpoints "
                    "present, load the newest of them (with a warning) instead of refusing")


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    _flag_group = "logging"

    log_interval: int = flag(100)
    tensorboard_dir: str | None = flag(None)
    tensorboard_log_interval: int = flag(1)
    wandb_project: str | None = flag(None)
    wandb_exp_name: str | None = flag(None)
    wandb_save_dir: str | None = flag(None)
    log_level: str = flag("INFO", choices=["DEBUG", "INFO", "WARNING", "ERROR"])


@dataclasses.dataclass(frozen=True)
class TokenizerConfig:
    _flag_group = "tokenizer"

    tokenizer_type: str = flag("ByteLevelTokenizer")
    tokenizer_model: str | None = flag(None)
    vocab_size: int | None = flag(None, help="unpadded vocab size to use instead of the tokenizer's")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    _flag_group = "data"

    data_path: list[str] | None = flag(None, nargs="*")
    mock_data: bool = flag(False)
    split: str = flag("969,30,1")
    data_cache_path: str | None = flag(None)
    num_workers: int = flag(0)


@dataclasses.dataclass(frozen=True)
class TrainingConfig:
    """Everything parsed from the command line, resolved and frozen. Pass it (or its sections) down
    explicitly; no globals. ``extra``: flags of ``extra_args_providers`` (e.g. the RL flags)."""

    model: ModelConfig = section(ModelConfig)
    parallel: ParallelConfig = section(ParallelConfig)
    train: TrainConfig = section(TrainConfig)
    optim: OptimConfig = section(OptimConfig)
    checkpoint: CheckpointConfig = section(CheckpointConfig)
    logging: LoggingConfig = section(LoggingConfig)
    tokenizer: TokenizerConfig = section(TokenizerConfig)
    data: DataConfig = section(DataConfig)
    extra: argparse.Namespace = derived(default_factory=argparse.Namespace)
    argv: list[str] = derived(default_factory=list)
    # the flags --use-checkpoint-args took from the checkpoint ("--option value" each), for the start-up summary
    checkpoint_args: tuple[str, ...] = derived(())

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
