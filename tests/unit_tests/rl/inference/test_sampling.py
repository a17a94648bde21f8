"""Sampling math shared by the backends (pure functions), against slow references written another way."""
from __future__ import annotations

import math

import torch

from megatron.rl.inference.sampling import NoiseStream, sample_tokens, tempered_log_probs, truncation_mask


def _reference_keep(logits_row: list[float], temperature: float, top_k: int, top_p: float) -> set[int]:
    """Plain-python top-k / top-p: rank tokens, keep while the mass strictly above stays below p."""
    t = temperature if temperature > 0 else 1.0
    z = [x / t for x in logits_row]
    m = max(z)
    p = [math.exp(x - m) for x in z]
    s = sum(p)
    p = [x / s for x in p]
    order = sorted(range(len(p)), key=lambda i: -p[i])
    keep, above = set(), 0.0
    for rank, i in enumerate(order):
        if rank > 0 and ((top_k > 0 and rank >= top_k) or (top_p < 1.0 and above >= top_p)):
            continue
        keep.add(i)
        above += p[i]
    return keep


def test_tempered_log_probs_and_truncation_match_reference():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 11, generator=g) * 3
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.3, 0.5, 2.0])
    top_k = torch.tensor([0, 3, 0, 1, 4, 0])
    top_p = torch.tensor([1.0, 1.0, 0.5, 1.0, 0.9, 0.3])
    lp = tempered_log_probs(logits, temperature)
    for b in range(6):
        t = temperature[b].item() or 1.0
        expected = torch.log_softmax(logits[b].double() / t, -1).float()
        torch.testing.assert_close(lp[b], expected, atol=1e-5, rtol=0)
    keep = truncation_mask(lp, top_k, top_p)
    for b in range(6):
        ref = _reference_keep(logits[b].tolist(), temperature[b].item(), int(top_k[b]), float(top_p[b]))
        assert set(keep[b].nonzero()[:, 0].tolist()) == ref, b


def test_sampling_follows_the_truncated_tempered_distribution():
    logits = torch.tensor([2.0, 1.5, 1.0, 0.0, -1.0])
    rows = 40000
    lp = tempered_log_probs(logits.expand(rows, -1), torch.full((rows,), 0.8))
    tokens = sample_tokens(lp, torch.full((rows,), 0.8), torch.full((rows,), 3), torch.ones(rows),
                           [None] * rows, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=5).float() / rows
    p = torch.softmax(logits / 0.8, -1)[:3]
    expected = torch.cat([p / p.sum(), torch.zeros(2)])
    torch.testing.assert_close(freq, expected, atol=0.01, rtol=0)


def test_greedy_rows_and_seeded_rows():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(4, 50, generator=g)
    temperature = torch.tensor([0.0, 1.0, 1.0, 1.0])
    k, p = torch.zeros(4, dtype=torch.long), torch.ones(4)
    lp = tempered_log_probs(logits, temperature)

    def draw(shared_seed: int, other_logits: torch.Tensor) -> torch.Tensor:
        lps = lp.clone()
        lps[2] = tempered_log_probs(other_logits[None], torch.ones(1))[0]  # a different batch mate
        gens = [None, torch.Generator().manual_seed(42), None, None]
        return sample_tokens(lps, temperature, k, p, gens, torch.Generator().manual_seed(shared_seed))

    a = draw(0, logits[2])
    b = draw(99, torch.randn(50, generator=g))
    assert a[0] == logits[0].argmax() and b[0] == logits[0].argmax()
    assert a[1] == b[1]  # its own generator: unaffected by the shared seed and the other rows
    draws = torch.stack([draw(s, logits[2])[3] for s in range(20)])
    assert len(set(draws.tolist())) > 1  # unseeded rows do vary with the shared generator


def test_seeded_rows_and_mixed_batches_follow_the_distribution():
    """Per-row generators (every row seeded) and a batch with greedy rows sample the same distribution."""
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    rows = 4000
    expected = torch.softmax(logits, -1)
    temperature = torch.ones(rows)
    temperature[::4] = 0.0  # greedy rows force the gather path
    lp = tempered_log_probs(logits.expand(rows, -1), temperature)
    k, p = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    for gens in ([torch.Generator().manual_seed(i) for i in range(rows)], [None] * rows):
        tokens = sample_tokens(lp, temperature, k, p, gens, torch.Generator().manual_seed(5))
        assert (tokens[::4] == 0).all()
        sampled = temperature > 0
        freq = torch.bincount(tokens[sampled], minlength=4).float() / int(sampled.sum())
        torch.testing.assert_close(freq, expected, atol=0.025, rtol=0)
    all_seeded = sample_tokens(tempered_log_probs(logits.expand(rows, -1), torch.ones(rows)), torch.ones(rows), k, p,
                               [torch.Generator().manual_seed(i) for i in range(rows)], torch.Generator())
    freq = torch.bincount(all_seeded, minlength=4).float() / rows
    torch.testing.assert_close(freq, expected, atol=0.025, rtol=0)


def test_noise_stream_gives_each_steps_draws_of_its_generator_bit_for_bit():
    for vocab in (7, 384, NoiseStream.BLOCK_ELEMENTS + 5):
        stream = NoiseStream(torch.Generator().manual_seed(3))
        reference = torch.Generator().manual_seed(3)
        for _ in range(max(3, 2 * NoiseStream.BLOCK_ELEMENTS // vocab + 2)):  # across block boundaries
            assert torch.equal(stream.next(vocab), torch.rand(vocab, generator=reference))


def test_seeded_rows_sample_the_same_tokens_from_noise_streams_as_from_generators():
    """Step by step, a batch whose seeded rows draw from NoiseStreams samples what it samples from the generators
    themselves, with rows of the shared generator and greedy rows mixed in."""
    g = torch.Generator().manual_seed(0)
    batch, vocab = 6, 50
    temperature = torch.tensor([1.0, 0.7, 0.0, 1.0, 1.3, 1.0])
    top_k, top_p = torch.tensor([0, 5, 0, 0, 0, 0]), torch.tensor([1.0, 1.0, 1.0, 0.9, 1.0, 1.0])
    for seeded in ([0, 1, 3, 4, 5], [0, 1, 3]):  # every sampled row seeded (the stacked path), or some
        streams = [NoiseStream(torch.Generator().manual_seed(10 + r)) if r in seeded else None for r in range(batch)]
        plain = [torch.Generator().manual_seed(10 + r) if r in seeded else None for r in range(batch)]
        shared_a, shared_b = torch.Generator().manual_seed(99), torch.Generator().manual_seed(99)
        for _ in range(20):
            log_probs = tempered_log_probs(torch.randn(batch, vocab, generator=g) * 3, temperature)
            a = sample_tokens(log_probs, temperature, top_k, top_p, streams, shared_a)
            b = sample_tokens(log_probs, temperature, top_k, top_p, plain, shared_b)
            assert torch.equal(a, b)
