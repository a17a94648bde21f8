"""HF <-> Megatron conversion: logits parity (TP=1 here, TP=2 under torchrun), exact round trip, layouts."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from tiny_hf_models import build_tiny_hf_model, hf_logits, megatron_logits  # noqa: E402

from tools.checkpoint_conversion.layout import fuse_gate_up, fuse_qkv, pad_vocab, split_gate_up, split_qkv, unpad_vocab

SCRIPTS = Path(__file__).resolve().parent / "scripts"


# ----------------------------------------------------------------------------------------- pure layouts

def _qkv_reference(q, k, v, heads, groups):
    """Row-by-row construction of megatron's grouped QKV layout (a second, loop-based implementation)."""
    d = k.shape[0] // groups
    rows = []
    for g in range(groups):
        for h in range(g * heads // groups, (g + 1) * heads // groups):
            rows.append(q[h * d:(h + 1) * d])
        rows.append(k[g * d:(g + 1) * d])
        rows.append(v[g * d:(g + 1) * d])
    return torch.cat(rows)


@pytest.mark.parametrize("heads,groups,d", [(4, 2, 3), (6, 6, 2), (8, 1, 4)])
def test_fuse_qkv_matches_loop_reference_and_inverts(heads, groups, d):
    hidden = 5
    q, k, v = torch.randn(heads * d, hidden), torch.randn(groups * d, hidden), torch.randn(groups * d, hidden)
    fused = fuse_qkv(q, k, v, heads, groups)
    assert torch.equal(fused, _qkv_reference(q, k, v, heads, groups))
    for a, b in zip(split_qkv(fused, heads, groups), (q, k, v)):
        assert torch.equal(a, b)
    qb, kb, vb = torch.randn(heads * d), torch.randn(groups * d), torch.randn(groups * d)  # biases are 1-D
    fused_b = fuse_qkv(qb, kb, vb, heads, groups)
    assert torch.equal(fused_b, _qkv_reference(qb, kb, vb, heads, groups))
    assert all(torch.equal(a, b) for a, b in zip(split_qkv(fused_b, heads, groups), (qb, kb, vb)))


def test_gate_up_and_vocab_padding():
    gate, up = torch.randn(6, 4), torch.randn(6, 4)
    fc1 = fuse_gate_up(gate, up)
    assert torch.equal(fc1[:6], gate) and torch.equal(fc1[6:], up)  # megatron's GLU: act(first half) * second
    g2, u2 = split_gate_up(fc1)
    assert torch.equal(g2, gate) and torch.equal(u2, up)
    emb = torch.randn(5, 3)
    padded = pad_vocab(emb, 8)
    assert padded.shape == (8, 3) and torch.equal(padded[:5], emb) and not padded[5:].any()
    assert torch.equal(unpad_vocab(padded, 5), emb)
    with pytest.raises(ValueError):
        pad_vocab(emb, 4)


def test_sharded_safetensors_write_and_lazy_read(tmp_path):
    from tools.checkpoint_conversion.hf_io import SAFE_INDEX, HFTensorReader, write_safetensors

    tensors = {f"t{i}": torch.randn(10, 10).to(torch.bfloat16 if i % 2 else torch.float32) for i in range(5)}
    paths = write_safetensors(tmp_path, tensors, max_shard_bytes=450)  # 400-byte fp32 tensors: one per shard
    assert len(paths) > 1 and (tmp_path / SAFE_INDEX).is_file()
    reader = HFTensorReader(tmp_path)
    assert reader.names() == sorted(tensors)
    for name, t in tensors.items():
        got = reader.get(name)
        assert got.dtype == t.dtype and torch.equal(got, t)


# ----------------------------------------------------------------------------------------- conversions

def _load_converted(ckpt: Path, tp: int = 1):
    """The converted checkpoint loaded the way a training run does (flags file -> parse -> build -> load)."""
    from megatron.rl.training.checkpoint.save_load import load_checkpoint
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, unwrap_model
    from tools.checkpoint_conversion.hf_to_megatron import parse_megatron_flags
    from tools.checkpoint_conversion.megatron_to_hf import read_flags_file

    cfg = parse_megatron_flags(read_flags_file(ckpt / "megatron_args.txt"), tp=tp)
    initialize_megatron(cfg)
    model = unwrap_model(build_model(cfg, wrap_with_ddp=False))[0]
    load_checkpoint(ckpt, [model], load_optimizer=False, load_rng=False, model_args=cfg.model_args())
    return cfg, model


def _all_tensors(d: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(d.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _assert_bitwise_equal_dirs(a: Path, b: Path):
    ta, tb = _all_tensors(a), _all_tensors(b)
    assert sorted(ta) == sorted(tb)
    for name in ta:
        x, y = ta[name], tb[name]
        assert x.dtype == y.dtype and x.shape == y.shape, name
        assert x.view(torch.uint8).equal(y.view(torch.uint8)), f"{name} differs after the round trip"
    assert json.loads((a / "config.json").read_text()) == json.loads((b / "config.json").read_text())


# (family, tied, saved dtype, shard size of the HF input)
CASES = [pytest.param("llama", False, torch.float32, "40KB", id="llama-untied-sharded"),
         pytest.param("qwen2", True, torch.float32, None, id="qwen2-qkvbias-tied"),
         pytest.param("qwen3", False, torch.float32, None, id="qwen3-qknorm-untied"),
         pytest.param("qwen2", False, torch.bfloat16, None, id="qwen2-bf16"),
         pytest.param("llama", True, torch.float32, None, id="llama-tied"),
         pytest.param("qwen3", True, torch.bfloat16, "40KB", id="qwen3-tied-bf16-sharded"),
         pytest.param("qwen3_moe", False, torch.float32, None, id="qwen3-moe")]


@pytest.mark.parametrize("family,tied,dtype,shard", CASES)
def test_hf_to_megatron_logits_and_exact_round_trip(tmp_path, family, tied, dtype, shard):
    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.tokenizer import HuggingFaceTokenizer
    from tools.checkpoint_conversion.hf_to_megatron import convert_hf_to_megatron
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf

    setup_runtime()
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "hf_back"
    hf_model = build_tiny_hf_model(hf_dir, family, tied=tied, dtype=dtype, max_shard_size=shard)
    assert (len(list(hf_dir.glob("*.safetensors"))) > 1) == (shard is not None)
    assert {t.dtype for t in _all_tensors(hf_dir).values()} == {dtype}
    convert_hf_to_megatron(hf_dir, ckpt)  # dtype: the config's
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text().strip() == "release"
    assert HuggingFaceTokenizer(str(ckpt / "tokenizer")).vocab_size == 10

    cfg, model = _load_converted(ckpt)  # an fp32 model: a bf16 checkpoint is upcast on load
    assert model.embedding.word_embeddings.weight.shape[0] == 256  # vocab 200 padded to Megatron's multiple of 128
    assert model.share_embeddings_and_output_weights == tied
    torch.manual_seed(1)
    tokens = torch.randint(0, 200, (2, 13))
    ref = hf_logits(hf_model, tokens)
    got = megatron_logits(model, tokens)
    assert got.shape[-1] == 256
    torch.testing.assert_close(got[..., :200], ref, atol=1e-4, rtol=0)
    assert ref.std() > 0.05  # the comparison is not between two near-constant tensors

    convert_megatron_to_hf(ckpt, back)
    _assert_bitwise_equal_dirs(hf_dir, back)
    assert (back / "tokenizer.json").is_file()


@pytest.mark.slow  # ~20 s alone, ~95 s on the shared 2-core box: 2 extra processes importing torch/megatron
@pytest.mark.multiprocess
def test_converted_checkpoints_load_at_tp2(tmp_path, torchrun):
    """Qwen2 (qkv bias) and Qwen3 (q/k-norm, head_dim != hidden/heads), converted for TP=2, loaded at TP=2."""
    from tools.checkpoint_conversion.hf_to_megatron import convert_hf_to_megatron

    from megatron.rl.runtime import setup_runtime

    setup_runtime()
    pairs = []
    for family, tied in (("qwen2", False), ("qwen3", True)):
        hf_dir, ckpt = tmp_path / f"hf_{family}", tmp_path / f"mc_{family}"
        build_tiny_hf_model(hf_dir, family, tied=tied, tokenizer=False)
        convert_hf_to_megatron(hf_dir, ckpt, target_tp=2)
        pairs += [hf_dir, ckpt]
    out = tmp_path / "result.json"
    torchrun(SCRIPTS / "load_converted_tp2.py", [out, *pairs], nproc=2)
    # each rank also saved a training checkpoint (iter 5) at TP=2: it converts back to the original weights
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf, read_flags_file

    for hf_dir, ckpt in zip(pairs[0::2], pairs[1::2]):
        trained = Path(str(ckpt) + "_tp2_trained")
        assert (trained / "latest_checkpointed_iteration.txt").read_text().strip() == "5"
        back = tmp_path / f"{ckpt.name}_back"
        convert_megatron_to_hf(trained, back, megatron_args=read_flags_file(ckpt / "megatron_args.txt"),
                               hf_config_dir=ckpt / "hf_config")
        _assert_bitwise_equal_dirs(hf_dir, back)
    results = json.loads(out.read_text())
    assert len(results) == 2
    for ckpt, r in results.items():
        assert r["max_abs_diff"] < 1e-4, (ckpt, r)
        assert r["ref_abs_max"] > 0.1
    # TP really split the fused QKV: 4 heads + 2*2 groups = 8 heads' rows in total, half on each rank
    assert results[str(pairs[1])]["qkv_rows"] == [4 * 16, 4 * 16]
    assert results[str(pairs[3])]["qkv_rows"] == [4 * 32, 4 * 32]


LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {}), ("qwen3", {}),
                                              ("llama", {"rope_parameters": LLAMA3_ROPE})],
                         ids=["llama", "qwen2", "qwen3", "llama3-rope-scaling"])
def test_megatron_to_hf_without_the_original_config(tmp_path, family, overrides):
    """A checkpoint without hf_config/ (e.g. copied without it) gets a synthesised config.json that transformers
    loads into a model with the same logits (over Megatron's padded vocabulary, which the synthesised config keeps:
    the padded rows, zero here, give logit 0)."""
    import shutil

    from transformers import AutoModelForCausalLM

    from megatron.rl.runtime import setup_runtime
    from tools.checkpoint_conversion.hf_to_megatron import convert_hf_to_megatron
    from tools.checkpoint_conversion.megatron_to_hf import convert_megatron_to_hf

    setup_runtime()
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "hf_back"
    hf_model = build_tiny_hf_model(hf_dir, family, tied=family == "qwen2", tokenizer=False, **overrides)
    convert_hf_to_megatron(hf_dir, ckpt)
    assert ("--use-rope-scaling" in (ckpt / "megatron_args.txt").read_text()) == bool(overrides)
    shutil.rmtree(ckpt / "hf_config")
    convert_megatron_to_hf(ckpt, back)
    config = json.loads((back / "config.json").read_text())
    assert config["model_type"] == family  # guessed from the flags (qk-layernorm / qkv bias / neither)
    reloaded = AutoModelForCausalLM.from_pretrained(back, dtype=torch.float32).eval()
    from tools.checkpoint_conversion.families import rope_settings

    theta, scaling = rope_settings(reloaded.config.to_dict())  # as transformers understood the written config
    assert theta == rope_settings(hf_model.config.to_dict())[0]
    assert (scaling or {}).get("rope_type") == ("llama3" if overrides else None)
    if overrides:
        assert scaling["factor"] == 8.0
    assert config["vocab_size"] == 256
    tokens = torch.randint(0, 200, (1, 9))
    got = hf_logits(reloaded, tokens)
    torch.testing.assert_close(got[..., :200], hf_logits(hf_model, tokens), atol=1e-5, rtol=0)
    assert not got[..., 200:].any()


@pytest.mark.slow  # two fresh interpreters importing torch, transformers and megatron-core
def test_command_line_tools_from_another_directory(tmp_path):
    import os
    import subprocess

    repo = Path(__file__).resolve().parents[4]
    hf_dir, ckpt, back = tmp_path / "hf", tmp_path / "megatron", tmp_path / "hf_back"
    build_tiny_hf_model(hf_dir, "qwen3", tied=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)  # the scripts must find the repository on their own
    for cmd in ([sys.executable, str(repo / "tools" / "convert_hf_to_megatron.py"), "--hf-dir", str(hf_dir),
                 "--save", str(ckpt), "--target-tensor-parallel-size", "2"],
                [sys.executable, str(repo / "tools" / "convert_megatron_to_hf.py"), "--load", str(ckpt),
                 "--save", str(back)]):
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-4000:]
    assert "--tensor-model-parallel-size 2" in (ckpt / "megatron_args.txt").read_text()
    assert json.loads((ckpt / "conversion.json").read_text())["compatible_tensor_parallel_sizes"] == [1, 2]
    _assert_bitwise_equal_dirs(hf_dir, back)
