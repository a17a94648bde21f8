"""Qwen2 / Qwen2.5 (``model_type: qwen2``: bias on q/k/v), Qwen3 (``model_type: qwen3``: per-head q/k RMSNorm) and
Qwen3-MoE (``model_type: qwen3_moe``: Qwen3 attention, every MLP a mixture of experts)."""
from __future__ import annotations

import dataclasses

from tools.checkpoint_conversion.families import ArchSpec, Family, register_family


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


@register_family
class Qwen3MoeFamily(Qwen3Family):
    """Qwen3-MoE. Its router (softmax over all experts, top-k, renormalised when ``norm_topk_prob``) equals
    megatron-core's default router (top-k of the logits, softmax over those k), so only that case converts."""

    name = "qwen3_moe"
    model_types = ("qwen3_moe",)
    architecture = "Qwen3MoeForCausalLM"
    moe = True

    def problems(self, cfg: dict) -> list[str]:
        out = super().problems(cfg)
        if not cfg.get("norm_topk_prob", False):
            out.append("norm_topk_prob=false (top-k router weights without renormalisation)")
        if cfg.get("mlp_only_layers"):
            out.append(f"mlp_only_layers={cfg['mlp_only_layers']} (dense layers between MoE layers)")
        if int(cfg.get("decoder_sparse_step", 1)) != 1:
            out.append(f"decoder_sparse_step={cfg['decoder_sparse_step']} (MoE only every few layers)")
        if cfg.get("shared_expert_intermediate_size"):
            out.append("shared experts")
        return out

    @staticmethod
    def num_experts(cfg: dict) -> int:
        # "num_experts" in published configs; transformers 5 writes "num_local_experts"
        return int(cfg.get("num_experts") or cfg["num_local_experts"])

    def moe_flags(self, cfg: dict) -> list[str]:
        return ["--num-experts", str(self.num_experts(cfg)), "--moe-router-topk", str(cfg["num_experts_per_tok"]),
                "--moe-ffn-hidden-size", str(cfg["moe_intermediate_size"]),
                "--moe-router-load-balancing-type", "aux_loss",
                "--moe-aux-loss-coeff", repr(float(cfg.get("router_aux_loss_coef", 0.001)))]

    def arch_spec(self, cfg: dict) -> ArchSpec:
        return dataclasses.replace(super().arch_spec(cfg), num_experts=self.num_experts(cfg),
                                   moe_ffn_hidden_size=int(cfg["moe_intermediate_size"]))

    def hf_config(self, model, vocab_size: int, dtype: str, rope_scaling_factor: float | None = None) -> dict:
        cfg = super().hf_config(model, vocab_size, dtype, rope_scaling_factor)
        cfg.update(num_experts=model.num_experts, num_experts_per_tok=model.moe_router_topk,
                   moe_intermediate_size=model.moe_ffn_hidden_size, norm_topk_prob=True, decoder_sparse_step=1,
                   mlp_only_layers=[], router_aux_loss_coef=model.moe_aux_loss_coeff)
        return cfg
