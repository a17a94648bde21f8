"""The constructor calls of megatron-core's dynamic inference stack, for each supported release.

The only module that calls the constructors of ``DynamicInferenceContext``, ``GPTInferenceWrapper``,
``TextGenerationController`` and ``DynamicInferenceEngine`` (or subclasses of ours). Their signatures changed
between 0.16.1 and 0.19 (:data:`megatron.rl.runtime.versions.DIFFERENCES`); callers pass the same
:class:`ContextSizes` and get the same objects on either.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any

import torch

from megatron.rl.base.errors import RLError
from megatron.rl.runtime import versions

__all__ = ["ContextSizes", "make_context", "make_wrapper", "make_controller", "make_engine", "free_context",
           "last_token_logits_only", "block_allocator"]


@dataclasses.dataclass(frozen=True)
class ContextSizes:
    """What the context is sized by (the same on every release)."""

    num_layers: int
    max_sequence_length: int
    buffer_size_gb: float
    block_size_tokens: int
    max_tokens: int
    max_requests: int


def make_context(cls: type, model_config: Any, sizes: ContextSizes, pg_collection: Any = None,
                 prefix_caching: bool = False) -> Any:
    """A ``cls`` (``DynamicInferenceContext`` or a subclass) for a model of ``model_config``, one logits row per
    request (``materialize_only_last_token_logits``), no CUDA graphs, no unified memory. ``prefix_caching``:
    megatron-core's own sharing of whole prompt KV blocks between requests (0.19's ``enable_prefix_caching``;
    0.16.1 has none). A prompt longer than a step (``max_tokens``) is prefilled in chunks on both releases (0.16.1's
    engine does so by default, 0.19's only when its config enables chunked prefill)."""
    if not versions.is_0_19():
        if prefix_caching:
            raise RLError(f"megatron-core {versions.installed_version()} has no prefix caching; "
                          f"prompt sharing there is SharedPromptPrefill's")
        return cls(params_dtype=model_config.params_dtype, num_layers=sizes.num_layers,
                   kv_channels=model_config.kv_channels,
                   num_attention_heads=model_config.num_query_groups or model_config.num_attention_heads,
                   max_sequence_length=sizes.max_sequence_length, buffer_size_gb=sizes.buffer_size_gb,
                   block_size_tokens=sizes.block_size_tokens, max_tokens=sizes.max_tokens,
                   max_requests=sizes.max_requests, num_cuda_graphs=None,
                   materialize_only_last_token_logits=True, unified_memory_level=0, pg_collection=pg_collection)
    from megatron.core.inference.config import InferenceConfig  # 0.19 only

    config = InferenceConfig(block_size_tokens=sizes.block_size_tokens, buffer_size_gb=sizes.buffer_size_gb,
                             max_requests=sizes.max_requests, max_tokens=sizes.max_tokens,
                             max_sequence_length=sizes.max_sequence_length, num_cuda_graphs=None,
                             unified_memory_level=0, materialize_only_last_token_logits=True,
                             enable_prefix_caching=prefix_caching, enable_chunked_prefill=True,
                             pg_collection=pg_collection)
    # 0.19 works out this rank's layers (pipeline stage) from the model's config and the groups itself.
    return cls(_without_inference_dispatcher(model_config), config)


def _without_inference_dispatcher(model_config: Any) -> Any:
    """``model_config`` as 0.19's context should read it for a model megatron-rl built.

    With expert parallelism 0.19's context allocates the buffers of the inference-only MoE token dispatcher named by
    ``inference_moe_token_dispatcher_type`` (NVLS symmetric memory by default, which fails on a CPU) whatever the
    model. Only ``transformer_impl="inference_optimized"`` layers use that dispatcher; megatron-rl builds local or
    Transformer Engine layers, which dispatch with their training dispatcher. The context gets a shallow copy that
    names no inference dispatcher; the model's own config is unchanged."""
    if model_config.transformer_impl == "inference_optimized" or not model_config.num_moe_experts:
        return model_config
    context_view = copy.copy(model_config)
    context_view.inference_moe_token_dispatcher_type = None
    return context_view


def make_wrapper(model: torch.nn.Module, model_config: Any, context: Any, padded_vocab_size: int,
                 max_sequence_length: int, pg_collection: Any = None) -> Any:
    """``GPTInferenceWrapper`` around ``model`` (its weights in place) reading ``context``."""
    from megatron.core.inference.model_inference_wrappers.gpt.gpt_inference_wrapper import GPTInferenceWrapper

    if versions.is_0_19():
        return GPTInferenceWrapper(model, context)
    from megatron.core.inference.model_inference_wrappers.inference_wrapper_config import (  # 0.16 only
        InferenceWrapperConfig,
    )

    wrapper_config = InferenceWrapperConfig(
        hidden_size=model_config.hidden_size, params_dtype=model_config.params_dtype,
        inference_batch_times_seqlen_threshold=-1, padded_vocab_size=padded_vocab_size,
        inference_max_requests=context.max_requests, inference_max_seq_length=max_sequence_length,
        fp32_residual_connection=model_config.fp32_residual_connection)
    return GPTInferenceWrapper(model, wrapper_config, context, pg_collection=pg_collection)


def make_controller(cls: type, wrapped: Any, tokenizer: Any, pg_collection: Any = None, **kwargs: Any) -> Any:
    """A ``cls`` (a ``TextGenerationController`` subclass); 0.19 takes the pipeline group from the context's
    config, 0.16 as an argument. ``kwargs`` go to ``cls``."""
    if versions.is_0_19():
        return cls(wrapped, tokenizer, **kwargs)
    return cls(wrapped, tokenizer, pp_group=None if pg_collection is None else pg_collection.pp, **kwargs)


def make_engine(cls: type, controller: Any, context: Any, seed: int, pg_collection: Any = None) -> Any:
    """A ``cls`` (a ``DynamicInferenceEngine`` subclass) stepping ``context`` with ``controller``; 0.19 takes no
    seed (our controller samples with its own generators, seeded from ``seed``) and no process groups."""
    if versions.is_0_19():
        return cls(controller, context)
    return cls(controller, context, random_seed=seed, pg_collection=pg_collection)


def free_context(context: Any) -> None:
    """Free ``context``'s KV cache and step tensors now, even if something still holds the context (0.19 keeps
    them for the context's life: its deallocation is a suspend that persists the cache)."""
    if not versions.is_0_19():
        context.deallocate_all_tensors()
        return
    keep = getattr(context, "keep_memory_buffer", None)  # EngineSettings.keep_cpu_kv_buffer (engine/kv_reuse.py)
    if keep is not None:
        keep()
    context.memory_buffer = None
    context.is_tensor_state_allocated = False


def last_token_logits_only(context: Any) -> bool:
    """Whether the context's forward returns one logits row per request (the setting moved to its config in 0.19)."""
    config = getattr(context, "config", None)
    return bool(getattr(config, "materialize_only_last_token_logits", None)
                if versions.is_0_19() else context.materialize_only_last_token_logits)


def block_allocator(context: Any) -> Any:
    """The context's KV block allocator (renamed ``kv_block_allocator`` in 0.19)."""
    return context.kv_block_allocator if versions.is_0_19() else context.block_allocator
