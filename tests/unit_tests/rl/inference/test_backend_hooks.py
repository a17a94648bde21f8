"""InferenceInterface hooks: rollout_phase() brackets a rollout phase, build_for_training builds a run's backend."""
from __future__ import annotations

import contextlib
import types

import pytest

from megatron.rl.inference.api import InferenceInterface, InferenceResponse, expand_requests
from megatron.rl.inference.control import TrainerControl, build_training_inference
from megatron.rl.inference.fake import FakeInference
from megatron.rl.inference.openai import OpenAIInference


class _Phased(InferenceInterface):
    """A backend with resources held only during a rollout phase (as the in-process engine's KV cache)."""

    def __init__(self):
        self.events: list[str] = []

    @contextlib.contextmanager
    def rollout_phase(self):
        self.events.append("enter")
        try:
            yield self
        finally:
            self.events.append("exit")

    async def agenerate(self, requests):
        self.events.append("generate")
        return [InferenceResponse(text="", token_ids=[], prompt_length=0, finish_reason="stop")
                for _ in expand_requests(requests)]


def test_rollout_phase_brackets_generation_even_when_it_fails():
    backend = _Phased()
    with backend.rollout_phase() as inference:
        assert inference is backend
        inference.generate("hi")
    assert backend.events == ["enter", "generate", "exit"]
    with pytest.raises(RuntimeError), backend.rollout_phase():  # left even when the phase fails
        raise RuntimeError("rollout failed")
    assert backend.events[-2:] == ["enter", "exit"]


def test_default_rollout_phase_is_a_no_op():
    fake = FakeInference()
    with fake.rollout_phase() as inside:
        assert inside is fake and fake.generate("a", max_tokens=2)[0].finish_reason in ("stop", "length")


def _rl(backend: str, **extra):
    return types.SimpleNamespace(inference_backend=backend, inference_server_url=None,
                                 inference_layout=types.SimpleNamespace(enabled=False), **extra)


def test_build_training_inference_asks_the_named_backend():
    assert isinstance(build_training_inference(None, _rl("fake"), [], None), FakeInference)
    rl = _rl("openai")
    rl.inference_server_url = "http://127.0.0.1:1/v1"
    client = build_training_inference(None, rl, [], None)
    assert isinstance(client, OpenAIInference) and client.base_url == "http://127.0.0.1:1/v1"

    @InferenceInterface.register("test-hook-backend")
    class Hooked(_Phased, TrainerControl):
        @classmethod
        def build_for_training(cls, cfg, rl, model, tokenizer):
            made = cls()
            made.built_with = (cfg, rl, model, tokenizer)
            return made

    rl = _rl("test-hook-backend")
    built = build_training_inference("cfg", rl, ["chunk"], "tok")
    assert isinstance(built, Hooked) and built.built_with == ("cfg", rl, ["chunk"], "tok")
