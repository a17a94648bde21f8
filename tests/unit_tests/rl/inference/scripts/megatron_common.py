"""Shared pieces of the Megatron-backend tests: process-group setup, a tiny GPT, a teacher-forced reference."""
from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist

from megatron.rl.runtime import setup_runtime

VOCAB = 384  # ByteLevelTokenizer's 259 ids, padded to a multiple of 128
SEQ = 160


def init_distributed(tp: int = 1) -> None:
    """Initialise torch.distributed (gloo; a 1-process world when not launched by torchrun) and parallel_state."""
    setup_runtime()
    from megatron.core import parallel_state as ps

    if not dist.is_initialized():
        if "RANK" not in os.environ:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        else:
            dist.init_process_group("gloo")
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(1234)
    model_parallel_cuda_manual_seed(1234)


def tiny_gpt(tp: int = 1, hidden: int = 64, layers: int = 2, heads: int = 4, seq: int = SEQ, vocab: int = VOCAB,
             experts: int | None = None, topk: int = 2, swiglu: bool = False, **moe: object):
    """A tiny fp32 GPTModel (local spec, RoPE, RMSNorm, a gated GELU MLP with biases, GQA with 2 KV heads), same
    weights for any TP; ``swiglu``: the quickstart's MLP instead (SiLU gate, no biases); ``experts``: every layer's
    MLP a mixture of that many experts, ``topk`` per token (local spec, EP = 1), ``moe``: more ``TransformerConfig``
    MoE fields."""
    import torch.nn.functional as F

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    config = TransformerConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, num_query_groups=2,
        use_cpu_initialization=True, params_dtype=torch.float32, pipeline_dtype=torch.float32,
        gradient_accumulation_fusion=False, bias_activation_fusion=False, bias_dropout_fusion=False,
        apply_rope_fusion=False, masked_softmax_fusion=False, persist_layer_norm=False,
        cross_entropy_loss_fusion=False, hidden_dropout=0.0, attention_dropout=0.0,
        normalization="RMSNorm", gated_linear_unit=True, tensor_model_parallel_size=tp,
        init_method_std=0.1,  # a larger init than usual so untrained logits are far from uniform
        **(dict(activation_func=F.silu, add_bias_linear=False) if swiglu else {}),
        **({} if experts is None else dict(num_moe_experts=experts, moe_router_topk=topk, moe_aux_loss_coeff=0.0,
                                           moe_router_load_balancing_type="none", moe_permute_fusion=False,
                                           moe_token_dispatcher_type="alltoall", **moe)))
    spec = get_gpt_layer_local_spec(num_experts=experts, normalization="RMSNorm")
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=vocab, max_sequence_length=seq,
                    position_embedding_type="rope")


def peaked_tiny_gpt(scale: float = 3.0, **kwargs):
    """:func:`tiny_gpt` with its matrices scaled by ``scale``: distributions peaked like a trained policy's (mean
    |log-prob| of sampled tokens of several nats), where rounding differences between two forwards show most."""
    model = tiny_gpt(**kwargs)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 2:
                p.mul_(scale)
    return model


def full_logits(model, token_ids: list[int]) -> torch.Tensor:
    """A plain training-style forward (no KV cache) of one sequence -> gathered logits [len, vocab]."""
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    was_training = model.training
    model.eval()
    with torch.no_grad():
        ids = torch.tensor([token_ids])
        logits = model(ids, torch.arange(len(token_ids))[None], None)
        logits = gather_from_tensor_model_parallel_region(logits)
    model.train(was_training)
    return logits[0].float()


def teacher_forced_logprobs(model, token_ids: list[int], prompt_length: int, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each generated token given everything before it -> [len - prompt_length]."""
    t = 1.0 if temperature == 0 else temperature
    logits = full_logits(model, token_ids)
    lp = torch.log_softmax(logits / t, dim=-1)
    targets = torch.tensor(token_ids[prompt_length:])
    return lp[prompt_length - 1:-1].gather(-1, targets[:, None])[:, 0]


class CharTokenizer:
    """Every id is one distinct printable character (ids 0..vocab-2; the last id is EOS), so text and tokens align."""

    def __init__(self, vocab_size: int = VOCAB):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = self.eod
        self.bos = None
        self.eos_token_ids = {self.eod}

    def tokenize(self, text: str) -> list[int]:
        return [ord(c) - 0x100 for c in text]

    def detokenize(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(0x100 + int(i)) for i in ids if 0 <= int(i) < self.eod)

    def offsets(self, ids, text: str) -> list[int]:
        return list(range(len(ids)))

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(m["content"] for m in messages)

    def text(self, *ids: int) -> str:
        return self.detokenize(ids)


# Engine runs that move requests around: requests finishing at different steps with chunked prefill ("rows move"),
# a cache too small for all requests, so the engine pauses and evicts, then prefills again ("evictions"), and decode
# steps padded to a few row counts, whose padding rows have no request ("decode buckets").
ENGINE_CASES = ("rows move", "evictions", "decode buckets")


def engine_case(case: str):
    """(requests, EngineSettings overrides) of one of :data:`ENGINE_CASES`: five prompts (one a prompt group), greedy
    and sampled, seeded, of several lengths."""
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    lengths, settings = {"rows move": ([3, 9, 17, 30], dict(max_tokens=64)),  # the long prompt prefilled in chunks
                         "evictions": ([40, 60, 90], dict(buffer_size_gb=0.0004)),  # room for ~10 requests' blocks
                         "decode buckets": ([3, 9, 17, 30], dict(decode_buckets=(8, 16, 32, 64)))}[case]
    prompts = ["a", "Q: 12+7=? A:", "the quick brown fox jumps over the lazy", "xy", "hello world"]
    requests = [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=t, max_tokens=n, seed=10 * j + i))
                for j, p in enumerate(prompts) for i, n in enumerate(lengths) for t in (0.0, 1.0)]
    return requests, settings
