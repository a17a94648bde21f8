"""Token sampling for the Megatron backend: pure functions on last-token logits.

The megatron-core 0.16.1 dynamic engine samples from ``softmax(logits / T)`` (after top-k/top-p
filtering) but reports log-probs of the *untempered* ``log_softmax(logits)``. The RL trainer
recomputes log-probs under ``softmax(logits / T)``, so the backend samples here instead and
reports exactly that distribution's log-probs (before truncation), per the contract in
:mod:`megatron.rl.inference.api`.

Every function takes per-row parameters so one call serves a batch whose requests use different
temperatures, top-k and top-p values.
"""
from __future__ import annotations

from typing import Sequence

import torch

__all__ = ["tempered_log_probs", "truncation_mask", "sample_tokens"]


def tempered_log_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) per row, in fp32.

    logits: [B, V]; temperature: [B] (rows with T == 0 are greedy and use T = 1, as the contract says).
    Returns [B, V].
    """
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(torch.float32)
    return torch.log_softmax(logits.float() / t[:, None], dim=-1)


def truncation_mask(log_probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Which tokens survive top-k and top-p truncation, per row.

    log_probs: [B, V] (already temperature-scaled); top_k: [B] ints, 0 = off; top_p: [B] floats in (0, 1],
    1 = off. A token survives top-p when the probability mass of the tokens ranked strictly above it is
    below ``p`` (so the most likely token always survives). Both filters apply when both are set.
    Returns a bool mask [B, V].
    """
    sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True)
    vocab = log_probs.shape[-1]
    rank = torch.arange(vocab, device=log_probs.device)[None, :]
    keep_sorted = torch.ones_like(sorted_lp, dtype=torch.bool)
    k = top_k.to(log_probs.device).long()
    keep_sorted &= (k[:, None] <= 0) | (rank < k[:, None])
    mass_above = torch.cumsum(sorted_lp.exp(), dim=-1) - sorted_lp.exp()
    p = top_p.to(log_probs.device, torch.float32)[:, None]
    keep_sorted &= (p >= 1.0) | (mass_above < p)  # p == 1 is "off" (cumsum rounding must not cut the tail)
    keep_sorted[:, 0] = True
    return torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)


def sample_tokens(log_probs: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                  generators: Sequence[torch.Generator | None], shared: torch.Generator) -> torch.Tensor:
    """Sample one token per row.

    Greedy rows (T == 0) take the argmax. Other rows sample from the truncated, renormalised
    distribution with the exponential race (argmax of p / E, E ~ Exp(1), E = -log U), which draws each row's
    noise independently: a row with its own generator (a seeded request) gets the same tokens no matter
    which other requests share the batch; rows without one draw from ``shared`` in one call.

    log_probs: [B, V] from :func:`tempered_log_probs`; temperature/top_k/top_p: [B];
    generators: B entries (None = use ``shared``), all on ``log_probs.device``. Returns token ids [B] (int64).
    """
    batch = log_probs.shape[0]
    sampled_rows = (temperature > 0).nonzero(as_tuple=True)[0].tolist()
    if not sampled_rows:
        return log_probs.argmax(dim=-1)
    every_row = len(sampled_rows) == batch  # the common case: skip the row gathers and the greedy argmax
    rows = None if every_row else torch.tensor(sampled_rows, dtype=torch.long, device=log_probs.device)
    lp = log_probs if every_row else log_probs[rows]
    probs = lp.exp()
    k, p = (top_k, top_p) if every_row else (top_k[rows], top_p[rows])
    if bool(((k > 0) | (p < 1.0)).any()):  # the sort in truncation_mask is the costly part: skip when unused
        probs = probs.masked_fill(~truncation_mask(lp, k, p), 0.0)
    # Exp(1) noise as -log(U): U in [0, 1) makes E in (0, inf], so a zeroed (truncated) token scores 0 / E = 0,
    # never NaN. (``Tensor.exponential_`` draws the same distribution ~8x slower on CPU.)
    vocab = probs.shape[1]
    own = [(i, generators[r]) for i, r in enumerate(sampled_rows) if generators[r] is not None]
    if len(own) == len(sampled_rows):
        uniform = torch.stack([torch.rand(vocab, generator=g, device=probs.device) for _, g in own])
    else:
        uniform = torch.rand(len(sampled_rows), vocab, generator=shared, device=probs.device)
        for i, g in own:
            uniform[i] = torch.rand(vocab, generator=g, device=probs.device)
    choice = (probs / uniform.to(probs.dtype).log().neg_()).argmax(dim=-1)
    if every_row:
        return choice
    out = log_probs.argmax(dim=-1)
    out[rows] = choice
    assert out.shape == (batch,)
    return out
