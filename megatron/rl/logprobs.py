"""Per-token log-probs and entropy from (vocab-parallel) logits, at the sampling temperature.

With tensor parallelism each rank holds ``V / TP`` columns of the logits. Log-probs go through
megatron-core's ``vocab_parallel_cross_entropy`` (which all-reduces max and sum over the TP group and is
differentiable); entropy through :mod:`megatron.rl.algorithms.entropy`'s partial sums, all-reduced with
megatron's autograd-aware region ops. With TP = 1 both reduce to the plain full-vocabulary formulas
(:func:`megatron.rl.algorithms.logprobs.token_logprobs`, :func:`~megatron.rl.algorithms.entropy_from_logits`).

Temperature: the inference backends report log-probs under ``softmax(logits / T)`` (T = 1 for greedy);
the trainer must score the same distribution, so every function here takes ``temperature``.
"""
from __future__ import annotations

import torch

from megatron.rl.algorithms.entropy import entropy_from_partials, entropy_partials
from megatron.rl.algorithms.logprobs import logprob_temperature


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(labels | context) under softmax(logits / T).

    Args:
        logits: [..., V / TP] this rank's vocab shard (any leading shape, e.g. [b, s]).
        labels: [...] global token ids (int64).
    Returns: float32 [...], differentiable w.r.t. ``logits``.
    """
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    scaled = logits.float() / logprob_temperature(temperature)
    return -vocab_parallel_cross_entropy(scaled, labels)


def token_entropy(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / T) per position, [..., V / TP] -> float32 [...], differentiable."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    scaled = logits.float() / logprob_temperature(temperature)
    row_max = scaled.detach().max(dim=-1).values  # the shift cancels exactly, so no gradient is needed
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    if tp > 1:
        torch.distributed.all_reduce(row_max, op=torch.distributed.ReduceOp.MAX,
                                     group=ps.get_tensor_model_parallel_group())
    sum_exp, sum_exp_shifted = entropy_partials(scaled, row_max)
    if tp > 1:
        sum_exp = reduce_from_tensor_model_parallel_region(sum_exp)
        sum_exp_shifted = reduce_from_tensor_model_parallel_region(sum_exp_shifted)
    return entropy_from_partials(sum_exp, sum_exp_shifted)
