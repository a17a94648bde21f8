"""Per-token log-probs of the sampled tokens from logits, at the sampling temperature.

The trainer must score tokens under the same distribution the inference engine sampled from:
``softmax(logits / T)``. Following the inference API contract, greedy decoding (T = 0) is scored at
T = 1. With tensor parallelism the vocab is sharded; there use megatron-core's
``tensor_parallel.vocab_parallel_cross_entropy(logits / T, labels)`` and negate it (same value).
"""
from __future__ import annotations

import torch


def logprob_temperature(temperature: float) -> float:
    """The temperature to score with: T for T > 0, 1.0 for greedy (T == 0); ValueError for T < 0."""
    if temperature < 0:
        raise ValueError(f"sampling temperature must be >= 0 (--rl-default-temperature), got {temperature}")
    return float(temperature) if temperature > 0 else 1.0


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log softmax(logits / T)[label] per position. logits [..., V], labels [...] -> float32+ [...].

    Half-precision logits are upcast to float32 before the softmax (bf16 log-probs are too coarse
    for PPO ratios).
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and labels {tuple(labels.shape)} disagree")
    t = logprob_temperature(temperature)
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    if t != 1.0:
        logits = logits / t
    return torch.log_softmax(logits, dim=-1).gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
