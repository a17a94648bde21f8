"""examples/rl/model_configs/*.sh: valid bash, flags our parser accepts, parameter counts equal the published sizes.

Published sizes compared against (total parameters, embeddings included, tied embeddings counted once):
- Qwen2.5 model cards: 0.5B -> 0.49B, 1.5B -> 1.54B, 7B -> 7.61B, 32B -> 32.5B (the card; the safetensors of
  Qwen2.5-32B hold 32.76B, which the 1% check also accepts).
- Qwen3 model cards: 4B -> 4.0B, 8B -> 8.2B, 30B-A3B -> 30.5B total and 3.3B activated (the shapes give
  3.353B activated: the card truncates; checked within 2%).
- Llama-3.1-8B: 8.03B (Hugging Face's count of the released safetensors; Meta calls it "8B").
"""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[4]
CONFIG_DIR = REPO / "examples" / "rl" / "model_configs"

PUBLISHED_TOTAL = {"qwen2.5-0.5b": 0.49e9, "qwen2.5-1.5b": 1.54e9, "qwen2.5-7b": 7.61e9, "qwen2.5-32b": 32.5e9,
                   "qwen3-4b": 4.0e9, "qwen3-8b": 8.2e9, "qwen3-30b-a3b": 30.5e9, "llama3.1-8b": 8.03e9}
PUBLISHED_ACTIVATED = {"qwen3-30b-a3b": 3.3e9}
RECOMMENDED_TP = {"qwen2.5-0.5b": 1, "qwen2.5-1.5b": 1, "qwen2.5-7b": 2, "qwen2.5-32b": 8, "qwen3-4b": 1,
                  "qwen3-8b": 2, "qwen3-30b-a3b": 2, "llama3.1-8b": 2}
_L3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
       "original_max_position_embeddings": 8192}
# Hugging Face config.json values (from the published configs)
HF_CONFIGS = {
    "qwen2.5-0.5b": dict(model_type="qwen2", num_hidden_layers=24, hidden_size=896, intermediate_size=4864,
                         num_attention_heads=14, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=32768, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen2.5-1.5b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=1536, intermediate_size=8960,
                         num_attention_heads=12, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                         max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen2.5-7b": dict(model_type="qwen2", num_hidden_layers=28, hidden_size=3584, intermediate_size=18944,
                       num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False,
                       max_position_embeddings=131072, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen2.5-32b": dict(model_type="qwen2", num_hidden_layers=64, hidden_size=5120, intermediate_size=27648,
                        num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e6),
    "qwen3-4b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=2560, intermediate_size=9728,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=True, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3-8b": dict(model_type="qwen3", num_hidden_layers=36, hidden_size=4096, intermediate_size=12288,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1e6),
    "qwen3-30b-a3b": dict(model_type="qwen3_moe", num_hidden_layers=48, hidden_size=2048, intermediate_size=6144,
                          num_attention_heads=32, num_key_value_heads=4, head_dim=128, vocab_size=151936,
                          tie_word_embeddings=False, max_position_embeddings=40960, rms_norm_eps=1e-6,
                          rope_theta=1e6, num_experts=128, num_experts_per_tok=8, moe_intermediate_size=768,
                          norm_topk_prob=True, router_aux_loss_coef=0.001, decoder_sparse_step=1,
                          mlp_only_layers=[]),
    "llama3.1-8b": dict(model_type="llama", num_hidden_layers=32, hidden_size=4096, intermediate_size=14336,
                        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False,
                        max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0, rope_scaling=_L3),
}
NAMES = sorted(PUBLISHED_TOTAL)


def bash_array(name: str, array: str) -> list[str]:
    """The elements of bash array ``array`` after sourcing the config file ``name``.sh."""
    script = f'set -euo pipefail; source "$1"; printf "%s\\0" "${{{array}[@]}}"'
    out = subprocess.run(["bash", "-c", script, "bash", str(CONFIG_DIR / f"{name}.sh")], check=True,
                         capture_output=True, text=True).stdout
    return out.split("\0")[:-1]


def parse(argv: list[str], world_size: int = 1):
    from megatron.rl.training.config import parse_args

    return parse_args(argv, world_size=world_size)


def analytic_counts(m, vocab: int) -> tuple[int, int]:
    """(total, activated-per-token) parameters from the shapes alone, counted the Hugging Face way."""
    h, d = m.hidden_size, m.kv_channels
    q, kv = m.num_attention_heads * d, m.num_query_groups * d
    attn = h * q + 2 * h * kv + q * h + (q + 2 * kv if m.add_qkv_bias else 0) + (2 * d if m.qk_layernorm else 0)
    norms = 2 * h
    if m.num_experts:
        expert = 3 * h * m.moe_ffn_hidden_size
        router = m.num_experts * h
        mlp_total, mlp_active = m.num_experts * expert + router, m.moe_router_topk * expert + router
    else:
        mlp_total = mlp_active = 3 * h * m.ffn_hidden_size
    embeddings = vocab * h * (2 if m.untie_embeddings_and_output_weights else 1)
    per_layer = attn + norms
    total = embeddings + h + m.num_layers * (per_layer + mlp_total)
    active = embeddings + h + m.num_layers * (per_layer + mlp_active)
    return total, active


def test_every_config_is_valid_bash_and_present():
    assert sorted(p.stem for p in CONFIG_DIR.glob("*.sh")) == NAMES
    for name in NAMES:
        subprocess.run(["bash", "-n", str(CONFIG_DIR / f"{name}.sh")], check=True)


def test_every_config_has_its_published_hf_config():
    assert sorted(HF_CONFIGS) == NAMES


@pytest.mark.parametrize("name", sorted(HF_CONFIGS))
def test_config_flags_equal_what_the_converter_writes(name):
    """A converted checkpoint of the published model validates against these flags (same model_args)."""
    from tools.checkpoint_conversion.families import family_for_config

    cfg = HF_CONFIGS[name]
    family = family_for_config(cfg)
    family.check(cfg)
    assert bash_array(name, "MODEL_ARGS") == family.megatron_flags(cfg)


@pytest.mark.parametrize("name", NAMES)
def test_parameter_count_matches_published_size(name):
    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, padded_vocab_size, unwrap_model

    setup_runtime()
    model_args, parallel_args = bash_array(name, "MODEL_ARGS"), bash_array(name, "PARALLEL_ARGS")
    full = parse(model_args + parallel_args, world_size=8)  # the recommended layout is valid on 8 GPUs
    assert full.parallel.tensor_model_parallel_size == RECOMMENDED_TP[name]
    cfg = parse(model_args)
    vocab = cfg.tokenizer.vocab_size
    assert padded_vocab_size(cfg) == vocab  # published vocabularies are multiples of 128: no padding at TP=1
    total, active = analytic_counts(cfg.model, vocab)

    initialize_megatron(cfg)
    with torch.device("meta"):  # real module tree and shapes, no memory
        model = unwrap_model(build_model(cfg, wrap_with_ddp=False, perform_initialization=False))[0]
    built = sum(p.numel() for p in model.parameters())
    assert built == total, f"megatron model has {built} parameters, the shapes imply {total}"
    published = PUBLISHED_TOTAL[name]
    assert abs(total - published) / published < 0.01, f"{name}: {total / 1e9:.3f}B vs published {published / 1e9}B"
    if name in PUBLISHED_ACTIVATED:
        # the shapes give 3.353B activated; Qwen's card truncates it to "3.3B", hence 2% here
        assert abs(active - PUBLISHED_ACTIVATED[name]) / PUBLISHED_ACTIVATED[name] < 0.02
    if name == "qwen2.5-32b":
        assert abs(total - 32.76e9) / 32.76e9 < 0.01  # the safetensors count as well


@pytest.mark.parametrize("name", NAMES)
def test_tiny_override_builds_and_runs(name):
    """Each config with small sizes (same features: GQA, biases, q/k-norm, tying, MoE) builds and runs a forward."""
    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, unwrap_model

    setup_runtime()
    tiny = ["--num-layers", "2", "--hidden-size", "64", "--ffn-hidden-size", "96", "--num-attention-heads", "4",
            "--kv-channels", "16", "--vocab-size", "300", "--max-position-embeddings", "64"]
    args = bash_array(name, "MODEL_ARGS")
    if "--group-query-attention" in args:
        tiny += ["--num-query-groups", "2"]
    if "--num-experts" in args:
        tiny += ["--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32"]
    cfg = parse(args + tiny)
    initialize_megatron(cfg)
    model = unwrap_model(build_model(cfg, wrap_with_ddp=False))[0]
    total, _ = analytic_counts(cfg.model, 384)  # 300 padded to a multiple of 128
    assert sum(p.numel() for p in model.parameters()) == total
    tokens = torch.randint(0, 300, (1, 8))
    mask = torch.triu(torch.ones(8, 8, dtype=torch.bool), diagonal=1).view(1, 1, 8, 8)
    model.eval()
    with torch.no_grad():
        logits = model(tokens, torch.arange(8).unsqueeze(0), mask)
    assert logits.shape == (1, 8, 384) and torch.isfinite(logits).all()
