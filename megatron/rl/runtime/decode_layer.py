"""A decode step's transformer layer without megatron-core's per-layer glue (a registered CPU patch).

In a decode-only step of the dynamic engine a plain layer computes: input norm, QKV, RoPE of K, KV append, RoPE of
Q, paged attention, output projection, bias-dropout-add; pre-MLP norm, MLP, bias-dropout-add. :func:`install`
wraps ``TransformerLayer.forward`` so that such a step makes exactly those calls, to the same modules and context
methods in the same order (the same bits, tested), and skips the rest (offload managers, NVTX ranges, recompute,
fused-kernel and cross-attention branches, einops).
Must not: apply while training, outside ``torch.inference_mode``, to prefill or mixed steps, or to a layer whose
megatron-core path does more (:func:`plain_layer`): those run megatron-core's forward. Figures: docs/benchmarks.md.
"""
from __future__ import annotations

import weakref

import torch
from torch.nn.modules import module as torch_module

from megatron.rl.runtime import packed_linear

__all__ = ["install", "original", "plain_layer", "split_glu", "decode_forward"]

_ORIGINAL: dict[str, object] = {}
_PLAIN: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer -> whether plain_layer holds
_SPLIT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # MLP -> whether split_glu holds

# Layer, attention and config attributes that each send megatron-core's forward down another path.
_LAYER_OFF = ("recompute_input_layernorm", "recompute_pre_mlp_layernorm", "recompute_mlp", "offload_attn_norm",
              "offload_mlp_norm", "is_moe_layer")
_ATTENTION_OFF = ("offload_qkv_linear", "offload_attn_proj", "offload_core_attention", "batch_invariant_mode")
_CONFIG_OFF = ("flash_decode", "attention_output_gate", "multi_latent_attention", "no_rope_freq", "fp8", "fp4",
               "cache_mla_latents", "inference_fuse_tp_communication", "fp32_residual_connection", "window_size",
               "test_mode")


def install() -> None:
    """Wrap ``TransformerLayer.forward`` (idempotent). Called by the CPU layer's patch registry."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    if _ORIGINAL:
        return
    _ORIGINAL["forward"] = TransformerLayer.forward

    def forward(self, *args, **kwargs):
        if len(args) == 1 and "hidden_states" not in kwargs:
            kwargs = {**kwargs, "hidden_states": args[0]}
            args = ()
        if args or not _applies(self, kwargs):
            return _ORIGINAL["forward"](self, *args, **kwargs)
        return decode_forward(self, **kwargs)

    TransformerLayer.forward = forward


def original():
    """The ``TransformerLayer.forward`` that :func:`install` wrapped: for tests."""
    return _ORIGINAL["forward"]


def _applies(layer, kwargs: dict) -> bool:
    context = kwargs.get("inference_context")
    return (context is not None and not layer.training and torch.is_inference_mode_enabled()
            and kwargs.get("packed_seq_params") is None and kwargs.get("attention_bias") is None
            and kwargs.get("context") is None and not context.is_static_batching() and context.is_decode_only()
            and not getattr(context, "use_flashinfer_fused_rope", False) and plain_layer(layer))


def plain_layer(layer) -> bool:
    """Whether megatron-core's forward of ``layer`` in a decode step is the calls :func:`decode_forward` makes:
    self-attention with a dense MLP, megatron-core's bias-dropout-add, no cross-attention, and none of the options
    that change the path (recompute, offload, MoE, flash decode, output gate, MLA, attention sinks, fp8...)."""
    known = _PLAIN.get(layer)
    if known is None:
        known = _PLAIN[layer] = _is_plain(layer)
    return known


def _is_plain(layer) -> bool:
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.attention import SelfAttention
    from megatron.core.transformer.identity_op import IdentityFuncOp, IdentityOp
    from megatron.core.transformer.mlp import MLP

    attention, config = getattr(layer, "self_attention", None), layer.config
    sink = getattr(attention, "_get_inference_softmax_offset", None)
    return (type(attention) is SelfAttention and type(getattr(layer, "mlp", None)) is MLP
            and isinstance(layer.pre_cross_attn_layernorm, IdentityOp) and isinstance(layer.cross_attention, IdentityOp)
            and isinstance(layer.cross_attn_bda, IdentityFuncOp)
            and layer.self_attn_bda is get_bias_dropout_add and layer.mlp_bda is get_bias_dropout_add
            and not any(getattr(layer, name, False) for name in _LAYER_OFF)
            and not any(getattr(attention, name, False) for name in _ATTENTION_OFF)
            and not any(getattr(config, name, None) for name in _CONFIG_OFF)
            and (sink is None or sink() is None))


def decode_forward(layer, hidden_states, inference_context, rotary_pos_emb=None, **_):
    """megatron-core's ``TransformerLayer.forward`` of a decode step of a :func:`plain_layer`: ``(output, None)``."""
    residual, normed = _norm(layer.input_layernorm, hidden_states)
    hidden = _bias_add(*_attention(layer.self_attention, normed, inference_context, rotary_pos_emb), residual)
    residual, normed = _norm(layer.pre_mlp_layernorm, hidden)
    return _bias_add(*_mlp(layer.mlp, normed), residual), None


def _mlp(mlp, hidden):
    """megatron-core's ``MLP.forward``; a :func:`split_glu` MLP computes its first product as two, the gate's half and
    the linear half, into the two halves of the one output megatron-core's product writes (each output element is
    the same dot product: the same bits), then the GLU of megatron-core's unfused branch on that output."""
    if packed_linear.current() is not None or not split_glu(mlp) or _hooked(mlp) or _hooked(mlp.linear_fc1):
        return mlp(hidden)
    weight = mlp.linear_fc1.weight
    half = weight.shape[0] // 2
    rows = hidden.reshape(-1, hidden.shape[-1])
    both = rows.new_empty(rows.shape[0], weight.shape[0])
    torch.mm(rows, weight[:half].t(), out=both[:, :half])
    torch.mm(rows, weight[half:].t(), out=both[:, half:])
    x_glu, x_linear = torch.chunk(both.view(*hidden.shape[:-1], -1), 2, dim=-1)
    config = mlp.config
    return mlp.linear_fc2(config.activation_func(x_glu) * (x_linear + config.glu_linear_offset))


def _hooked(module) -> bool:
    """Whether calling ``module`` would run forward hooks (its own or global ones: megatron-core's DDP waits for a
    parameter all-gather in one), which the halves would skip."""
    return bool(module._forward_pre_hooks or module._forward_hooks
                or getattr(torch_module, "_global_forward_pre_hooks", None)
                or getattr(torch_module, "_global_forward_hooks", None))


def split_glu(mlp) -> bool:
    """Whether :func:`_mlp` computes ``mlp``'s first product in halves: a gated MLP through megatron-core's unfused
    activation (no fused bias-activation kernel, no clamp, no TE activation) whose first layer is a local
    ``ColumnParallelLinear`` without bias, sequence parallelism or offloading (its product, with or without a
    gradient to its weight, is ``torch.matmul(input, weight.t())``). The halves took less time than the whole where
    measured (docs/benchmarks.md)."""
    known = _SPLIT.get(mlp)
    if known is None:
        known = _SPLIT[mlp] = _is_split_glu(mlp)
    return known


def _is_split_glu(mlp) -> bool:
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear

    config, fc1 = mlp.config, mlp.linear_fc1
    return (config.gated_linear_unit and not config.bias_activation_fusion
            and not getattr(config, "use_te_activation_func", False)
            and getattr(config, "activation_func_clamp_value", None) is None
            and type(fc1) is ColumnParallelLinear and fc1.bias is None and fc1.weight is not None
            and fc1.weight.shape[0] % 2 == 0 and not fc1.sequence_parallel and not fc1.gather_output
            and not fc1.explicit_expert_comm and not config.defer_embedding_wgrad_compute
            and config._cpu_offloading_context is None and "_forward_impl" not in vars(fc1))


def _norm(norm, hidden):
    """(residual, normed): a norm may return its own residual with its output (0.19's fused norms)."""
    out = norm(hidden)
    if isinstance(out, tuple):
        out, hidden = out
    return hidden, out


def _bias_add(out, bias, residual):
    """megatron-core's bias-dropout-add in eval under inference mode: in place, the bias first, dropout the
    identity, then the residual (cast to the output's dtype)."""
    if bias is not None:
        out.add_(bias)
    return out.add_(residual if residual.dtype == out.dtype else residual.to(out.dtype))


def _attention(attention, hidden, context, rotary_pos_emb):
    """Self-attention of a decode step against the paged KV cache, as megatron-core's ``Attention.forward`` orders
    it: RoPE of the keys, their append, RoPE of the queries, the decode kernel, the output projection."""
    query, key, value = attention.get_query_key_value_tensors(hidden, None)
    layer = attention.layer_number - attention._get_pp_layer_offset_for_inference()
    cp = attention.pg_collection.cp
    # 0.19 passes YaRN's concentration factor to both rotations; 0.16.1 has none
    extra = ({"mscale": attention._yarn_concentration_factor}
             if hasattr(attention, "_yarn_concentration_factor") else {})
    query_emb = None
    if rotary_pos_emb is not None:
        query_emb, key_emb = rotary_pos_emb if isinstance(rotary_pos_emb, tuple) else (rotary_pos_emb,) * 2
        key = context.apply_rotary_emb_key(key, key_emb, attention.config, cp, **extra)
    context.append_key_value_cache(layer, key, value)
    key, value, block_table = context.key_value_cache(layer)
    if query_emb is not None:
        query = context.apply_rotary_emb_query(query, query_emb, attention.config, None, cp, **extra)
    cu_query_lengths, max_query = context.cu_query_lengths()
    cu_key_lengths, key_lengths, max_key = context.cu_kv_lengths()
    out = attention.flash_decode_and_prefill(query, key, value, max_query, max_key, cu_query_lengths,
                                             cu_key_lengths, key_lengths, block_table, True)
    return attention.linear_proj(out.reshape(out.shape[0], out.shape[1], -1))
