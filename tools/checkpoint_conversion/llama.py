"""Llama 3.x (``model_type: llama``): GQA, SwiGLU, RMSNorm, RoPE with optional Llama-3 frequency scaling."""
from __future__ import annotations

from tools.checkpoint_conversion.families import Family, register_family

# megatron-core's RotaryEmbedding applies Llama-3 scaling with these constants fixed; only the factor is a flag.
_MCORE_LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@register_family
class LlamaFamily(Family):
    name = "llama"
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"

    def rope_scaling_problems(self, scaling: dict) -> list[str]:
        kind = scaling.get("rope_type", scaling.get("type"))
        if kind != "llama3":
            return [f"rope_scaling rope_type={kind!r} (only Llama-3 'llama3' scaling is supported)"]
        odd = {k: scaling.get(k) for k, v in _MCORE_LLAMA3_FIXED.items() if float(scaling.get(k, v)) != v}
        if odd:
            return [f"llama3 rope_scaling with {odd} (megatron-core fixes {_MCORE_LLAMA3_FIXED})"]
        return []

    def rope_scaling_flags(self, scaling: dict | None) -> list[str]:
        if scaling is None:
            return []
        return ["--use-rope-scaling", "--rope-scaling-factor", repr(float(scaling.get("factor", 8.0)))]

    def hf_config(self, model, vocab_size: int, dtype: str, rope_scaling_factor: float | None = None) -> dict:
        cfg = super().hf_config(model, vocab_size, dtype)
        cfg.update(attention_bias=False, mlp_bias=False)
        if rope_scaling_factor is not None:
            cfg["rope_scaling"] = {"rope_type": "llama3", "factor": float(rope_scaling_factor),
                                   **_MCORE_LLAMA3_FIXED}
        return cfg
