"""One poisoned request among 20 valid ones: on every backend the 20 get exactly the answers they get alone.

A poisoned request is built with ``model_construct`` (skipping pydantic), as a caller that bypasses the
schema would; before the validation module such a request failed (or corrupted) its whole batch.
"""
from __future__ import annotations

import asyncio

import pytest

from megatron.rl.inference.api import GenerationArgs, InferenceRequest

PROMPTS = [f"The quick brown fox {i}" for i in range(20)]


def _valid(i: int, max_tokens: int = 6) -> InferenceRequest:
    return InferenceRequest(prompt=PROMPTS[i], generation_args=GenerationArgs(temperature=0.8, max_tokens=max_tokens,
                                                                              seed=100 + i))


def _poison(max_tokens: int = 6, **bad) -> InferenceRequest:
    ga = dict(temperature=1.0, top_p=1.0, top_k=0, max_tokens=max_tokens, stop=[], seed=7, n=1)
    ga.update(bad)
    return InferenceRequest.model_construct(prompt=bad.pop("prompt", "poison"), messages=None,
                                            generation_args=GenerationArgs.model_construct(**ga))


def _check(backend, poison: InferenceRequest, max_tokens: int = 6) -> None:
    valid = [_valid(i, max_tokens) for i in range(20)]
    alone = [asyncio.run(backend.agenerate([r]))[0] for r in valid[:3]]  # a few alone, for the exact answers
    batch = valid[:10] + [poison] + valid[10:]
    out = asyncio.run(backend.agenerate(batch))
    assert len(out) == 21
    bad = out[10]
    assert bad.finish_reason == "error" and bad.error.startswith("invalid request"), bad
    good = out[:10] + out[11:]
    assert all(r.finish_reason in ("stop", "length") for r in good), [r.error for r in good]
    assert [r.prompt_text for r in good] == PROMPTS
    for a, g in zip(alone, good):
        assert (a.token_ids, a.text) == (g.token_ids, g.text)


FAKE_POISONS = [dict(seed=-1), dict(seed=2**64), dict(temperature=1e-308), dict(temperature=5e-324),
                dict(temperature=float("inf")), dict(temperature=float("nan")), dict(prompt="bad \ud800 text")]


@pytest.mark.parametrize("bad", FAKE_POISONS, ids=lambda b: repr(b)[:30])
def test_fake_backend(bad):
    from megatron.rl.inference.fake import FakeInference

    _check(FakeInference(), _poison(**bad))


@pytest.fixture(scope="module")
def hf_backend(tmp_path_factory):
    from megatron.rl.inference import build_inference_interface
    from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model

    path = build_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf_poison"))
    return build_inference_interface("huggingface", model_path=str(path), device="cpu", max_batch_size=32)


@pytest.mark.parametrize("bad", [dict(seed=2**64), dict(temperature=1e-38), dict(seed=-1),
                                 dict(prompt="bad \ud800 text")], ids=lambda b: repr(b)[:30])
def test_huggingface_backend(hf_backend, bad):
    _check(hf_backend, _poison(**bad))


def test_huggingface_failure_inside_decoding_fails_alone(hf_backend, monkeypatch):
    """A valid request that still makes the decoding loop raise: the batch is retried in halves."""
    original = type(hf_backend)._decode_batch

    def decode(self, rows):
        if any(r.prompt_text == "boom" for r in rows):
            raise RuntimeError("decoding failed")
        return original(self, rows)

    monkeypatch.setattr(type(hf_backend), "_decode_batch", decode)
    valid = [_valid(i) for i in range(20)]
    boom = InferenceRequest(prompt="boom", generation_args=GenerationArgs(max_tokens=4))
    out = asyncio.run(hf_backend.agenerate(valid[:5] + [boom] + valid[5:]))
    assert out[5].finish_reason == "error" and "RuntimeError" in out[5].error
    good = out[:5] + out[6:]
    assert all(r.finish_reason in ("stop", "length") for r in good)
    monkeypatch.undo()
    assert [r.token_ids for r in good] == [r.token_ids for r in asyncio.run(hf_backend.agenerate(valid))]


@pytest.fixture(scope="module")
def megatron_backend():
    from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, tiny_gpt

    init_distributed(tp=1)
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    backend = MegatronInference(tiny_gpt(), ByteLevelTokenizer())
    yield backend
    backend.exit_inference_mode()


@pytest.mark.parametrize("bad", [dict(temperature=1e-308), dict(temperature=float("inf")), dict(seed=-1)],
                         ids=lambda b: repr(b)[:30])
def test_megatron_backend(megatron_backend, bad):
    _check(megatron_backend, _poison(**bad))
