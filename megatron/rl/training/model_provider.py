"""Build megatron-core GPT models from a :class:`~megatron.rl.training.config.TrainingConfig`.

``transformer_config_from_args`` maps our typed flags onto megatron-core's ``TransformerConfig`` (on CPU:
CPU initialisation, no CUDA fusions, ``batch_p2p_comm`` off over gloo);
``build_model`` creates one ``GPTModel`` per virtual-pipeline chunk on this rank, optionally wrapped in
``Float16Module`` (bf16/fp16) and Megatron ``DistributedDataParallel``, and wires the hooks the pipeline
schedules call (``finalize_model_grads_func`` — without it data-parallel gradients are never reduced —
plus ``no_sync_func``/``grad_sync_func``/``param_sync_func`` for overlapped communication).
"""
from __future__ import annotations

import importlib.util
import logging
from typing import Any

import torch
import torch.nn.functional as F

from megatron.rl import runtime
from megatron.rl.training.checkpoint.args import checkpoint_flags
from megatron.rl.training.config import ConfigError, ModelConfig, ParallelConfig, TrainingConfig
from megatron.rl.training.tokenizer import build_tokenizer, padded_vocab_size as pad

log = logging.getLogger(__name__)


def _dtype(model: ModelConfig) -> torch.dtype:
    return torch.bfloat16 if model.bf16 else torch.float16 if model.fp16 else torch.float32


def transformer_config_from_args(model: ModelConfig, parallel: ParallelConfig, *, cuda: bool | None = None,
                                 **overrides: Any):
    """megatron-core ``TransformerConfig`` for our model/parallel flags. ``overrides`` win over derived values.

    ``cuda``: whether kernels run on CUDA (default: the runtime's choice). On CPU all fusions are off and
    weights are initialised on the CPU; on CUDA the Megatron-LM fusions are on where their kernels exist.
    """
    from megatron.core.transformer.transformer_config import TransformerConfig

    if cuda is None:
        cuda = runtime.cuda_usable()
    kw = {**_architecture(model), **_layout_and_kernels(model, parallel, cuda), **_moe(model)}
    kw.update(overrides)
    return TransformerConfig(**kw)


def _architecture(model: ModelConfig) -> dict[str, Any]:
    """The model's shape, activation, norms, biases, dropout and initialisation."""
    return dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        ffn_hidden_size=model.ffn_hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        layernorm_epsilon=model.norm_epsilon,
        add_bias_linear=model.add_bias_linear,
        add_qkv_bias=model.add_qkv_bias,
        qk_layernorm=model.qk_layernorm,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        init_method_std=model.init_method_std,
    )


def _layout_and_kernels(model: ModelConfig, parallel: ParallelConfig, cuda: bool) -> dict[str, Any]:
    """Parallel sizes, numerics, the fused kernels where they can run, and activation recomputation."""
    te = model.transformer_impl == "transformer_engine"
    dtype = _dtype(model)
    return dict(
        # parallelism
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        # numerics
        bf16=model.bf16,
        fp16=model.fp16,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        autocast_dtype=dtype,
        use_cpu_initialization=bool(model.use_cpu_initialization),
        # gloo's batched isend/irecv gives silently wrong activations with the interleaved schedule
        batch_p2p_comm=cuda,
        deallocate_pipeline_outputs=cuda,
        cuda_graph_impl="none",
        # fused kernels: Megatron-LM turns these on by default; they need CUDA (and apex/TE for some)
        bias_activation_fusion=cuda and (model.swiglu or model.add_bias_linear),
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda and te,
        apply_rope_fusion=cuda and te,
        gradient_accumulation_fusion=cuda and (te or importlib.util.find_spec("fused_weight_gradient_mlp_cuda")
                                               is not None),
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        recompute_granularity=model.recompute_granularity,
        recompute_method=model.recompute_method,
        recompute_num_layers=model.recompute_num_layers,
    )


def _moe(model: ModelConfig) -> dict[str, Any]:
    """The experts' settings of a MoE model (none for a dense one)."""
    if model.num_experts is None:
        return {}
    return dict(
        num_moe_experts=model.num_experts,
        moe_router_topk=model.moe_router_topk,
        moe_ffn_hidden_size=model.moe_ffn_hidden_size,
        moe_token_dispatcher_type=model.moe_token_dispatcher_type,
        moe_aux_loss_coeff=model.moe_aux_loss_coeff,
        moe_router_load_balancing_type=model.moe_router_load_balancing_type,
        moe_grouped_gemm=model.moe_grouped_gemm,
        moe_permute_fusion=False,
        moe_router_fusion=False,
    )


def layer_spec(model: ModelConfig):
    """Transformer layer spec: transformer-engine modules for --transformer-impl transformer_engine, else local."""
    from megatron.core.models.gpt import gpt_layer_specs

    if model.transformer_impl == "transformer_engine":
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=model.num_experts, moe_grouped_gemm=model.moe_grouped_gemm, qk_layernorm=model.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(
        num_experts=model.num_experts, moe_grouped_gemm=model.moe_grouped_gemm, qk_layernorm=model.qk_layernorm,
        normalization=model.normalization)


def padded_vocab_size(cfg: TrainingConfig, tokenizer=None) -> int:
    """Model vocab size: --vocab-size or the tokenizer's, padded to a multiple of divisible-by x TP."""
    vocab = cfg.tokenizer.vocab_size
    if vocab is None:

        tokenizer = tokenizer or build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
        vocab = tokenizer.vocab_size
    elif tokenizer is not None and vocab < tokenizer.vocab_size:
        raise ConfigError(f"--vocab-size={vocab} is smaller than the {cfg.tokenizer.tokenizer_type} vocabulary "
                          f"({tokenizer.vocab_size} ids); drop --vocab-size or pass at least {tokenizer.vocab_size}.")

    return pad(vocab, cfg.model.make_vocab_size_divisible_by, cfg.parallel.tensor_model_parallel_size)


def checkpoint_model_args(cfg: TrainingConfig, tokenizer=None) -> dict:
    """``cfg.model_args()`` plus the padded vocab size (checked on load: a checkpoint padded for another
    TP / --make-vocab-size-divisible-by is refused before any tensor is read), what it was padded from, and
    the model-defining flags (``"flags"``, see :mod:`megatron.rl.training.checkpoint.args`)."""

    out = cfg.model_args()
    vocab = cfg.tokenizer.vocab_size
    if vocab is None:

        tokenizer = tokenizer or build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
        vocab = tokenizer.vocab_size
    out["padded_vocab_size"] = padded_vocab_size(cfg, tokenizer)
    out["vocab_padding"] = {"vocab_size": vocab, "make_vocab_size_divisible_by": cfg.model.make_vocab_size_divisible_by,
                            "tensor_model_parallel_size": cfg.parallel.tensor_model_parallel_size}
    out["vocab_size"] = vocab  # what the model was built for, so the checkpoint alone says it (not None)
    out["flags"] = checkpoint_flags(cfg, vocab)  # for --use-checkpoint-args and loading from the checkpoint alone
    return out


def build_gpt_chunk(cfg: TrainingConfig, tconfig, vocab_size: int, vp_stage: int | None = None,
                    pre_process: bool | None = None, post_process: bool | None = None, pg_collection=None):
    """One ``GPTModel`` holding this rank's layers of virtual-pipeline chunk ``vp_stage`` (None: no VPP).

    ``pg_collection``: the model's own process groups (an inference copy with its own layout); None uses
    megatron-core's global ``parallel_state``.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel

    if pre_process is None:
        pre_process = ps.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage)
    if post_process is None:
        post_process = ps.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage)
    m = cfg.model
    return GPTModel(
        config=tconfig,
        transformer_layer_spec=layer_spec(m),
        vocab_size=vocab_size,
        max_sequence_length=m.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=not m.untie_embeddings_and_output_weights,
        position_embedding_type=m.position_embedding_type,
        rotary_percent=m.rotary_percent,
        rotary_base=m.rotary_base,
        rope_scaling=m.use_rope_scaling,
        rope_scaling_factor=m.rope_scaling_factor,
        vp_stage=vp_stage,
        pg_collection=pg_collection,
    )


def ddp_config_from_args(cfg: TrainingConfig):
    from megatron.core.distributed import DistributedDataParallelConfig

    p = cfg.parallel
    return DistributedDataParallelConfig(
        # fp32 grads are free for fp32 models and what Megatron-LM uses with the distributed optimizer
        grad_reduce_in_fp32=p.accumulate_allreduce_grads_in_fp32 or p.use_distributed_optimizer
        or not (cfg.model.bf16 or cfg.model.fp16),
        overlap_grad_reduce=p.overlap_grad_reduce,
        overlap_param_gather=p.overlap_param_gather,
        use_distributed_optimizer=p.use_distributed_optimizer,
    )


def build_model(cfg: TrainingConfig, wrap_with_ddp: bool = True, vocab_size: int | None = None,
                tokenizer=None, **config_overrides: Any) -> list[torch.nn.Module]:
    """Model chunks for this rank: one per virtual-pipeline stage (a one-element list without VPP).

    ``vocab_size``: padded vocab (default :func:`padded_vocab_size`). ``config_overrides`` go to
    :func:`transformer_config_from_args`. Requires :func:`~megatron.rl.training.initialize.initialize_megatron`.
    With ``wrap_with_ddp`` the chunks are Megatron ``DistributedDataParallel`` modules and the config's
    grad-sync hooks are set; otherwise they are bare ``GPTModel`` (or ``Float16Module``) instances.
    """
    from megatron.core import tensor_parallel
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.transformer.module import Float16Module

    if vocab_size is None:
        vocab_size = padded_vocab_size(cfg, tokenizer)
    tconfig = transformer_config_from_args(cfg.model, cfg.parallel, **config_overrides)
    vpp = cfg.parallel.virtual_pipeline_model_parallel_size
    stages = list(range(vpp)) if vpp else [None]
    chunks = [build_gpt_chunk(cfg, tconfig, vocab_size, vp_stage=s) for s in stages]
    for chunk in chunks:
        for param in chunk.parameters():
            tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)

    device = runtime.setup_runtime().device
    if device.type == "cuda":
        chunks = [c.to(device) for c in chunks]
    if cfg.model.bf16 or cfg.model.fp16:
        chunks = [Float16Module(tconfig, c) for c in chunks]
    n_params = sum(p.numel() for c in chunks for p in c.parameters())
    log.info("built GPT: %d chunk(s), %.2fM parameters on this rank, padded vocab %d, spec %s", len(chunks),
             n_params / 1e6, vocab_size, cfg.model.transformer_impl)
    tconfig.finalize_model_grads_func = finalize_model_grads
    if not wrap_with_ddp:
        return chunks
    ddp_config = ddp_config_from_args(cfg)
    chunks = [DistributedDataParallel(config=tconfig, ddp_config=ddp_config, module=c,
                                      # only the first chunk's buckets may be delayed (Megatron-LM's rule)
                                      disable_bucketing=i > 0)
              for i, c in enumerate(chunks)]
    attach_grad_sync_hooks(chunks, tconfig, cfg)
    return chunks


def attach_grad_sync_hooks(chunks: list, tconfig, cfg: TrainingConfig) -> None:
    """Set the hooks megatron-core's schedules call around backward passes (as Megatron-LM does)."""
    from megatron.core.distributed import finalize_model_grads

    tconfig.finalize_model_grads_func = finalize_model_grads
    p = cfg.parallel
    if p.overlap_grad_reduce:
        funcs = [c.no_sync for c in chunks]
        tconfig.no_sync_func = funcs[0] if len(funcs) == 1 else funcs
        grad_sync = [c.start_grad_sync for c in chunks]
        tconfig.grad_sync_func = grad_sync[0] if len(grad_sync) == 1 else grad_sync
    if p.overlap_param_gather:
        param_sync = [c.start_param_sync for c in chunks]
        tconfig.param_sync_func = param_sync[0] if len(param_sync) == 1 else param_sync


def unwrap_model(chunks: list) -> list:
    """The ``GPTModel`` inside each chunk (strips DDP and Float16Module)."""
    from megatron.core.utils import unwrap_model as mcore_unwrap

    return mcore_unwrap(list(chunks))


def model_config(chunks: list):
    """The shared ``TransformerConfig`` of the chunks."""
    from megatron.core.utils import get_model_config

    return get_model_config(chunks[0])
