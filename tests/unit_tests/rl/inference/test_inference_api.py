"""The inference API: validation, registry, sync wrapper, n expansion, and the fake backend's log-probs."""
import asyncio

import numpy as np
import pytest
from pydantic import ValidationError

from megatron.rl.inference import (ChatMessage, GenerationArgs, InferenceError, InferenceInterface,
                                   InferenceRequest, InferenceResponse, build_inference_interface,
                                   expand_requests)
from megatron.rl.inference.fake import EOS_ID, FakeInference


@pytest.mark.parametrize("field,value", [("temperature", -0.1), ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1),
                                         ("max_tokens", 0), ("n", 0)])
def test_bad_generation_args_name_the_field(field, value):
    with pytest.raises(ValidationError) as ei:
        GenerationArgs(**{field: value})
    assert field in str(ei.value)


def test_unknown_generation_arg_rejected():
    with pytest.raises(ValidationError, match="temprature"):
        GenerationArgs(temprature=1.0)


def test_request_needs_exactly_one_nonempty_input():
    with pytest.raises(ValidationError, match="exactly one"):
        InferenceRequest()
    with pytest.raises(ValidationError, match="exactly one"):
        InferenceRequest(prompt="a", messages=[ChatMessage(role="user", content="b")])
    with pytest.raises(ValidationError, match="prompt is empty"):
        InferenceRequest(prompt="")
    with pytest.raises(ValidationError, match="messages is empty"):
        InferenceRequest(messages=[])
    assert GenerationArgs(stop="x").stop == ["x"]


def test_unknown_backend_lists_registered_names():
    with pytest.raises(InferenceError) as ei:
        build_inference_interface("no-such-backend")
    assert "no-such-backend" in str(ei.value)
    for name in ("fake", "huggingface", "megatron", "openai"):
        assert name in str(ei.value)


def test_register_decorator_and_duplicate_name():
    @InferenceInterface.register("test-echo")
    class Echo(InferenceInterface):
        async def agenerate(self, requests):
            return [InferenceResponse(text=r.prompt, token_ids=[], prompt_length=0, finish_reason="stop")
                    for r in expand_requests(requests)]

    echo = build_inference_interface("test-echo")
    assert [r.text for r in echo.generate("hi", n=3)] == ["hi"] * 3
    with pytest.raises(ValueError, match="already registered"):
        @InferenceInterface.register("test-echo")
        class Other(InferenceInterface):
            async def agenerate(self, requests):
                return []


def test_expand_requests_seeds_and_order():
    reqs = [InferenceRequest(prompt="a", generation_args=GenerationArgs(n=3, seed=10)),
            InferenceRequest(prompt="b")]
    flat = expand_requests(reqs)
    assert [r.prompt for r in flat] == ["a", "a", "a", "b"]
    assert [r.generation_args.seed for r in flat] == [10, 11, 12, None]
    assert all(r.generation_args.n == 1 for r in flat)


def test_fake_logprobs_match_teacher_forced_score_and_temperature():
    fake = FakeInference()
    for t in (1.0, 0.7):
        out = fake.generate("Hello", temperature=t, max_tokens=30, seed=3)
        (r,) = out
        assert len(r.logprobs) == len(r.generated_token_ids) > 0
        np.testing.assert_allclose(r.logprobs, fake.score(r.token_ids, r.prompt_length, t), rtol=0, atol=1e-12)
    # the temperature changes the reported log-probs of the same sequence
    assert fake.score(r.token_ids, r.prompt_length, 0.7) != fake.score(r.token_ids, r.prompt_length, 1.0)


def test_fake_greedy_deterministic_seeded_sampling_and_stop():
    fake = FakeInference()
    a = fake.generate("Hey", temperature=0, max_tokens=12)[0]
    b = fake.generate("Hey", temperature=0, max_tokens=12)[0]
    assert a.token_ids == b.token_ids and len(a.generated_token_ids) == 12 and a.finish_reason == "length"
    # greedy really is the argmax of each step
    for i in range(a.prompt_length, len(a.token_ids)):
        assert a.token_ids[i] == int(np.argmax(fake.logits(a.token_ids[i - 1])))
    s1 = fake.generate("Hey", temperature=1.0, max_tokens=12, seed=5, n=2)
    s2 = fake.generate("Hey", temperature=1.0, max_tokens=12, seed=5, n=2)
    assert [r.token_ids for r in s1] == [r.token_ids for r in s2]
    assert s1[0].token_ids != s1[1].token_ids
    stop = a.text[4:6]
    c = fake.generate("Hey", temperature=0, max_tokens=12, stop=[stop])[0]
    assert c.finish_reason == "stop" and c.text == a.text[: a.text.find(stop)]


def test_fake_per_request_error_does_not_fail_batch():
    fake = FakeInference(max_seq_len=16)
    out = asyncio.run(fake.agenerate([InferenceRequest(prompt="x" * 40), InferenceRequest(prompt="ok")]))
    assert out[0].finish_reason == "error" and "maximum sequence length is 16" in out[0].error
    assert out[1].finish_reason in ("stop", "length") and out[1].prompt_length == 2
    assert len(out[1].token_ids) <= 16
    assert all(t != EOS_ID for t in out[1].generated_token_ids[:-1])


def test_generate_works_inside_running_loop():
    fake = FakeInference()

    async def main():
        return fake.generate("abc", temperature=0, max_tokens=4)

    assert len(asyncio.run(main())[0].generated_token_ids) == 4


def test_run_sync_does_not_format_the_result():
    """asyncio.run on the main thread builds repr() of the finished task, result included, when it restores the
    SIGINT handler (~10 ms for a rollout phase's 128 pydantic rollouts); run_sync keeps the result out of it."""
    import asyncio
    import signal
    import threading

    from megatron.rl.inference.api import run_sync

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        pytest.skip("asyncio.run only swaps SIGINT handlers on the main thread with the default handler")
    calls = []

    class Loud:
        def __repr__(self):
            calls.append(1)
            return "Loud()"

    async def produce():
        return Loud()

    asyncio.run(produce())
    assert calls, "asyncio.run no longer formats its result: this test and run_sync's workaround can go"
    calls.clear()
    assert isinstance(run_sync(produce()), Loud)
    assert calls == []
