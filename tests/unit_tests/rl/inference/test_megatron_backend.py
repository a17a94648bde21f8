"""The Megatron (megatron-core dynamic engine) backend on a tiny GPT, in one process (TP=1)."""
from __future__ import annotations

import asyncio
import gc
import weakref

import pytest
import torch

from megatron.rl.inference.engine.kv_reuse import is_kept
from tests.conftest import needs_entry

from tests.unit_tests.rl.inference.scripts.megatron_common import (
    CharTokenizer,
    full_logits,
    init_distributed,
    teacher_forced_logprobs,
    tiny_gpt,
)

PROMPTS = ["The quick brown fox", "1 + 1 =", "Once upon a time, in a land far away,", "zz"]


@pytest.fixture(scope="module")
def setup():
    init_distributed(tp=1)
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model = tiny_gpt()
    backend = MegatronInference(model, ByteLevelTokenizer())
    yield model, backend
    backend.exit_inference_mode()


def _req(prompt, **kw):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    return InferenceRequest(prompt=prompt, generation_args=GenerationArgs(**kw))


def _assert_logprobs_match(model, responses, temperatures):
    for resp, t in zip(responses, temperatures):
        assert resp.finish_reason in ("stop", "length"), resp.error
        assert len(resp.logprobs) == len(resp.generated_token_ids) > 0
        ref = teacher_forced_logprobs(model, resp.token_ids, resp.prompt_length, t)
        torch.testing.assert_close(torch.tensor(resp.logprobs), ref, atol=1e-5, rtol=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_teacher_forced_forward(setup, temperature):
    model, backend = setup
    # mixed prompt lengths and truncation settings in one batch; log-probs are before truncation
    extra = [{}, {"top_k": 5}, {"top_p": 0.8}, {}]
    reqs = [_req(p, temperature=temperature, max_tokens=12 + 3 * i, seed=10 + i, **extra[i])
            for i, p in enumerate(PROMPTS)]
    responses = backend.generate(reqs)
    _assert_logprobs_match(model, responses, [temperature] * len(reqs))
    # at T=0.7 the log-probs must differ from the untempered ones the stock engine would return
    if temperature != 1.0:
        r = responses[0]
        untempered = teacher_forced_logprobs(model, r.token_ids, r.prompt_length, 1.0)
        assert (untempered - torch.tensor(r.logprobs)).abs().max() > 1e-2


def test_greedy_is_deterministic_and_is_the_argmax(setup):
    model, backend = setup
    reqs = [_req(p, temperature=0, max_tokens=16) for p in PROMPTS]
    first = backend.generate(reqs)
    # same requests again, now sharing the batch with other (sampled) requests
    second = backend.generate([_req("noise", temperature=1.0, max_tokens=20)] + reqs)[1:]
    assert [r.token_ids for r in first] == [r.token_ids for r in second]
    _assert_logprobs_match(model, first, [1.0] * len(reqs))  # greedy reports T=1 log-probs
    for r in first:
        logits = full_logits(model, r.token_ids)[r.prompt_length - 1:-1]
        assert logits.argmax(-1).tolist() == r.generated_token_ids


def test_top_k_1_samples_the_argmax_and_reports_untruncated_logprobs(setup):
    model, backend = setup
    greedy = backend.generate([_req(PROMPTS[2], temperature=0, max_tokens=10)])[0]
    topk1 = backend.generate([_req(PROMPTS[2], temperature=0.5, top_k=1, max_tokens=10)])[0]
    assert topk1.token_ids == greedy.token_ids
    _assert_logprobs_match(model, [topk1], [0.5])
    assert max(topk1.logprobs) < 0  # under softmax(logits/T) before truncation, not the truncated 0.0


def test_seeded_sampling_is_reproducible_and_batch_independent(setup):
    _, backend = setup
    alone = backend.generate([_req(PROMPTS[0], temperature=1.0, max_tokens=16, seed=7)])[0]
    batch = backend.generate([_req(p, temperature=1.0, max_tokens=16, seed=100 + i) for i, p in enumerate(PROMPTS)]
                             + [_req(PROMPTS[0], temperature=1.0, max_tokens=16, seed=7)])
    assert batch[-1].token_ids == alone.token_ids
    other_seed = backend.generate([_req(PROMPTS[0], temperature=1.0, max_tokens=16, seed=8)])[0]
    assert other_seed.token_ids != alone.token_ids
    # n > 1 with a seed: distinct samples (seed + i), each reproducible
    n3 = backend.generate([_req(PROMPTS[0], temperature=1.0, max_tokens=16, seed=7, n=3)])
    assert len(n3) == 3 and n3[0].token_ids == alone.token_ids and n3[1].token_ids == other_seed.token_ids
    assert n3[2].token_ids != n3[0].token_ids


def test_stop_strings_and_max_tokens(setup):
    from megatron.rl.inference.megatron import MegatronInference

    model, byte_backend = setup
    byte_backend.exit_inference_mode()
    tok = CharTokenizer()  # one character per token, so stop strings are easy to place
    backend = MegatronInference(model, tok)
    prompt = tok.text(*range(40, 50))
    with backend.inference_mode():
        full = backend.generate([_req(prompt, temperature=0, max_tokens=24)])[0]
        assert full.finish_reason == "length" and len(full.generated_token_ids) == 24
        # a two-character stop string whose first occurrence is at least 4 characters in
        pos = next(p for p in range(4, len(full.text) - 2) if full.text.find(full.text[p:p + 2]) == p)
        stop = full.text[pos:pos + 2]
        steps = backend.engine_steps
        cut = backend.generate([_req(prompt, temperature=0, max_tokens=24, stop=["never-there", stop])])[0]
        assert backend.engine_steps - steps <= pos + 3  # generation stopped early, not trimmed afterwards
        # a tokenizer that does not match the model: a per-request error, not an engine crash
        foreign = backend.generate([_req(prompt + chr(0x100 + 1000), temperature=0, max_tokens=2)])[0]
        assert foreign.finish_reason == "error" and "outside the model's vocabulary" in foreign.error
    assert cut.finish_reason == "stop"
    assert cut.text == full.text[:pos]
    # tokens up to the one completing the stop string are kept (the trainer sees what was sampled)
    assert cut.generated_token_ids == full.generated_token_ids[:pos + 2]
    assert cut.logprobs == pytest.approx(full.logprobs[:pos + 2], abs=1e-6)


def test_byte_level_stop_strings_are_detokenized_only_at_their_last_byte(setup, monkeypatch):
    """The byte tokenizer's stop triggers: the engine checks the text only after a token that can complete a
    stop string, and still stops right at the first one."""
    from megatron.rl.inference.engine import session as megatron_session

    model, backend = setup
    checks = []
    original = megatron_session.completes_stop
    monkeypatch.setattr(megatron_session, "completes_stop",
                        lambda tokens, *a, **k: checks.append(tokens[-1]) or original(tokens, *a, **k))
    prompt = "Once upon a time"
    with backend.inference_mode():
        full = backend.generate([_req(prompt, temperature=0, max_tokens=24)])[0]
        generated = full.generated_token_ids
        # an ASCII byte first sampled at index >= 3 (ASCII bytes always render as themselves)
        index = next(i for i in range(3, len(generated)) if generated[i] < 128 and generated[i] not in generated[:i])
        stop = chr(generated[index])
        steps = backend.engine_steps
        cut = backend.generate([_req(prompt, temperature=0, max_tokens=24, stop=[stop])])[0]
        assert backend.engine_steps - steps <= index + 2  # stopped early
    assert cut.finish_reason == "stop" and cut.generated_token_ids == generated[:index + 1]
    assert cut.text == full.text[:full.text.index(stop)]
    assert checks == [generated[index]]  # one check, at the completing token, instead of one per token


def test_bad_requests_are_per_request_errors(setup):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    model, backend = setup
    too_long = _req("x" * (backend.max_sequence_length + 5), temperature=0, max_tokens=4)
    exactly_full = _req("y" * backend.max_sequence_length, temperature=0, max_tokens=4)
    nearly_full = _req("y" * (backend.max_sequence_length - 3), temperature=0, max_tokens=50)
    empty = InferenceRequest.model_construct(prompt="", messages=None, generation_args=GenerationArgs())
    bad_t = InferenceRequest.model_construct(prompt="hi", messages=None,
                                             generation_args=GenerationArgs.model_construct(
                                                 temperature=-1.0, top_p=1.0, top_k=0, max_tokens=4, stop=[],
                                                 seed=None, n=1))
    good = _req(PROMPTS[0], temperature=0, max_tokens=6)
    out = backend.generate([too_long, good, empty, exactly_full, bad_t, nearly_full])
    assert [r.finish_reason for r in out] == ["error", "length", "error", "error", "error", "length"]
    assert "maximum sequence length" in out[0].error and str(backend.max_sequence_length) in out[0].error
    assert "prompt is empty" in out[2].error  # the shared validation catches it before the engine
    assert "temperature" in out[4].error
    assert len(out[5].generated_token_ids) == 3  # max_tokens clamped to the room left
    # the engine keeps serving, with the same answers
    again = backend.generate([good])[0]
    assert again.token_ids == out[1].token_ids


def test_engine_failure_is_reported_and_the_next_call_restarts_it(setup):
    _, backend = setup
    backend.enter_inference_mode()
    controller = backend._session.controller

    def broken(logits=None):
        raise RuntimeError("injected sampling failure")

    controller._dynamic_step_sample_logits = broken
    failed = backend.generate([_req(p, temperature=0, max_tokens=4) for p in PROMPTS[:2]])
    assert [r.finish_reason for r in failed] == ["error", "error"]
    assert "injected sampling failure" in failed[0].error
    ok = backend.generate([_req(PROMPTS[0], temperature=0, max_tokens=4)])[0]
    assert ok.finish_reason == "length" and len(ok.generated_token_ids) == 4


def test_concurrent_agenerate_calls_share_batches(setup):
    _, backend = setup
    backend.enter_inference_mode()
    steps_before = backend.engine_steps

    async def many():
        calls = [backend.agenerate([_req(p, temperature=0, max_tokens=8)]) for p in PROMPTS * 2]
        return await asyncio.gather(*calls)

    results = asyncio.run(many())
    assert all(len(r) == 1 and r[0].finish_reason == "length" for r in results)
    # 8 requests x 8 tokens one at a time would take 64 steps; batched they take about 8
    assert backend.engine_steps - steps_before <= 16


def test_a_cancelled_request_leaves_the_running_batch_at_the_next_step(setup, monkeypatch):
    """A request whose caller left (cancel(), as the inference server does on a client disconnect) is ended in the
    middle of a batch, active or still waiting for KV blocks; the requests beside it run to their end."""
    from megatron.rl.inference.api import CANCELLED

    from megatron.rl.inference.engine.session import EngineStepper

    _, backend = setup
    backend.enter_inference_mode()
    long = [_req(p, temperature=0, max_tokens=120) for p in PROMPTS[:2]]
    short = _req(PROMPTS[3], temperature=0, max_tokens=12)
    steps_before = backend.engine_steps
    step = EngineStepper.step

    async def counted(self):
        if backend.engine_steps - steps_before == 4:
            for r in long:  # as the server's event loop does while the engine thread steps
                r.cancel()
        await step(self)

    monkeypatch.setattr(EngineStepper, "step", counted)
    got = backend.generate([long[0], short, long[1]])
    assert [r.error for r in got] == [CANCELLED, None, CANCELLED]
    assert got[1].finish_reason == "length" and len(got[1].generated_token_ids) == 12
    assert backend.engine_steps - steps_before == 12  # the short request's steps, not the 120 of the long ones
    again = backend.generate([_req(PROMPTS[3], temperature=0, max_tokens=12)])[0]  # the engine carries on
    assert again.token_ids == got[1].token_ids
    cancelled_first = _req(PROMPTS[0], temperature=0, max_tokens=200)
    cancelled_first.cancel()
    assert backend.generate([cancelled_first])[0].error == CANCELLED


def test_a_cancelled_request_still_waiting_for_a_slot_leaves_the_engines_queue(setup, monkeypatch):
    from megatron.rl.inference.api import CANCELLED
    from megatron.rl.inference.engine.build import EngineSettings
    from megatron.rl.inference.engine.session import EngineStepper
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model, shared = setup
    shared.exit_inference_mode()
    backend = MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(max_requests=2))
    waiting_when_cancelled = []
    cancel, step = EngineStepper.cancel, EngineStepper.step
    monkeypatch.setattr(EngineStepper, "cancel", lambda self, seq: waiting_when_cancelled.append(
        seq in self.engine.waiting_request_ids) or cancel(self, seq))
    reqs = [_req(p, temperature=0, max_tokens=100) for p in PROMPTS]

    async def counted(self):
        if backend.engine_steps == 4:
            for r in reqs[1:]:
                r.cancel()
        await step(self)

    monkeypatch.setattr(EngineStepper, "step", counted)
    try:
        got = backend.generate(reqs)
        assert got[0].finish_reason == "length" and len(got[0].generated_token_ids) == 100
        assert [r.error for r in got[1:]] == [CANCELLED] * 3
        assert sorted(waiting_when_cancelled) == [False, True, True]  # two of them never got a slot
        assert backend.engine_steps == 100  # the first request's steps: the waiting ones never ran
    finally:
        backend.exit_inference_mode()


def test_chat_messages_use_the_template(setup):
    from megatron.rl.inference.api import ChatMessage, GenerationArgs, InferenceRequest

    _, backend = setup
    req = InferenceRequest(messages=[ChatMessage(role="user", content="hi")],
                           generation_args=GenerationArgs(temperature=0, max_tokens=4))
    r = backend.generate([req])[0]
    assert r.prompt_text == backend.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert r.token_ids[:r.prompt_length] == backend.tokenizer.tokenize(r.prompt_text)


def test_enter_exit_twice_frees_kv_cache_and_training_still_works(setup, monkeypatch):
    model, backend = setup
    # exit must free the cache and the engine's objects by itself: no cyclic collection (a full collection
    # costs ~0.2 s per rollout phase in a real process)
    monkeypatch.setattr(gc, "collect", lambda *args: 0)
    backend.exit_inference_mode()
    model.train()
    for _ in range(2):
        gc.disable()
        try:
            with backend.inference_mode():
                assert not model.training
                context = backend.context
                buffer_ref = weakref.ref(context.memory_buffer)
                context_ref = weakref.ref(context)
                engine_ref = weakref.ref(backend._session.engine)
                assert context.memory_buffer.numel() > 0
                del context
                r = backend.generate([_req(PROMPTS[0], temperature=0, max_tokens=5)])[0]
                assert r.finish_reason == "length"
            # on CPU the KV buffer goes to the pool for the next engine (kv_buffer_reuse): nothing else holds it
            kept = buffer_ref()
            assert kept is None or is_kept(kept), "KV cache still referenced after exit"
            del kept
            assert context_ref() is None, "the context is still referenced after exit"
            assert engine_ref() is None, "the stopped engine is kept alive by a reference cycle"
        finally:
            gc.enable()
        assert backend.context is None and model.training
    # a training forward/backward works and produces gradients after inference
    tokens = torch.tensor([backend.tokenizer.tokenize("training works")])
    labels = torch.roll(tokens, -1, 1)
    loss = model(tokens, torch.arange(tokens.shape[1])[None], None, labels=labels).float().mean()
    loss.backward()
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)
    model.zero_grad(set_to_none=True)


@needs_entry("dynamic context: reused CPU KV buffer", "dynamic context: reused CPU KV buffer (0.19)")
def test_the_next_phase_reuses_the_kv_buffer_and_gather_buffers_and_concurrent_engines_never_share(setup):
    """On CPU a phase's KV buffer and attention gather buffers serve the next phase's engine (fresh ones page-fault
    on every first write); two engines alive at once each get their own KV buffer."""
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.runtime import torch_attention

    model, backend = setup
    backend.exit_inference_mode()
    seen = []
    for _ in range(2):
        with backend.inference_mode():
            r = backend.generate([_req(PROMPTS[0], temperature=0, max_tokens=5)])[0]
            assert r.finish_reason == "length"
            seen.append(backend.context.memory_buffer)
    assert seen[0] is seen[1]
    assert torch_attention._FREE_PAIRS, "the engine thread's gather buffers were not handed back"
    other = MegatronInference(model, backend.tokenizer, max_sequence_length=backend.max_sequence_length)
    with backend.inference_mode(), other.inference_mode():
        assert backend.context.memory_buffer is not other.context.memory_buffer
        a = backend.generate([_req(PROMPTS[0], temperature=0, max_tokens=5)])[0]
        b = other.generate([_req(PROMPTS[0], temperature=0, max_tokens=5)])[0]
        assert a.token_ids == b.token_ids == r.token_ids


def test_caller_releases_its_openmp_pool_while_the_engine_thread_works(setup, monkeypatch):
    """agenerate frees the calling thread's OpenMP pool (megatron/rl/runtime/openmp.py): the engine thread's
    pool must be the only one, or libgomp throttles its spin-waits and every op pays a futex wake-up."""
    import threading

    import megatron.rl.inference.megatron as mega_module

    _, backend = setup
    calls = []
    monkeypatch.setattr(mega_module, "release_thread_pool", lambda: calls.append(threading.get_ident()) or True)
    out = asyncio.run(backend.agenerate([_req("1+1=", max_tokens=2)]))
    assert out[0].finish_reason in ("stop", "length"), out[0].error
    assert calls == [threading.get_ident()]
    assert backend._session.thread is not None and backend._session.thread.ident != threading.get_ident()


def test_scalar_sampling_params_deep_copy_is_an_independent_equal_copy():
    import copy

    from megatron.core.inference.sampling_params import SamplingParams

    from megatron.rl.inference.engine.session import _scalar_sampling_params

    params = _scalar_sampling_params()(num_tokens_to_generate=5, termination_id=3, return_log_probs=True)
    clone = copy.deepcopy(params)
    assert isinstance(clone, SamplingParams) and clone is not params and vars(clone) == vars(params)
    clone.num_tokens_to_generate = 7  # the engine adjusts its request's copy
    assert params.num_tokens_to_generate == 5
