"""Tiny random Hugging Face Llama / Qwen2 / Qwen3 models built from configs (no downloads), for conversion tests."""
from __future__ import annotations

import copy
from pathlib import Path

import torch

# vocab 200 is not a multiple of 128, so Megatron pads it (256 at TP=1, 256 at TP=2): padding is exercised.
_COMMON = dict(vocab_size=200, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6)


def tiny_config(family: str, tied: bool = False, **overrides):
    """A transformers config of ``family`` ('llama', 'qwen2', 'qwen3', 'qwen3_moe') with tiny shapes."""
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config, Qwen3MoeConfig

    kw = {**_COMMON, "tie_word_embeddings": tied, **overrides}
    if family == "llama":
        return LlamaConfig(rope_theta=500000.0, **kw)
    if family == "qwen2":
        return Qwen2Config(rope_theta=1000000.0, **kw)
    if family == "qwen3":
        # head_dim 32 != hidden/heads = 16, as in real Qwen3 models (head_dim 128 with hidden 2560 etc.)
        return Qwen3Config(rope_theta=1000000.0, head_dim=kw.pop("head_dim", 32), **kw)
    if family == "qwen3_moe":
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
        return Qwen3MoeConfig(rope_theta=1000000.0, head_dim=kw.pop("head_dim", 32), **{**moe, **kw})
    raise ValueError(family)


def build_tiny_hf_model(path: str | Path, family: str, tied: bool = False, seed: int = 0, tokenizer: bool = True,
                        dtype: torch.dtype = torch.float32, max_shard_size: str | None = None, **overrides):
    """Save a random ``family`` model (non-trivial norm weights and biases) to ``path``; return it in fp32.

    ``dtype``: dtype of the saved weights; ``max_shard_size`` (e.g. "40KB"): save as several safetensors
    files with an index, as large published checkpoints are.
    """
    from transformers import AutoModelForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(family, tied, **overrides)).float().eval()
    with torch.no_grad():  # the default init leaves norms at 1 and biases at 0: randomise so mixups would show
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.5 * torch.randn_like(p))
        for p in model.parameters():  # the fp32 reference holds exactly the saved values
            p.copy_(p.to(dtype).float())
    # cast a copy: casting the model itself would also round fp32 buffers such as RoPE's inv_freq
    copy.deepcopy(model).to(dtype).save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size
                                                            else {}))
    if tokenizer:
        save_tiny_tokenizer(path)
    return model


def save_tiny_tokenizer(path: str | Path) -> None:
    """A word-level tokenizer with 10 tokens, saved as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<pad>", "<s>", "</s>", "<unk>", "1", "2", "+", "=", "hello", "world"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<unk>").save_pretrained(path)


def hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s, vocab]`` fp32 logits of a Hugging Face causal LM."""
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    """``[b, s, padded_vocab / TP]`` logits of a megatron-core GPTModel (this TP rank's vocab shard)."""
    b, s = tokens.shape
    position_ids = torch.arange(s).unsqueeze(0).expand(b, s)
    # causal mask: True = masked (megatron-core's convention)
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), diagonal=1).view(1, 1, s, s)
    model.eval()
    with torch.no_grad():
        return model(tokens, position_ids, mask).float()
