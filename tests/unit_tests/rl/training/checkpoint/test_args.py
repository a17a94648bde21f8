"""Checkpoints carry their model flags; --use-checkpoint-args fills them; conflicts are named; old checkpoints load."""
from __future__ import annotations

import logging

import pytest
import torch

# a quickstart-like model (RoPE, SwiGLU, RMSNorm, no biases) with non-default lengths and vocab padding
FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--group-query-attention",
         "--num-query-groups", "2", "--seq-length", "24", "--max-position-embeddings", "40", "--swiglu",
         "--ffn-hidden-size", "48", "--normalization", "RMSNorm", "--position-embedding-type", "rope",
         "--rotary-base", "5000", "--disable-bias-linear", "--make-vocab-size-divisible-by", "16",
         "--untie-embeddings-and-output-weights", "--tokenizer-type", "ByteLevelTokenizer"]


def _parse(argv):
    from megatron.rl.training.config import parse_args

    return parse_args(argv, world_size=1)


def _save(cfg, path, with_flags=True):
    """Build cfg's model with the training package, save it (model only) and return it."""
    from megatron.rl.training.checkpoint.save_load import save_checkpoint
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model, checkpoint_model_args
    from megatron.rl.training.tokenizer import build_tokenizer

    initialize_megatron(cfg)
    tok = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
    model = build_model(cfg, wrap_with_ddp=False, tokenizer=tok)
    margs = checkpoint_model_args(cfg, tok)
    if not with_flags:  # what checkpoints saved before this change hold
        margs = {k: v for k, v in margs.items() if k != "flags"} | {"vocab_size": None}
    save_checkpoint(path, 3, model, model_args=margs)
    return model


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from megatron.rl.training.initialize import destroy_megatron

    root = tmp_path_factory.mktemp("ckargs")
    cfg = _parse(FLAGS)
    model = _save(cfg, root / "new")
    _save(cfg, root / "old", with_flags=False)
    yield cfg, model, root
    destroy_megatron()


def _model_fields(cfg):
    keep = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "seq_length", "max_position_embeddings", "swiglu", "normalization", "position_embedding_type",
            "rotary_base", "untie_embeddings_and_output_weights", "disable_bias_linear",
            "make_vocab_size_divisible_by", "group_query_attention")
    return {k: getattr(cfg.model, k) for k in keep}


def test_checkpoint_alone_gives_the_model_flags_and_loads(saved):
    from megatron.rl.training.checkpoint.args import read_checkpoint_flags
    from megatron.rl.training.checkpoint.save_load import load_checkpoint
    from megatron.rl.training.model_provider import build_model, checkpoint_model_args

    cfg, model, root = saved
    assert read_checkpoint_flags(root / "new")["vocab_size"] == 259  # resolved, not None
    got = _parse(["--use-checkpoint-args", "--load", str(root / "new")])
    assert _model_fields(got) == _model_fields(cfg)
    assert got.model.max_position_embeddings == 40 != got.model.seq_length  # nothing defaulted from another
    assert got.tokenizer.tokenizer_type == "ByteLevelTokenizer" and got.tokenizer.vocab_size == 259
    # a non-model flag given next to it is untouched, and the model built from the flags loads the weights
    assert _parse(["--use-checkpoint-args", "--load", str(root / "new"), "--lr", "0.5"]).optim.lr == 0.5
    fresh = build_model(got, wrap_with_ddp=False)
    load_checkpoint(root / "new", fresh, load_optimizer=False, load_rng=False, model_args=checkpoint_model_args(got))
    for (name, a), b in zip(model[0].state_dict().items(), fresh[0].state_dict().values()):
        if isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name


def test_pretrained_checkpoint_is_the_source_when_load_is_empty(saved, tmp_path):
    _, _, root = saved
    got = _parse(["--use-checkpoint-args", "--load", str(tmp_path / "fresh_run"), "--pretrained-checkpoint",
                  str(root / "new")])
    assert got.model.num_query_groups == 2 and got.model.rotary_base == 5000


def test_explicit_flags_conflicting_with_the_checkpoint(saved, caplog):
    from megatron.rl.training.config import ConfigError

    _, _, root = saved
    base = ["--use-checkpoint-args", "--load", str(root / "new")]
    with pytest.raises(ConfigError, match=r"--num-layers=3 contradicts the checkpoint.*--num-layers=2"):
        _parse([*base, "--num-layers", "3"])
    with pytest.raises(ConfigError, match="--add-qkv-bias=True contradicts"):  # adds what the checkpoint lacks
        _parse([*base, "--add-qkv-bias"])
    assert _parse([*base, "--num-layers=2"]).model.num_layers == 2  # agreeing is fine (both spellings)
    with caplog.at_level(logging.WARNING):  # lengths may change: RoPE has no per-position weights
        got = _parse([*base, "--seq-length", "32", "--max-position-embeddings", "64"])
    assert (got.model.seq_length, got.model.max_position_embeddings) == (32, 64)
    assert "overrides the checkpoint" in caplog.text


def test_old_checkpoint_needs_and_accepts_explicit_flags(saved):
    from megatron.rl.training.checkpoint.save_load import load_checkpoint
    from megatron.rl.training.config import ConfigError
    from megatron.rl.training.model_provider import build_model, checkpoint_model_args

    _, _, root = saved
    with pytest.raises(ConfigError, match="stores no model flags.*--num-layers"):
        _parse(["--use-checkpoint-args", "--load", str(root / "old")])
    with pytest.raises(ConfigError, match="pass --load DIR or --pretrained-checkpoint"):
        _parse(["--use-checkpoint-args", *FLAGS])
    # explicit flags (and an explicit --vocab-size, which the old checkpoint stored as None) load it
    cfg = _parse([*FLAGS, "--vocab-size", "259"])
    load_checkpoint(root / "old", build_model(cfg, wrap_with_ddp=False), load_optimizer=False, load_rng=False,
                    model_args=checkpoint_model_args(cfg))
