"""Model families the converter supports, chosen by the Hugging Face ``config.json`` ``model_type``.

A family (registered with :func:`register_family`) knows three things about its Hugging Face config:

- which features the converter cannot express in Megatron (``check`` collects them all, so one error
  names every unsupported feature: sliding-window attention, an unknown ``rope_scaling`` type, ...);
- the Megatron-LM flags that build the same network (``megatron_flags``);
- the tensor shapes the state-dict mapping needs (``arch_spec``).

The config is handled as the raw ``config.json`` dict, so both the transformers 4.x schema (``rope_theta``,
``rope_scaling``, ``torch_dtype``) and the 5.x one (``rope_parameters``, ``dtype``) are read.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, ClassVar

from megatron.rl.base.registry import Registry

log = logging.getLogger(__name__)


class ConversionError(ValueError):
    """Bad input for a conversion (missing directory, unsupported model, impossible layout); names what to fix."""


class UnsupportedModelError(ConversionError):
    """The Hugging Face model uses an architecture or feature the converter cannot express in Megatron."""


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """Shapes of a decoder-only GPT, as the state-dict mapping needs them.

    vocab_size is the real (unpadded) vocabulary; head_dim may differ from hidden_size / num_heads (Qwen3).
    """

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    vocab_size: int
    qkv_bias: bool
    qk_norm: bool
    tied_embeddings: bool
    num_experts: int = 0             # 0: dense MLP; else every layer is a mixture of experts
    moe_ffn_hidden_size: int = 0


def rope_settings(cfg: dict) -> tuple[float, dict | None]:
    """``(rope_theta, scaling)`` from either config schema; ``scaling`` is None for plain RoPE."""
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else None
    else:
        theta = cfg.get("rope_theta", 10000.0)
        scaling = cfg.get("rope_scaling") or None
        if scaling is not None and scaling.get("rope_type", scaling.get("type", "default")) == "default":
            scaling = None
    return float(theta), scaling


def config_dtype(cfg: dict) -> str | None:
    """The checkpoint's dtype name from ``config.json`` (``dtype`` in transformers 5, ``torch_dtype`` before)."""
    value = cfg.get("dtype") or cfg.get("torch_dtype")
    return str(value).replace("torch.", "") if value else None


def head_dim(cfg: dict) -> int:
    return int(cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"])


def num_kv_heads(cfg: dict) -> int:
    return int(cfg.get("num_key_value_heads") or cfg["num_attention_heads"])


def _fmt(x: float) -> str:
    return repr(float(x)) if float(x) != int(x) or abs(x) < 1 else str(int(x))


class Family:
    """Base class: a Llama-style decoder (RMSNorm, RoPE, SwiGLU, GQA, no linear biases)."""

    name: ClassVar[str] = ""
    model_types: ClassVar[tuple[str, ...]] = ()
    architecture: ClassVar[str] = ""          # the HF class written into config.json "architectures"
    qkv_bias: ClassVar[bool] = False          # Qwen2: q/k/v projections always carry a bias
    qk_norm: ClassVar[bool] = False           # Qwen3: RMSNorm over each q and k head
    moe: ClassVar[bool] = False               # Qwen3-MoE: every layer's MLP is a mixture of experts

    # ------------------------------------------------------------------ checks
    def problems(self, cfg: dict) -> list[str]:
        """Unsupported features of ``cfg`` (empty: convertible). Subclasses extend this list."""
        out = []
        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):
            out.append(f"hidden_act={act!r} (only SwiGLU with silu is supported)")
        if cfg.get("attention_bias"):
            out.append("attention_bias=true (biases on all attention projections; Megatron's --add-qkv-bias "
                       "covers q/k/v only)")
        if cfg.get("mlp_bias"):
            out.append("mlp_bias=true (MLP biases)")
        if cfg.get("use_sliding_window"):
            out.append("use_sliding_window=true (sliding-window attention)")
        if any(t != "full_attention" for t in cfg.get("layer_types") or []):
            out.append(f"layer_types other than full_attention ({sorted(set(cfg['layer_types']))})")
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0:
            out.append(f"partial_rotary_factor={cfg['partial_rotary_factor']} (partial RoPE)")
        if cfg.get("quantization_config"):
            out.append("quantization_config (quantized weights; convert the unquantized checkpoint)")
        if (cfg.get("num_experts") or cfg.get("num_local_experts")) and not self.moe:
            out.append("mixture-of-experts layers (num_experts)")
        theta, scaling = rope_settings(cfg)
        if theta != int(theta):
            out.append(f"rope_theta={theta} (Megatron's --rotary-base is an integer)")
        if scaling is not None:
            out.extend(self.rope_scaling_problems(scaling))
        heads, groups = cfg["num_attention_heads"], num_kv_heads(cfg)
        if heads % groups:
            out.append(f"num_attention_heads={heads} not a multiple of num_key_value_heads={groups}")
        return out

    def rope_scaling_problems(self, scaling: dict) -> list[str]:
        kind = scaling.get("rope_type", scaling.get("type"))
        return [f"rope_scaling rope_type={kind!r} (RoPE scaling is not supported for {self.name})"]

    def check(self, cfg: dict) -> None:
        problems = self.problems(cfg)
        if problems:
            raise UnsupportedModelError(
                f"cannot convert this {cfg.get('model_type')!r} model ({', '.join(cfg.get('architectures') or [])}): "
                f"unsupported feature(s): " + "; ".join(problems))

    # ------------------------------------------------------------------ flags and shapes
    def megatron_flags(self, cfg: dict, make_vocab_size_divisible_by: int = 128) -> list[str]:
        """Megatron-LM flags that build the same network (architecture, dropout off, vocab)."""
        heads, groups = int(cfg["num_attention_heads"]), num_kv_heads(cfg)
        theta, scaling = rope_settings(cfg)
        flags = ["--num-layers", str(cfg["num_hidden_layers"]), "--hidden-size", str(cfg["hidden_size"]),
                 "--ffn-hidden-size", str(cfg["intermediate_size"]), "--num-attention-heads", str(heads)]
        if groups != heads:
            flags += ["--group-query-attention", "--num-query-groups", str(groups)]
        flags += ["--kv-channels", str(head_dim(cfg)),
                  "--max-position-embeddings", str(cfg.get("max_position_embeddings", 4096)),
                  "--position-embedding-type", "rope", "--rotary-base", str(int(theta)),
                  "--normalization", "RMSNorm", "--norm-epsilon", _fmt(cfg.get("rms_norm_eps", 1e-6)),
                  "--swiglu", "--disable-bias-linear"]
        if self.qkv_bias:
            flags.append("--add-qkv-bias")
        if self.qk_norm:
            flags.append("--qk-layernorm")
        if not cfg.get("tie_word_embeddings", False):
            flags.append("--untie-embeddings-and-output-weights")
        flags += self.rope_scaling_flags(scaling)
        flags += ["--attention-dropout", "0.0", "--hidden-dropout", "0.0",
                  "--vocab-size", str(cfg["vocab_size"]),
                  "--make-vocab-size-divisible-by", str(make_vocab_size_divisible_by)]
        return flags + self.moe_flags(cfg)

    def moe_flags(self, cfg: dict) -> list[str]:
        return []

    def rope_scaling_flags(self, scaling: dict | None) -> list[str]:
        return []

    def arch_spec(self, cfg: dict) -> ArchSpec:
        return ArchSpec(num_layers=int(cfg["num_hidden_layers"]), hidden_size=int(cfg["hidden_size"]),
                        ffn_hidden_size=int(cfg["intermediate_size"]), num_heads=int(cfg["num_attention_heads"]),
                        num_groups=num_kv_heads(cfg), head_dim=head_dim(cfg), vocab_size=int(cfg["vocab_size"]),
                        qkv_bias=self.qkv_bias, qk_norm=self.qk_norm,
                        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))

    def hf_config(self, model, vocab_size: int, dtype: str, rope_scaling_factor: float | None = None) -> dict[str, Any]:
        """A minimal ``config.json`` dict for a Megatron model (``model``: our ``ModelConfig``), used when the
        checkpoint carries no original Hugging Face config. ``rope_scaling_factor``: Llama-3 RoPE scaling."""
        if rope_scaling_factor is not None:
            raise ConversionError(f"--use-rope-scaling is not supported for {self.name}")
        return {"architectures": [self.architecture], "model_type": self.model_types[0], "hidden_act": "silu",
                "hidden_size": model.hidden_size, "intermediate_size": model.ffn_hidden_size,
                "num_hidden_layers": model.num_layers, "num_attention_heads": model.num_attention_heads,
                "num_key_value_heads": model.num_query_groups, "head_dim": model.kv_channels,
                "max_position_embeddings": model.max_position_embeddings, "rms_norm_eps": model.norm_epsilon,
                "rope_theta": float(model.rotary_base),
                "tie_word_embeddings": not model.untie_embeddings_and_output_weights,
                "vocab_size": vocab_size, "torch_dtype": dtype, "attention_dropout": 0.0,
                "initializer_range": model.init_method_std}


_FAMILIES: Registry[Family] = Registry("model_type")


def register_family(cls: type[Family]) -> type[Family]:
    """Class decorator: make ``cls`` the converter for each of its ``model_types`` (a model_type another
    family already converts raises :class:`~megatron.rl.base.registry.DuplicateNameError`)."""
    inst = cls()
    for mt in cls.model_types:
        _FAMILIES.add(mt, inst)
    return cls


def supported_model_types() -> list[str]:
    _import_families()
    return sorted(_FAMILIES)


def family_for_config(cfg: dict) -> Family:
    """The registered family of ``cfg['model_type']``; raises UnsupportedModelError naming it otherwise."""
    _import_families()
    mt = cfg.get("model_type")
    if mt not in _FAMILIES:
        raise UnsupportedModelError(
            f"model_type {mt!r} (architectures {cfg.get('architectures')}) is not supported by the converter; "
            f"supported model_type values: {', '.join(sorted(_FAMILIES))}")
    return _FAMILIES.get(mt)


def family_by_name(name: str) -> Family:
    _import_families()
    for fam in _FAMILIES.registered().values():
        if fam.name == name or name in fam.model_types:
            return fam
    raise UnsupportedModelError(f"unknown model family {name!r}; supported: {', '.join(sorted(_FAMILIES))}")


def family_for_megatron(model) -> Family:
    """Guess the family of a Megatron model (our ``ModelConfig``) from the features that tell them apart."""
    return family_by_name("qwen3" if model.qk_layernorm else "qwen2" if model.add_qkv_bias else "llama")


def _import_families() -> None:
    # the family modules register themselves on import
    from tools.checkpoint_conversion import llama, qwen  # noqa: F401

