"""Qwen2 / Qwen2.5 (``model_type: qwen2``: bias on q/k/v) and Qwen3 (``model_type: qwen3``: per-head q/k RMSNorm)."""
from __future__ import annotations

from tools.checkpoint_conversion.families import Family, register_family


@register_family
class Qwen2Family(Family):
    name = "qwen2"
    model_types = ("qwen2",)
    architecture = "Qwen2ForCausalLM"
    qkv_bias = True

    def hf_config(self, model, vocab_size: int, dtype: str, rope_scaling_factor: float | None = None) -> dict:
        cfg = super().hf_config(model, vocab_size, dtype, rope_scaling_factor)
        cfg.pop("head_dim")  # Qwen2 derives it as hidden_size / num_attention_heads
        cfg.update(use_sliding_window=False)
        return cfg


@register_family
class Qwen3Family(Family):
    name = "qwen3"
    model_types = ("qwen3",)
    architecture = "Qwen3ForCausalLM"
    qk_norm = True

    def hf_config(self, model, vocab_size: int, dtype: str, rope_scaling_factor: float | None = None) -> dict:
        cfg = super().hf_config(model, vocab_size, dtype, rope_scaling_factor)
        cfg.update(attention_bias=False, use_sliding_window=False)
        return cfg
