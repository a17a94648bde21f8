"""A real inference-server process (fake backend) used through the OpenAI backend and the real openai client."""
from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import openai
import pytest
from fastapi.testclient import TestClient

from megatron.rl.inference import (ChatMessage, GenerationArgs, InferenceError, InferenceInterface,
                                   InferenceRequest, build_inference_interface)
from megatron.rl.inference.chat_template import builtin_chat_template
from megatron.rl.inference.fake import FakeInference
from megatron.rl.server.inference import ServerConfig, create_app
from megatron.rl.server.inference.__main__ import build_backend
from tests.conftest import REPO_ROOT, free_port

KEY = "test-key"


def _client(server, **kw):
    return build_inference_interface("openai", base_url=server.url + "/v1", api_key=KEY, timeout=30, **kw)


def test_completions_match_local_backend(fake_server):
    ref = FakeInference()
    backend = _client(fake_server)
    reqs = [InferenceRequest(prompt="Hello", generation_args=GenerationArgs(temperature=0.7, max_tokens=15, seed=4,
                                                                             n=2)),
            InferenceRequest(prompt="abc", generation_args=GenerationArgs(temperature=0, max_tokens=9))]
    got = backend.generate(reqs)
    want = ref.generate(reqs)
    assert len(got) == 3
    for g, w in zip(got, want):
        assert (g.text, g.token_ids, g.prompt_length, g.finish_reason) == \
               (w.text, w.token_ids, w.prompt_length, w.finish_reason)
        np.testing.assert_allclose(g.logprobs, w.logprobs, rtol=0, atol=1e-12)
    t = reqs[0].generation_args.temperature
    np.testing.assert_allclose(got[0].logprobs, ref.score(got[0].token_ids, got[0].prompt_length, t), atol=1e-12)
    assert backend.model == "megatron-rl"  # discovered via /v1/models


def test_chat_returns_template_token_ids_and_logprobs(fake_server):
    ref = FakeInference()
    msgs = [ChatMessage(role="system", content="be brief"), ChatMessage(role="user", content="2+2?")]
    req = InferenceRequest(messages=msgs, generation_args=GenerationArgs(temperature=1.0, max_tokens=10, seed=1,
                                                                         stop=["x"]))
    (got,) = _client(fake_server).generate([req])
    (want,) = ref.generate([req])
    assert got.prompt_text == builtin_chat_template(msgs) == want.prompt_text
    assert got.token_ids == want.token_ids and got.text == want.text and "x" not in got.text
    np.testing.assert_allclose(got.logprobs, ref.score(got.token_ids, got.prompt_length, 1.0), atol=1e-12)


def test_raw_openai_client(fake_server):
    client = openai.OpenAI(base_url=fake_server.url + "/v1", api_key=KEY, max_retries=0)
    assert [m.id for m in client.models.list().data] == ["megatron-rl"]
    r = client.completions.create(model="megatron-rl", prompt=["Hi", "Yo"], max_tokens=4, temperature=0, logprobs=1)
    assert len(r.choices) == 2 and r.usage.completion_tokens == 8
    assert len(r.choices[0].logprobs.token_logprobs) == 4 and r.choices[0].model_extra["prompt_token_ids"] == [72, 105]
    c = client.chat.completions.create(model="megatron-rl", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=3, logprobs=True)
    assert len(c.choices[0].logprobs.content) == 3 and c.choices[0].message.role == "assistant"
    with pytest.raises(openai.NotFoundError, match="serves 'megatron-rl'"):
        client.completions.create(model="other", prompt="Hi", max_tokens=2)


def test_200_concurrent_requests_all_answered_and_batched(fake_server):
    before = fake_server.health()["stats"]
    backend = _client(fake_server, max_concurrency=200)
    reqs = [InferenceRequest(prompt=f"p{i}", generation_args=GenerationArgs(max_tokens=8, seed=i)) for i in range(200)]
    out = asyncio.run(backend.agenerate(reqs))
    want = FakeInference().generate(reqs)
    assert [o.token_ids for o in out] == [w.token_ids for w in want]
    after = fake_server.health()["stats"]
    assert after["requests"] - before["requests"] == 200
    # requests arriving while a (0.1 s) batch runs are collected into the next one, never one call each
    assert after["batches"] - before["batches"] < 100
    assert after["max_batch_samples"] > 1


def test_schema_violations_422_and_unsupported_400(fake_server):
    h = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
    url = fake_server.url + "/v1/completions"
    r = httpx.post(url, content=b'{"prompt": "Hi",', headers=h)
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(url, json={"prompt": 5}, headers=h)
    assert r.status_code == 422
    # out of range: the schema states the range, so the body is refused before the batcher (422)
    for body, needle in [({"prompt": "Hi", "temperature": -0.5}, "temperature"),
                         ({"prompt": "Hi", "top_p": 0}, "top_p"), ({"prompt": "Hi", "top_p": 1.5}, "top_p"),
                         ({"prompt": "Hi", "max_tokens": 0}, "max_tokens")]:
        r = httpx.post(url, json=body, headers=h)
        assert r.status_code == 422, (body, r.text)
        assert r.json()["error"]["param"] == needle and needle in r.json()["error"]["message"]
    for body in [{"prompt": ""}, {"prompt": []}, {"prompt": ["a", ""]}]:  # the schema says minLength / minItems 1
        r = httpx.post(url, json=body, headers=h)
        assert r.status_code == 422 and r.json()["error"]["param"].startswith("prompt"), (body, r.text)
    r = httpx.post(fake_server.url + "/v1/chat/completions", json={"messages": []}, headers=h)
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url, json={"prompt": "Hi", "stream": True}, headers=h)
    assert r.status_code == 400 and r.json()["error"]["message"] == "stream: not supported by this server: send " \
                                                                     "stream=false"
    # the server is still healthy and serving
    assert httpx.post(url, json={"prompt": "Hi", "max_tokens": 2}, headers=h).status_code == 200


def test_too_long_prompt_is_an_error_for_that_request_only(fake_server):
    backend = _client(fake_server)
    out = backend.generate([InferenceRequest(prompt="x" * 500), InferenceRequest(prompt="ok", generation_args=
                                                                                   GenerationArgs(max_tokens=3))])
    assert out[0].finish_reason == "error" and "maximum sequence length is 200" in out[0].error
    assert "400" in out[0].error and out[1].finish_reason in ("stop", "length")


def test_bearer_token_enforced(fake_server):
    url = fake_server.url + "/v1/completions"
    assert httpx.post(url, json={"prompt": "Hi"}).status_code == 401
    assert httpx.post(url, json={"prompt": "Hi"}, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(fake_server.url + "/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    bad = build_inference_interface("openai", base_url=fake_server.url + "/v1", api_key="wrong", model="megatron-rl")
    (r,) = bad.generate("Hi", max_tokens=2)
    assert r.finish_reason == "error" and "401" in r.error


def test_client_disconnect_does_not_wedge(fake_server):
    h = {"Authorization": f"Bearer {KEY}"}
    url = fake_server.url + "/v1/completions"
    for _ in range(5):  # the server takes >= 0.1 s per batch; these clients give up long before
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url, json={"prompt": "Hi", "max_tokens": 4}, headers=h, timeout=0.01)
    r = httpx.post(url, json={"prompt": "Hi", "max_tokens": 4}, headers=h, timeout=30)
    assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4


@contextlib.contextmanager
def _serving(app):
    """``app`` under uvicorn on a thread of this process (real HTTP: disconnects are seen), yielding its URL."""
    import threading

    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        while not server.started:
            assert thread.is_alive()
            time.sleep(0.01)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class _CountingFake(FakeInference):
    """The fake backend, counting the tokens it generates (one ``logits`` call each)."""

    tokens = 0

    def logits(self, prev_token):
        self.tokens += 1
        return super().logits(prev_token)


def test_a_disconnected_clients_share_of_a_running_batch_is_cancelled():
    """A client that gives up while its request is generated: the backend stops generating it at its next token,
    so the batch, and everyone queued behind it, does not wait for its max_tokens x n."""
    from megatron.rl.inference.validation import RequestLimits

    backend = _CountingFake(max_seq_len=1 << 20, eos_bias=-1e9)  # never ends before max_tokens
    cfg = ServerConfig(batch_window_s=0.0, limits=RequestLimits(max_tokens=100_000))
    with _serving(create_app(backend, cfg)) as url:
        with pytest.raises(httpx.TimeoutException):
            httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 100_000, "n": 2}, timeout=0.3)
        r = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=600)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 4
        stats = httpx.get(url + "/health").json()["stats"]
    assert stats["cancelled_disconnected"] == 1 and stats["batches"] == 2
    assert backend.tokens < 100_000, backend.tokens  # of the 200,000 asked for, only what ran before the cancel


def test_unreachable_server_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}/v1"
    backend = build_inference_interface("openai", base_url=url, model="m", timeout=2, max_retries=0)
    with pytest.raises(InferenceError, match=f"{url}.*unreachable"):
        backend.generate("Hi", max_tokens=2)


def test_unknown_backend_name_lists_registered():
    with pytest.raises(InferenceError, match="registered backends: .*fake.*huggingface.*openai"):
        build_backend("nope", {}, [])
    with pytest.raises(NotImplementedError, match="--backend-arg"):
        build_backend("fake", {}, ["--load", "x"])
    # the CLI exits with a usage error naming the registered backends (no traceback, no server)
    proc = subprocess.run([sys.executable, "-m", "megatron.rl.server.inference", "--backend", "nope"],
                          capture_output=True, text=True, timeout=120, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    assert proc.returncode == 2 and "registered backends: fake, huggingface, megatron, openai" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_backend_exception_is_500_and_server_survives():
    @InferenceInterface.register("test-flaky")
    class Flaky(FakeInference):
        async def agenerate(self, requests):
            if any(r.prompt == "boom" for r in requests):
                raise RuntimeError("kaboom")
            return await super().agenerate(requests)

    with TestClient(create_app(Flaky(), ServerConfig(batch_window_s=0.0))) as client:
        r = client.post("/v1/completions", json={"prompt": "boom", "max_tokens": 2})
        # a short message; the exception text stays in the server log
        assert r.status_code == 500 and "RuntimeError" in r.json()["error"]["message"]
        assert "kaboom" not in r.text
        r = client.post("/v1/completions", json={"prompt": "fine", "max_tokens": 2})
        assert r.status_code == 200 and client.get("/health").json()["stats"]["backend_errors"] == 1


def test_batcher_drops_requests_whose_client_left_before_their_batch():
    """A cancelled (disconnected) request queued behind a running batch never reaches the backend."""
    from megatron.rl.server.inference.app import RequestBatcher

    class Gated(FakeInference):
        def __init__(self):
            super().__init__()
            self.gate = asyncio.Event()
            self.seen: list[str] = []

        async def agenerate(self, requests):
            self.seen += [r.prompt for r in requests]
            await self.gate.wait()
            return await super().agenerate(requests)

    async def main():
        backend = Gated()
        batcher = RequestBatcher(backend, window_s=0.0, max_batch_requests=16)
        batcher.start()
        a = asyncio.ensure_future(batcher.submit([InferenceRequest(prompt="A")]))
        while not backend.seen:  # A's batch is running and blocked on the gate
            await asyncio.sleep(0.001)
        b = asyncio.ensure_future(batcher.submit([InferenceRequest(prompt="B")]))
        c = asyncio.ensure_future(batcher.submit([InferenceRequest(prompt="C")]))
        await asyncio.sleep(0.01)
        b.cancel()  # what the server does when B's client disconnects
        backend.gate.set()
        ra, rc = await a, await c
        await batcher.stop()
        return backend.seen, ra, rc, batcher.stats

    seen, ra, rc, stats = asyncio.run(main())
    assert seen == ["A", "C"] and stats.dropped_disconnected == 1
    assert ra[0].prompt_text == "A" and rc[0].prompt_text == "C"


def test_cli_defaults_loopback_env_key_and_backend_hook(monkeypatch):
    from megatron.rl.server.inference.__main__ import API_KEY_ENV, build_parser

    monkeypatch.delenv(API_KEY_ENV, raising=False)
    args = build_parser().parse_args(["--backend", "fake", "--backend-arg", "max_seq_len=64",
                                      "--backend-arg", "name=abc"])
    assert args.host == "127.0.0.1" and args.api_key is None
    assert dict(args.backend_arg) == {"max_seq_len": 64, "name": "abc"}
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert build_parser().parse_args(["--backend", "fake"]).api_key == "from-env"
    assert build_backend("fake", {"max_seq_len": 64}, []).max_seq_len == 64

    @InferenceInterface.register("test-cli")
    class WithFlags(FakeInference):
        @classmethod
        def from_cli(cls, argv):
            backend = cls()
            backend.argv = argv
            return backend

    assert build_backend("test-cli", {}, ["--load", "/ckpt", "--num-layers", "2"]).argv == \
        ["--load", "/ckpt", "--num-layers", "2"]
