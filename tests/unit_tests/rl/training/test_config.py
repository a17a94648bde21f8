"""Flag parsing into TrainingConfig: derived values, extra providers, and every validation error."""
from __future__ import annotations

import pytest

from megatron.rl.training import config as config_mod
from megatron.rl.training.config import ConfigError, parse_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "10", "--lr", "1e-3", "--mock-data"]


def parse(*extra, world_size=1, **kw):
    return parse_args([*BASE, *extra], world_size=world_size, **kw)


def test_sections_and_derived_values():
    cfg = parse("--global-batch-size", "16", "--swiglu", "--tensor-model-parallel-size", "2",
                "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
                world_size=4)
    m, p, t = cfg.model, cfg.parallel, cfg.train
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.seq_length) == (4, 64, 4, 32)
    # Megatron's SwiGLU rule: int(4h * 2/3 / 64) * 64 = int(170.67 / 64) * 64 = 128
    assert m.ffn_hidden_size == 128
    assert m.kv_channels == 16 and m.num_query_groups == 4 and m.max_position_embeddings == 32
    assert m.normalization == "RMSNorm" and m.position_embedding_type == "rope" and not m.add_bias_linear
    assert (p.world_size, p.data_parallel_size, p.expert_tensor_parallel_size) == (4, 2, 2)
    assert t.global_batch_size == 16 and t.num_microbatches == 4  # 16 / (2 * DP 2)
    assert cfg.optim.lr_decay_iters == 10 and cfg.optim.start_weight_decay == cfg.optim.weight_decay
    assert cfg.data.mock_data and cfg.tokenizer.tokenizer_type == "ByteLevelTokenizer"
    assert cfg.model.transformer_impl == "local" and cfg.model.use_cpu_initialization is True


def test_defaults_follow_megatron():
    cfg = parse()
    assert cfg.model.ffn_hidden_size == 256 and cfg.train.global_batch_size == 2  # 4h; mbs * DP
    assert cfg.model.hidden_dropout == 0.1 and cfg.model.normalization == "LayerNorm"
    assert cfg.model.position_embedding_type == "learned_absolute"
    assert cfg.optim.clip_grad == 1.0 and cfg.optim.lr_decay_style == "linear"
    assert cfg.checkpoint.ckpt_format == "torch_dist"


def test_gqa_virtual_pipeline_and_moe():
    cfg = parse("--group-query-attention", "--num-query-groups", "2", "--pipeline-model-parallel-size", "2",
                "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", world_size=2)
    assert cfg.model.num_query_groups == 2
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2 and cfg.train.num_microbatches == 2
    moe = parse("--num-experts", "4", "--expert-model-parallel-size", "2", "--moe-ffn-hidden-size", "32",
                "--disable-bias-linear", world_size=2)
    assert moe.model.num_experts == 4 and moe.model.moe_ffn_hidden_size == 32
    assert moe.parallel.expert_model_parallel_size == 2


def test_world_size_from_env(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert parse(world_size=None).parallel.data_parallel_size == 2


def test_extra_args_providers_land_in_extra():
    def provider(parser):
        g = parser.add_argument_group("rl")
        g.add_argument("--grpo-group-size", type=int, default=8)
        g.add_argument("--langrl-env-config", type=str)
        return parser

    cfg = parse("--grpo-group-size", "4", extra_args_providers=[provider])
    assert cfg.extra.grpo_group_size == 4 and cfg.extra.langrl_env_config is None
    assert not hasattr(cfg.extra, "num_layers")


def test_model_args_is_json_able():
    import json

    args = parse("--vocab-size", "300").model_args()
    assert json.loads(json.dumps(args))["hidden_size"] == 64 and args["vocab_size"] == 300


ERRORS = [
    # (flags, world_size, substrings the message must contain)
    (["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"], 2,
     ["world size 2", "--tensor-model-parallel-size=2", "--pipeline-model-parallel-size=2"]),
    (["--tensor-model-parallel-size", "3"], 3, ["--num-attention-heads=4", "--tensor-model-parallel-size=3"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1, ["--num-query-groups=3"]),
    (["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "4"], 4,
     ["--num-query-groups=2", "--tensor-model-parallel-size=4"]),
    (["--group-query-attention"], 1, ["--num-query-groups"]),
    (["--num-query-groups", "2"], 1, ["--group-query-attention"]),
    (["--global-batch-size", "6"], 2, ["--global-batch-size=6", "--micro-batch-size=2", "data-parallel size 2"]),
    (["--bf16", "--fp16"], 1, ["--bf16", "--fp16"]),
    (["--num-experts", "4", "--tensor-model-parallel-size", "2", "--disable-bias-linear"], 2,
     ["--sequence-parallel"]),
    (["--num-experts", "3", "--expert-model-parallel-size", "2"], 2, ["--num-experts=3",
                                                                     "--expert-model-parallel-size=2"]),
    (["--expert-model-parallel-size", "2"], 2, ["--num-experts"]),
    (["--num-experts", "4", "--expert-model-parallel-size", "4", "--disable-bias-linear"], 2,
     ["world size 2", "--expert-model-parallel-size=4"]),
    (["--num-experts", "4", "--expert-tensor-parallel-size", "2", "--tensor-model-parallel-size", "2",
      "--sequence-parallel"], 2, ["--disable-bias-linear"]),
    (["--hidden-size", "66"], 1, ["--hidden-size=66", "--num-attention-heads=4"]),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, ["--num-layers=3"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ["--num-layers-per-virtual-pipeline-stage=3"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, ["--pipeline-model-parallel-size > 1"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1"], 2,
     ["interleaved", "--pipeline-model-parallel-size=2"]),
    (["--sequence-parallel", "--tensor-model-parallel-size", "2", "--seq-length", "33"], 2, ["--seq-length=33"]),
    (["--max-position-embeddings", "16"], 1, ["--max-position-embeddings=16"]),
    (["--hidden-dropout", "1.5"], 1, ["--hidden-dropout=1.5"]),
    (["--micro-batch-size", "0"], 1, ["--micro-batch-size=0"]),
    (["--lr-warmup-iters", "10"], 1, ["--lr-warmup-iters=10"]),
    (["--lr-decay-style", "WSD"], 1, ["--lr-wsd-decay-iters"]),
    (["--min-lr", "1e-2"], 1, ["--min-lr"]),
    (["--save-interval", "5"], 1, ["--save"]),
    (["--data-path", "x"], 1, ["--mock-data", "--data-path"]),
    (["--tokenizer-type", "HuggingFaceTokenizer"], 1, ["--tokenizer-model"]),
    (["--overlap-param-gather"], 1, ["--use-distributed-optimizer"]),
    (["--moe-grouped-gemm"], 1, ["--num-experts"]),
    (["--num-experts", "4", "--moe-router-topk", "5"], 1, ["--moe-router-topk=5"]),
]


@pytest.mark.parametrize("flags,world,needles", ERRORS, ids=[" ".join(e[0])[:60] for e in ERRORS])
def test_validation_errors_name_the_flag(flags, world, needles):
    with pytest.raises(ConfigError) as exc:
        parse(*flags, world_size=world)
    for needle in needles:
        assert needle in str(exc.value), (needle, str(exc.value))


def test_transformer_engine_requested_but_missing(monkeypatch):
    monkeypatch.setattr(config_mod, "transformer_engine_importable", lambda: False)
    with pytest.raises(ConfigError, match="transformer_engine is not importable"):
        parse("--transformer-impl", "transformer_engine")


def test_cpu_only_features_are_refused_on_cpu(monkeypatch):
    monkeypatch.setattr("megatron.rl.runtime.cuda_usable", lambda: False)
    with pytest.raises(ConfigError, match="--moe-grouped-gemm needs a CUDA GPU"):
        parse("--num-experts", "4", "--moe-grouped-gemm")
    with pytest.raises(ConfigError, match="--fp16 needs a CUDA GPU"):
        parse("--fp16")


def test_wandb_missing_is_a_clear_error(monkeypatch):
    real = config_mod.importlib.util.find_spec
    monkeypatch.setattr(config_mod.importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError, match="pip install wandb"):
        parse("--wandb-project", "p")


def test_unknown_flag_exits():
    with pytest.raises(SystemExit):
        parse("--no-such-flag")
