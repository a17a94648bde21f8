"""Flags -> megatron-core TransformerConfig / model; DDP hooks; metrics writer."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron.rl.training.config import ConfigError, parse_args
from megatron.rl.training.model_provider import transformer_config_from_args

BASE = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--train-iters", "1", "--lr", "1e-3"]


def _cfg(*flags, world_size=1):
    return parse_args([*BASE, *flags], world_size=world_size)


def test_architecture_flags_map_onto_transformer_config():
    cfg = _cfg("--swiglu", "--normalization", "RMSNorm", "--norm-epsilon", "1e-6", "--group-query-attention",
               "--num-query-groups", "2", "--disable-bias-linear", "--add-qkv-bias", "--qk-layernorm",
               "--init-method-std", "0.01", "--hidden-dropout", "0", "--ffn-hidden-size", "96")
    tc = transformer_config_from_args(cfg.model, cfg.parallel, cuda=False)
    assert tc.gated_linear_unit and tc.activation_func is F.silu and tc.normalization == "RMSNorm"
    assert tc.layernorm_epsilon == 1e-6 and tc.num_query_groups == 2 and tc.ffn_hidden_size == 96
    assert not tc.add_bias_linear and tc.add_qkv_bias and tc.qk_layernorm
    assert tc.init_method_std == 0.01 and tc.hidden_dropout == 0.0 and tc.kv_channels == 16


def test_cpu_settings():
    cfg = _cfg("--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
               "--global-batch-size", "2", world_size=2)
    tc = transformer_config_from_args(cfg.model, cfg.parallel, cuda=False)
    assert tc.use_cpu_initialization and tc.params_dtype == torch.float32 and tc.pipeline_dtype == torch.float32
    assert not (tc.bias_activation_fusion or tc.bias_dropout_fusion or tc.masked_softmax_fusion
                or tc.gradient_accumulation_fusion or tc.apply_rope_fusion or tc.persist_layer_norm)
    assert tc.batch_p2p_comm is False  # gloo + interleaved schedule gives wrong activations otherwise
    assert tc.virtual_pipeline_model_parallel_size == 2 and tc.cuda_graph_impl == "none"


def test_bf16_and_moe_and_overrides():
    cfg = _cfg("--bf16", "--num-experts", "4", "--moe-router-topk", "2", "--moe-ffn-hidden-size", "32",
               "--disable-bias-linear", "--moe-token-dispatcher-type", "alltoall", "--moe-aux-loss-coeff", "0.1",
               "--expert-model-parallel-size", "2", world_size=2)
    tc = transformer_config_from_args(cfg.model, cfg.parallel, cuda=False, calculate_per_token_loss=True)
    assert tc.bf16 and tc.params_dtype == torch.bfloat16 and tc.pipeline_dtype == torch.bfloat16
    assert tc.num_moe_experts == 4 and tc.moe_router_topk == 2 and tc.moe_ffn_hidden_size == 32
    assert tc.moe_token_dispatcher_type == "alltoall" and tc.moe_aux_loss_coeff == 0.1
    assert tc.expert_model_parallel_size == 2 and not tc.moe_grouped_gemm and not tc.moe_permute_fusion
    assert tc.calculate_per_token_loss is True


def test_build_model_wires_ddp_and_finalize_hook():
    from megatron.core.distributed import DistributedDataParallel, finalize_model_grads
    from megatron.core.models.gpt import GPTModel

    from megatron.rl.training.initialize import destroy_megatron, initialize_megatron
    from megatron.rl.training.model_provider import build_model, model_config, padded_vocab_size, unwrap_model
    from megatron.rl.training.tokenizer import build_tokenizer

    cfg = _cfg("--overlap-grad-reduce", "--untie-embeddings-and-output-weights", "--vocab-size", "300")
    try:
        initialize_megatron(cfg)
        assert padded_vocab_size(cfg) == 384
        chunks = build_model(cfg)
        assert len(chunks) == 1 and isinstance(chunks[0], DistributedDataParallel)
        gpt = unwrap_model(chunks)[0]
        assert isinstance(gpt, GPTModel) and gpt.vocab_size == 384
        assert gpt.embedding.word_embeddings.weight.shape == (384, 64) and gpt.output_layer.weight is not None
        tc = model_config(chunks)
        assert tc.finalize_model_grads_func is finalize_model_grads
        assert tc.no_sync_func == chunks[0].no_sync and tc.grad_sync_func == chunks[0].start_grad_sync
        with pytest.raises(ConfigError, match="--vocab-size=200"):
            padded_vocab_size(_cfg("--vocab-size", "200"), tokenizer=build_tokenizer("ByteLevelTokenizer"))
    finally:
        destroy_megatron()


def test_metrics_writer_tensorboard_roundtrip(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from megatron.rl.training.loop import IterationStats
    from megatron.rl.training.metrics import build_metrics_writer

    cfg = _cfg("--tensorboard-dir", str(tmp_path))
    writer = build_metrics_writer(cfg)
    for it in (1, 2):
        writer.log_iteration(IterationStats(it, {"lm loss": 3.0 / it}, 0.5, 1e-3, False, 0.25, 8 * it), 1000)
    writer.log_scalars({"validation/lm loss": 2.0, "skip/nan": float("nan")}, 2)
    writer.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert [e.value for e in acc.Scalars("train/lm loss")] == [3.0, 1.5]
    assert [e.step for e in acc.Scalars("train/lm loss")] == [1, 2]
    assert acc.Scalars("train/tokens-per-second")[0].value == pytest.approx(4000.0)
    assert acc.Scalars("validation/lm loss")[0].value == 2.0
    assert "skip/nan" not in acc.Tags()["scalars"]


def test_no_writer_without_flags():
    from megatron.rl.training.metrics import build_metrics_writer

    assert build_metrics_writer(_cfg()) is None
