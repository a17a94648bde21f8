"""Per-token entropy of the policy's next-token distribution, and the entropy bonus.

``entropy_from_logits`` works on full-vocabulary logits [N, V]. With tensor parallelism the vocab
is sharded; :func:`entropy_partials` computes per-shard sums against a global max, which the caller
all-reduces (SUM) across the tensor-parallel group before :func:`entropy_from_partials`. The pieces
are pure functions; the two collectives belong to the caller.

Apply the sampling temperature before calling (pass ``logits / T``).
"""
from __future__ import annotations

import torch


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """H = logsumexp(l) - sum softmax(l) * l over the last dim. logits [..., V] -> [...] (float32+)."""
    logits = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
    log_z = torch.logsumexp(logits, dim=-1)
    probs = torch.softmax(logits, dim=-1)
    return log_z - (probs * logits).sum(dim=-1)


def entropy_partials(logits_shard: torch.Tensor, global_max: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For one vocab shard [..., V/tp] and the all-reduced (MAX) row max [...]: return
    (sum exp(l - max), sum exp(l - max) * (l - max)), each [...]; all-reduce both with SUM."""
    shifted = logits_shard.float() - global_max.unsqueeze(-1)
    e = torch.exp(shifted)
    return e.sum(dim=-1), (e * shifted).sum(dim=-1)


def entropy_from_partials(sum_exp: torch.Tensor, sum_exp_shifted: torch.Tensor) -> torch.Tensor:
    """Entropy [...] from the all-reduced partial sums: H = log S - (sum e * (l - m)) / S."""
    return torch.log(sum_exp) - sum_exp_shifted / sum_exp


def entropy_bonus(entropy: torch.Tensor, weight: float) -> torch.Tensor:
    """Per-token loss term ``-weight * entropy`` [N] (a bonus: minimising the loss raises entropy).

    ``entropy`` is precomputed (by :func:`entropy_from_logits` or the vocab-parallel pieces), so a
    vocab-parallel caller never materialises full-vocabulary logits here.
    """
    if weight == 0:
        return torch.zeros_like(entropy)
    return -weight * entropy
