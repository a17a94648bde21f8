"""Hugging Face (Llama/Qwen2/Qwen3) state-dict names <-> megatron-core ``GPTModel`` state-dict names.

Megatron names are those of ``GPTModel.state_dict()`` built with the *local* layer spec at TP=1
(``decoder.layers.{i}.input_layernorm.weight``, ``...self_attention.linear_qkv.weight``, ...). The
torch_dist checkpoint stores them under transformer-engine-compatible keys (megatron-core's local spec
maps ``input_layernorm.`` to ``self_attention.linear_qkv.layer_norm_``), so a checkpoint written from the
local spec loads into either spec at any TP/PP.
"""
from __future__ import annotations

from typing import Callable, Iterator

import torch

from tools.checkpoint_conversion.families import ArchSpec
from tools.checkpoint_conversion.layout import fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab

TensorGetter = Callable[[str], torch.Tensor]

_HF_LAYER = "model.layers.{i}."
_MC_LAYER = "decoder.layers.{i}."

# one-to-one per-layer names (HF suffix, Megatron suffix)
_LAYER_DIRECT = (("input_layernorm.weight", "input_layernorm.weight"),
                 ("self_attn.o_proj.weight", "self_attention.linear_proj.weight"),
                 ("post_attention_layernorm.weight", "pre_mlp_layernorm.weight"),
                 ("mlp.down_proj.weight", "mlp.linear_fc2.weight"))
_QK_NORM = (("self_attn.q_norm.weight", "self_attention.q_layernorm.weight"),
            ("self_attn.k_norm.weight", "self_attention.k_layernorm.weight"))


def hf_tensor_names(spec: ArchSpec) -> list[str]:
    """Every tensor name a Hugging Face checkpoint of ``spec`` holds (the expected key set)."""
    names = ["model.embed_tokens.weight", "model.norm.weight"]
    if not spec.tied_embeddings:
        names.append("lm_head.weight")
    for i in range(spec.num_layers):
        p = _HF_LAYER.format(i=i)
        names += [p + hf for hf, _ in _LAYER_DIRECT if not (spec.num_experts and hf.startswith("mlp."))]
        names += [p + f"self_attn.{x}_proj.weight" for x in "qkv"]
        if spec.num_experts:
            names.append(p + "mlp.gate.weight")
            names += [p + f"mlp.experts.{e}.{x}_proj.weight" for e in range(spec.num_experts)
                      for x in ("gate", "up", "down")]
        else:
            names += [p + f"mlp.{x}_proj.weight" for x in ("gate", "up")]
        if spec.qkv_bias:
            names += [p + f"self_attn.{x}_proj.bias" for x in "qkv"]
        if spec.qk_norm:
            names += [p + hf for hf, _ in _QK_NORM]
    return names


def iter_hf_to_megatron(get: TensorGetter, spec: ArchSpec, padded_vocab: int) -> Iterator[tuple[str, torch.Tensor]]:
    """``(megatron name, TP=1 global tensor)`` pairs from Hugging Face tensors fetched by name with ``get``.

    A generator, so a converter can copy each tensor into the model and drop it: with a lazy safetensors
    reader, peak memory is the model plus one layer's worth of temporaries. Embedding/output rows are
    zero-padded from ``spec.vocab_size`` to ``padded_vocab``.
    """
    yield "embedding.word_embeddings.weight", pad_vocab(get("model.embed_tokens.weight"), padded_vocab)
    for i in range(spec.num_layers):
        h, m = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
        for hf, mc in _LAYER_DIRECT:
            if not (spec.num_experts and hf.startswith("mlp.")):  # expert MLPs are mapped below
                yield m + mc, get(h + hf)
        yield m + "self_attention.linear_qkv.weight", fuse_qkv(
            *(get(h + f"self_attn.{x}_proj.weight") for x in "qkv"), spec.num_heads, spec.num_groups)
        if spec.qkv_bias:
            yield m + "self_attention.linear_qkv.bias", fuse_qkv(
                *(get(h + f"self_attn.{x}_proj.bias") for x in "qkv"), spec.num_heads, spec.num_groups)
        if spec.qk_norm:
            for hf, mc in _QK_NORM:
                yield m + mc, get(h + hf)
        if spec.num_experts:
            yield m + "mlp.router.weight", get(h + "mlp.gate.weight")
            for e in range(spec.num_experts):
                he, me = h + f"mlp.experts.{e}.", m + f"mlp.experts.local_experts.{e}."
                yield me + "linear_fc1.weight", fuse_gate_up(get(he + "gate_proj.weight"), get(he + "up_proj.weight"))
                yield me + "linear_fc2.weight", get(he + "down_proj.weight")
        else:
            yield m + "mlp.linear_fc1.weight", fuse_gate_up(get(h + "mlp.gate_proj.weight"),
                                                            get(h + "mlp.up_proj.weight"))
    yield "decoder.final_layernorm.weight", get("model.norm.weight")
    if not spec.tied_embeddings:
        yield "output_layer.weight", pad_vocab(get("lm_head.weight"), padded_vocab)


def hf_to_megatron(get: TensorGetter, spec: ArchSpec, padded_vocab: int) -> dict[str, torch.Tensor]:
    """Megatron state dict (TP=1 global tensors) from Hugging Face tensors; see :func:`iter_hf_to_megatron`."""
    return dict(iter_hf_to_megatron(get, spec, padded_vocab))


def megatron_to_hf(mc: dict[str, torch.Tensor], spec: ArchSpec) -> dict[str, torch.Tensor]:
    """Hugging Face state dict from a Megatron TP=1 state dict (padded vocab rows dropped).

    Tied models get no ``lm_head.weight`` (Hugging Face ties it to ``model.embed_tokens.weight`` on load).
    """
    def take(name: str) -> torch.Tensor:
        if name not in mc:
            raise KeyError(f"Megatron state dict has no {name!r} (does the checkpoint match the model flags?)")
        return mc[name]

    out = {"model.embed_tokens.weight": unpad_vocab(take("embedding.word_embeddings.weight"), spec.vocab_size),
           "model.norm.weight": take("decoder.final_layernorm.weight")}
    if not spec.tied_embeddings:
        out["lm_head.weight"] = unpad_vocab(take("output_layer.weight"), spec.vocab_size)
    for i in range(spec.num_layers):
        h, m = _HF_LAYER.format(i=i), _MC_LAYER.format(i=i)
        for hf, mcn in _LAYER_DIRECT:
            if not (spec.num_experts and hf.startswith("mlp.")):
                out[h + hf] = take(m + mcn)
        q, k, v = split_qkv(take(m + "self_attention.linear_qkv.weight"), spec.num_heads, spec.num_groups)
        out.update({h + "self_attn.q_proj.weight": q, h + "self_attn.k_proj.weight": k,
                    h + "self_attn.v_proj.weight": v})
        if spec.qkv_bias:
            q, k, v = split_qkv(take(m + "self_attention.linear_qkv.bias"), spec.num_heads, spec.num_groups)
            out.update({h + "self_attn.q_proj.bias": q, h + "self_attn.k_proj.bias": k,
                        h + "self_attn.v_proj.bias": v})
        if spec.qk_norm:
            for hf, mcn in _QK_NORM:
                out[h + hf] = take(m + mcn)
        if spec.num_experts:
            out[h + "mlp.gate.weight"] = take(m + "mlp.router.weight")
            for e in range(spec.num_experts):
                he, me = h + f"mlp.experts.{e}.", m + f"mlp.experts.local_experts.{e}."
                out[he + "gate_proj.weight"], out[he + "up_proj.weight"] = split_gate_up(take(me + "linear_fc1.weight"))
                out[he + "down_proj.weight"] = take(me + "linear_fc2.weight")
        else:
            gate, up = split_gate_up(take(m + "mlp.linear_fc1.weight"))
            out[h + "mlp.gate_proj.weight"], out[h + "mlp.up_proj.weight"] = gate, up
    return out
