"""Token sampling shared by every backend that samples itself (megatron, huggingface, fake).

Pure functions on last-token logits. Log-probs are under ``softmax(logits / T)`` before top-k/top-p
truncation (T = 1 for greedy), per the contract in :mod:`megatron.rl.inference.api`: that is what the
RL trainer recomputes. (The megatron-core 0.16.1 dynamic engine would report log-probs of the
*untempered* ``log_softmax(logits)``, which is why the Megatron backend samples here instead.)

Every function takes per-row parameters so one call serves a batch whose requests use different
temperatures, top-k and top-p values; :func:`sample_next` is the one-call form for backends that
hold per-request settings.
"""
from __future__ import annotations

from typing import Protocol, Sequence

import torch

__all__ = ["tempered_log_probs", "truncation_mask", "NoiseStream", "sample_tokens", "sample_next", "host_sampling"]


class NoiseStream:
    """A seeded request's sampling noise: the numbers ``torch.rand(vocab, generator=g)`` would give step after step,
    drawn in blocks of several steps.

    A CPU generator draws sequentially, so ``torch.rand(k, vocab)`` holds the next ``k`` steps' rows bit for bit
    (``test_sampling.py`` checks it), and a step of 128 seeded requests needs one slice per request instead of
    one ``uniform_`` call each (~1.5 ms of a ~30 ms decode step of a small model). Blocks double in rows from
    2 (a request drawing for ``n`` steps draws fewer than ``2n`` rows in ``log2 n`` calls: numbers drawn for
    steps that never come cost time too) up to about :attr:`BLOCK_ELEMENTS` numbers, one row when the
    vocabulary is that large. Other devices' generators (offset-based) draw one row at a time, as before.
    """

    BLOCK_ELEMENTS = 64 * 1024

    def __init__(self, generator: torch.Generator):
        self.generator = generator
        self._block: torch.Tensor | None = None
        self._used = 0
        self._rows = 1

    def next(self, vocab: int) -> torch.Tensor:
        """The next step's noise [vocab] (fp32 on the generator's device)."""
        block = self._block
        if block is not None and self._used < block.shape[0]:
            if block.shape[1] != vocab:
                raise ValueError(f"NoiseStream: vocabulary changed from {block.shape[1]} to {vocab} mid-stream")
            self._used += 1
            return block[self._used - 1]
        device = self.generator.device
        if device.type == "cpu":
            self._rows = max(1, min(2 * self._rows, self.BLOCK_ELEMENTS // vocab))
        self._block, self._used = torch.rand(self._rows, vocab, generator=self.generator, device=device), 1
        return self._block[0]


def tempered_log_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """log softmax(logits / T) per row, in fp32.

    logits: [B, V]; temperature: [B] (rows with T == 0 are greedy and use T = 1, as the contract says).
    Returns [B, V] in fp32 (fp64 logits stay fp64).
    """
    dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature)).to(dtype)
    return torch.log_softmax(logits.to(dtype) / t[:, None], dim=-1)


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
                  generators: Sequence[torch.Generator | None], shared: torch.Generator | None,
                  sampled_rows: Sequence[int] | None = None, truncate: bool | None = None) -> torch.Tensor:
    """Sample one token per row.

    Greedy rows (T == 0) take the argmax. Other rows sample from the truncated, renormalised
    distribution with the exponential race (argmax of p / E, E ~ Exp(1), E = -log U), which draws each row's
    noise independently: a row with its own generator (a seeded request) gets the same tokens no matter
    which other requests share the batch; rows without one draw from ``shared`` in one call.

    log_probs: [B, V] from :func:`tempered_log_probs`; temperature/top_k/top_p: [B];
    generators: B entries (None = use ``shared``), generators or :class:`NoiseStream` s (the same draws), all on
    ``log_probs.device``; ``shared`` None = torch's default generator. Returns token ids [B] (int64).
    ``sampled_rows`` (the rows with T > 0, in order) and ``truncate`` (whether any row has top-k or top-p on): what
    the caller knows on the host from its requests' settings; given, the function reads nothing back from the
    tensors (no device-to-host copy: a GPU can capture it in a graph); None = read from the tensors.
    """
    batch = log_probs.shape[0]
    if sampled_rows is None:
        sampled_rows = (temperature > 0).nonzero(as_tuple=True)[0].tolist()
    sampled_rows = list(sampled_rows)
    if not sampled_rows:
        return log_probs.argmax(dim=-1)
    every_row = len(sampled_rows) == batch  # the common case: skip the row gathers and the greedy argmax
    rows = None if every_row else torch.tensor(sampled_rows, dtype=torch.long, device=log_probs.device)
    lp = log_probs if every_row else log_probs[rows]
    probs = lp.exp()
    k, p = (top_k, top_p) if every_row else (top_k[rows], top_p[rows])
    if truncate is None:
        truncate = bool(((k > 0) | (p < 1.0)).any())
    if truncate:  # the sort in truncation_mask is the costly part: skip when unused
        probs = probs.masked_fill(~truncation_mask(lp, k, p), 0.0)
    # Exp(1) noise as -log(U): U in [0, 1) makes E in (0, inf], so a zeroed (truncated) token scores 0 / E = 0,
    # never NaN. (``Tensor.exponential_`` draws the same distribution ~8x slower on CPU.)
    vocab = probs.shape[1]
    own = [(i, generators[r]) for i, r in enumerate(sampled_rows) if generators[r] is not None]
    if own and len(own) == len(sampled_rows) and all(isinstance(g, NoiseStream) for _, g in own):
        uniform = torch.stack([g.next(vocab) for _, g in own])  # the common case: one op for all rows
    else:
        if len(own) == len(sampled_rows):
            uniform = torch.empty(len(sampled_rows), vocab, device=probs.device)
        else:
            uniform = torch.rand(len(sampled_rows), vocab, generator=shared, device=probs.device)
        for i, g in own:  # in place: the same draws as torch.rand(vocab, generator=g), without a tensor per row
            if isinstance(g, NoiseStream):
                uniform[i] = g.next(vocab)
            else:
                uniform[i].uniform_(generator=g)
    choice = (probs / uniform.to(probs.dtype).log().neg_()).argmax(dim=-1)
    if every_row:
        return choice
    out = log_probs.argmax(dim=-1)
    out[rows] = choice
    assert out.shape == (batch,)
    return out


class SamplingSettings(Protocol):
    """What :func:`sample_next` reads of one request (``GenerationArgs`` and ``SampleSpec`` have it)."""

    temperature: float
    top_k: int
    top_p: float


def sample_next(logits: torch.Tensor, settings: Sequence[SamplingSettings],
                generators: Sequence[torch.Generator | None],
                shared: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row of ``logits`` [B, V], row ``i`` with ``settings[i]`` and ``generators[i]``.

    Returns ``(tokens [B] int64, log_probs [B])``: each log-prob under ``softmax(logits / T)`` of its row
    (T = 1 when greedy), before truncation. See :func:`sample_tokens` for the generators.
    """
    device = logits.device
    # fp64 logits (the fake backend) keep fp64 temperatures: 0.7 must not become float32's 0.69999999
    float_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    temperature = torch.tensor([s.temperature for s in settings], dtype=float_dtype, device=device)
    top_k = torch.tensor([s.top_k for s in settings], dtype=torch.long, device=device)
    top_p = torch.tensor([s.top_p for s in settings], dtype=torch.float32, device=device)
    log_probs = tempered_log_probs(logits, temperature)
    tokens = sample_tokens(log_probs, temperature, top_k, top_p, generators, shared, *host_sampling(settings))
    return tokens, log_probs.gather(-1, tokens[:, None])[:, 0]


def host_sampling(settings: Sequence[SamplingSettings]) -> tuple[list[int], bool]:
    """(rows with T > 0, whether any row truncates): :func:`sample_tokens`'s host-side knowledge of a batch."""
    return ([i for i, s in enumerate(settings) if s.temperature > 0],
            any(s.top_k > 0 or s.top_p < 1.0 for s in settings))
