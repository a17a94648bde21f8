"""--use-rope-scaling / --rope-scaling-factor (Llama 3.x) reach megatron-core's GPTModel; model_args contents."""
from __future__ import annotations

import math

import pytest
import torch

from megatron.rl.training.config import ConfigError, parse_args

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "2", "--seq-length", "16",
        "--train-iters", "1", "--lr", "1e-3", "--position-embedding-type", "rope", "--rotary-base", "500000"]


def _inv_freq(cfg) -> torch.Tensor:
    from megatron.rl.training.initialize import destroy_megatron, initialize_megatron
    from megatron.rl.training.model_provider import build_model, unwrap_model

    try:
        initialize_megatron(cfg)
        gpt = unwrap_model(build_model(cfg, wrap_with_ddp=False, vocab_size=128))[0]
        return gpt.rotary_pos_emb.inv_freq.detach().clone()
    finally:
        destroy_megatron()


def test_rope_scaling_flags_reach_the_model():
    plain = _inv_freq(parse_args(BASE, world_size=1))
    cfg = parse_args([*BASE, "--use-rope-scaling", "--rope-scaling-factor", "4"], world_size=1)
    assert cfg.model.use_rope_scaling and cfg.model.rope_scaling_factor == 4.0
    scaled = _inv_freq(cfg)
    # Llama-3 scaling (original context 8192, low/high freq factors 1/4): short wavelengths (< 8192/4) are
    # kept, long ones (> 8192) are divided by the factor; our 32-dim heads with base 5e5 have both.
    wavelength = 2 * math.pi / plain
    short, long_ = wavelength < 8192 / 4, wavelength > 8192
    assert short.any() and long_.any()
    torch.testing.assert_close(scaled[short], plain[short])
    torch.testing.assert_close(scaled[long_], plain[long_] / 4)
    assert parse_args(BASE, world_size=1).model_args()["use_rope_scaling"] is False
    assert cfg.model_args()["rope_scaling_factor"] == 4.0


def test_rope_scaling_needs_rope():
    with pytest.raises(ConfigError, match="--use-rope-scaling"):
        parse_args([*BASE[:-4], "--use-rope-scaling"], world_size=1)


def test_max_position_embeddings_compared_only_for_learned_positions():
    rope = parse_args([*BASE, "--max-position-embeddings", "4096"], world_size=1).model_args()
    assert "max_position_embeddings" not in rope
    learned = parse_args([*BASE[:-4], "--max-position-embeddings", "64"], world_size=1).model_args()
    assert learned["max_position_embeddings"] == 64
