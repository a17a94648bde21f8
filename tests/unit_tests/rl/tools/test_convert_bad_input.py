"""Bad input to the converters is refused before anything is written, with messages that name the problem."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_hf_models import tiny_config  # noqa: E402

from tools.checkpoint_conversion.families import ArchSpec, ConversionError, UnsupportedModelError
from tools.checkpoint_conversion.hf_to_megatron import layout_problems, main as hf_to_megatron_main, plan_conversion


def _write_config(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def _config_dict(family: str, **overrides) -> dict:
    cfg = tiny_config(family).to_dict()
    cfg.update(overrides)
    return cfg


@pytest.mark.parametrize("model_type,arch", [("mistral", "MistralForCausalLM"), ("mixtral", "MixtralForCausalLM")])
def test_unsupported_architecture_is_named(tmp_path, model_type, arch):
    hf = _write_config(tmp_path / "hf", {**_config_dict("llama"), "model_type": model_type, "architectures": [arch]})
    with pytest.raises(UnsupportedModelError) as e:
        plan_conversion(hf)
    msg = str(e.value)
    assert repr(model_type) in msg and arch in msg
    assert "llama, qwen2, qwen3, qwen3_moe" in msg  # what is supported


@pytest.mark.parametrize("family,overrides,needle", [
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama", {"rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "rope_parameters": None}, "'yarn'"),
    ("llama", {"mlp_bias": True}, "mlp_bias"),
    ("qwen3", {"attention_bias": True}, "attention_bias"),
    ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ("llama", {"num_local_experts": 8}, "mixture-of-experts"),
    ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=false"),
    ("qwen3_moe", {"mlp_only_layers": [0]}, "mlp_only_layers"),
])
def test_unsupported_feature_is_named(tmp_path, family, overrides, needle):
    hf = _write_config(tmp_path / "hf", _config_dict(family, **overrides))
    with pytest.raises(UnsupportedModelError, match="unsupported feature") as e:
        plan_conversion(hf)
    assert needle in str(e.value)


def test_llama3_rope_scaling_is_supported_and_emits_megatron_flags(tmp_path):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    hf = _write_config(tmp_path / "hf", _config_dict("llama", rope_scaling=scaling, rope_parameters=None,
                                                     rope_theta=500000.0))
    flags = plan_conversion(hf).flags
    i = flags.index("--rope-scaling-factor")
    assert "--use-rope-scaling" in flags and flags[i + 1] == "8.0"
    assert flags[flags.index("--rotary-base") + 1] == "500000"
    odd = _write_config(tmp_path / "odd", _config_dict("llama", rope_scaling={**scaling, "high_freq_factor": 2.0},
                                                       rope_parameters=None))
    with pytest.raises(UnsupportedModelError, match="high_freq_factor"):
        plan_conversion(odd)


@pytest.mark.parametrize("tp,pp,needle", [
    (3, 1, "--target-tensor-parallel-size=3 does not divide the 4 attention heads"),
    (4, 1, "--target-tensor-parallel-size=4 does not divide the 2 query groups"),
    (1, 3, "--target-pipeline-parallel-size=3 does not divide the 2 layers"),
])
def test_impossible_target_layout_is_refused_before_writing(tmp_path, tp, pp, needle):
    from tiny_hf_models import build_tiny_hf_model

    hf = tmp_path / "hf"
    build_tiny_hf_model(hf, "qwen2", tokenizer=False)
    save = tmp_path / "out"
    with pytest.raises(ConversionError) as e:
        plan_conversion(hf, target_tp=tp, target_pp=pp)
    assert needle in str(e.value)
    rc = hf_to_megatron_main(["--hf-dir", str(hf), "--save", str(save), "--target-tensor-parallel-size", str(tp),
                              "--target-pipeline-parallel-size", str(pp)])
    assert rc == 2 and not save.exists()


def test_layout_check_covers_the_padded_vocab():
    spec = ArchSpec(num_layers=2, hidden_size=64, ffn_hidden_size=96, num_heads=4, num_groups=2, head_dim=16,
                    vocab_size=201, qkv_bias=False, qk_norm=False, tied_embeddings=False)
    assert layout_problems(spec, 2, 1, padded=256) == []
    assert layout_problems(spec, 2, 1, padded=201) == [
        "--target-tensor-parallel-size=2 does not divide the 201 padded vocabulary"]


def test_missing_or_empty_hf_dir(tmp_path):
    with pytest.raises(ConversionError, match=r"--hf-dir=.*nope: no such directory"):
        plan_conversion(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="no config.json"):
        plan_conversion(tmp_path / "empty")
    save = tmp_path / "out"
    assert hf_to_megatron_main(["--hf-dir", str(tmp_path / "nope"), "--save", str(save)]) == 2
    assert not save.exists()


def test_megatron_to_hf_needs_model_flags(tmp_path):
    from tools.checkpoint_conversion.megatron_to_hf import main as megatron_to_hf_main

    assert megatron_to_hf_main(["--load", str(tmp_path / "missing"), "--save", str(tmp_path / "hf")]) == 2
    ckpt = tmp_path / "ckpt"
    (ckpt / "release").mkdir(parents=True)
    for name in ("metadata.json", ".metadata", "common.pt"):
        (ckpt / "release" / name).write_text("")
    (ckpt / "latest_checkpointed_iteration.txt").write_text("release")
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf

    with pytest.raises(ConversionError, match="--megatron-args"):
        convert_megatron_to_hf(ckpt, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()
