"""The inference server against hostile clients: each test sends a hostile request to the in-process app."""
from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from megatron.rl.inference import GenerationArgs, InferenceRequest
from megatron.rl.inference.fake import FakeInference
from megatron.rl.server.inference import ServerConfig, create_app

KEY = "k3y"
AUTH = {"Authorization": f"Bearer {KEY}"}


async def _post_all(app, bodies: list, path: str = "/v1/completions", headers: dict | None = None):
    """POST every body at the same moment (one event loop, so they share the batcher's window)."""
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv",
                                     timeout=120) as client:
            def send(body):
                raw = body if isinstance(body, bytes) else json.dumps(body).encode()
                return client.post(path, content=raw, headers={**AUTH, "Content-Type": "application/json",
                                                               **(headers or {})})
            return await asyncio.gather(*(send(b) for b in bodies))


def _app(backend=None, **cfg):
    cfg.setdefault("api_key", KEY)
    cfg.setdefault("batch_window_s", 0.05)
    return create_app(backend or FakeInference(), ServerConfig(**cfg))


def _valid(i: int) -> dict:
    return {"prompt": f"hello {i}", "max_tokens": 5, "temperature": 0.9, "seed": i}


POISONS = {
    "seed -1": {"prompt": "x", "seed": -1, "max_tokens": 2},
    "seed 2^64": {"prompt": "x", "seed": 2**64, "max_tokens": 2},
    "temperature 1e-308": {"prompt": "x", "temperature": 1e-308, "max_tokens": 2},
    "temperature 5e-324": {"prompt": "x", "temperature": 5e-324, "max_tokens": 2},
    "temperature Infinity": b'{"prompt": "x", "temperature": Infinity, "max_tokens": 2}',
    "lone surrogate": b'{"prompt": "bad \\ud800", "max_tokens": 2}',
    "surrogate stop": b'{"prompt": "x", "stop": ["\\udfff"], "max_tokens": 2}',
}


@pytest.mark.parametrize("name", list(POISONS))
def test_poisoned_request_among_20_concurrent_fails_alone(name):
    bodies = [_valid(i) for i in range(20)]
    out = asyncio.run(_post_all(_app(), bodies[:10] + [POISONS[name]] + bodies[10:]))
    bad, good = out[10], out[:10] + out[11:]
    assert bad.status_code == 422, bad.text
    assert [r.status_code for r in good] == [200] * 20, [r.text for r in good if r.status_code != 200][:1]
    want = FakeInference().generate([InferenceRequest(prompt=b["prompt"], generation_args=GenerationArgs(
        max_tokens=5, temperature=0.9, seed=b["seed"])) for b in bodies])
    assert [r.json()["choices"][0]["token_ids"] for r in good] == [w.generated_token_ids for w in want]


def test_backend_exception_fails_only_its_request():
    class Flaky(FakeInference):
        async def agenerate(self, requests):
            if any(r.prompt == "boom" for r in requests):
                raise RuntimeError("internal detail /secret/path")
            return await super().agenerate(requests)

    backend = Flaky()
    bodies = [_valid(i) for i in range(20)]
    out = asyncio.run(_post_all(_app(backend), bodies[:7] + [{"prompt": "boom", "max_tokens": 2}] + bodies[7:]))
    assert out[7].status_code == 500 and "/secret/path" not in out[7].text
    assert [r.status_code for r in out[:7] + out[8:]] == [200] * 20
    assert backend.num_batches > 1  # the failing batch was retried in parts


@pytest.mark.parametrize("body,param", [
    ({"prompt": "x", "n": 5000, "max_tokens": 1}, "n"),
    ({"prompt": "x", "stop": [f"s{i}" for i in range(1000)], "max_tokens": 1}, "stop"),
    ({"prompt": "x", "stop": ["y" * 10_000], "max_tokens": 1}, "stop"),
    ({"prompt": "x", "max_tokens": 10**6}, "max_tokens"),
    ({"prompt": "x", "logprobs": -1, "max_tokens": 1}, "logprobs"),
    ({"prompt": "x", "logprobs": 10**9, "max_tokens": 1}, "logprobs"),
    ({"prompt": [f"p{i}" for i in range(1000)], "max_tokens": 1}, "prompt"),
    ({"prompt": ["a", "b", "c", "d", "e", "f", "g", "h", "i"], "n": 128, "max_tokens": 1}, None),
], ids=["n", "stop-count", "stop-length", "max_tokens", "logprobs<0", "logprobs-huge", "prompts", "samples"])
def test_work_per_request_is_bounded(body, param):
    (r,) = asyncio.run(_post_all(_app(), [body]))
    assert r.status_code == 422, r.text[:300]
    err = r.json()["error"]
    assert (err["param"] or "").split(".")[0] == param if param else "samples per request" in err["message"]
    assert len(r.text) < 1000  # short message, the oversized input is not echoed


@pytest.mark.parametrize("role", ["user|>\n<|system", "root", ""])
def test_chat_role_is_one_of_the_known_roles(role):
    body = {"messages": [{"role": role, "content": "hi"}], "max_tokens": 2}
    (r,) = asyncio.run(_post_all(_app(), [body], path="/v1/chat/completions"))
    assert r.status_code == 422 and "role" in r.json()["error"]["param"]


def test_body_size_limit_413_before_reading():
    from megatron.rl.inference.validation import RequestLimits

    app = _app(limits=RequestLimits(max_body_bytes=1 << 20))
    big = json.dumps({"prompt": "x" * (3 << 20), "max_tokens": 1}).encode()
    (r,) = asyncio.run(_post_all(app, [big]))
    assert r.status_code == 413 and "1048576" in r.json()["error"]["message"]

    async def chunked():  # no Content-Length: counted while streaming
        async def gen():
            for _ in range(8):
                yield b" " * (256 << 10)
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv") as c:
                return await c.post("/v1/completions", content=gen(), headers=AUTH)

    assert asyncio.run(chunked()).status_code == 413


def test_health_answers_while_a_long_generation_runs():
    class Recording(FakeInference):
        finished = False

        async def agenerate(self, requests):
            out = await super().agenerate(requests)
            self.finished = True
            return out

    backend = Recording(max_seq_len=4096, eos_bias=-50.0)  # never stops early
    app = _app(backend, batch_window_s=0.0)

    async def main():
        async with app.router.lifespan_context(app):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://srv",
                                         timeout=300) as c:
                gen = asyncio.ensure_future(c.post("/v1/completions", headers=AUTH, json={
                    "prompt": "x", "n": 8, "max_tokens": 800, "temperature": 1.0}))
                while backend.num_batches == 0:  # the long batch has started
                    await asyncio.sleep(0.001)
                health = await c.get("/health")
                answered_during_generation = not backend.finished
                return health, answered_during_generation, await gen

    health, during, gen = asyncio.run(main())
    assert health.status_code == 200 and during
    assert gen.status_code == 200 and len(gen.json()["choices"]) == 8


def test_openapi_declares_error_responses_and_limits():
    from megatron.rl.inference.validation import RequestLimits

    limits = RequestLimits(max_n=7, max_prompt_chars=1234, max_stop=3)
    spec = _app(api_key=None, limits=limits).openapi()
    for path in ("/v1/completions", "/v1/chat/completions"):
        assert {"400", "401", "404", "413", "422"} <= set(spec["paths"][path]["post"]["responses"])
    text = json.dumps(spec)
    assert '"maximum": 7' in text and '"maxLength": 1234' in text and '"maxItems": 3' in text
    seed = [s["properties"]["seed"] for s in spec["components"]["schemas"].values() if "seed" in s["properties"]]
    assert seed and seed[0]["anyOf"][0]["maximum"] == pytest.approx(2**63 - 1)  # FastAPI writes it as a float
    roles = [s for s in spec["components"]["schemas"].values() if "role" in s.get("properties", {})]
    assert '"maximum": 100.0' in text and '"exclusiveMinimum": 0.0' in text  # temperature, top_p
    assert roles and roles[0]["properties"]["role"]["enum"] == ["system", "developer", "user", "assistant", "tool"]


def test_docs_and_schema_need_the_key():
    from fastapi.testclient import TestClient

    with TestClient(_app()) as client:
        for path in ("/openapi.json", "/docs"):
            assert client.get(path).status_code == 401
            assert client.get(path, headers=AUTH).status_code == 200
        assert client.get("/health").status_code == 200
    with TestClient(_app(api_key=None)) as client:  # no key: open, as before
        assert client.get("/openapi.json").status_code == 200


@pytest.mark.parametrize("header,ok", [(f"Bearer {KEY}", True), (f"bearer {KEY}", True), (f"BEARER  {KEY} ", True),
                                       (KEY, False), (f"Basic {KEY}", False), ("Bearer", False),
                                       (f"Bearer {KEY}x", False)])
def test_one_authorization_rule(header, ok):
    from fastapi.testclient import TestClient

    from megatron.rl.server.agent import create_app as create_env_app
    from tests.unit_tests.rl.agent.user_agents_fixture import ReverseWordAgent

    with TestClient(_app()) as inference, TestClient(create_env_app(ReverseWordAgent(), token=KEY,
                                                                    inference=FakeInference())) as env:
        for client, path in ((inference, "/v1/models"), (env, "/agent")):
            r = client.get(path, headers={"Authorization": header})
            assert (r.status_code == 200) == ok, (path, header, r.status_code)
            assert r.status_code in (200, 401)


def test_invalid_backend_results_for_direct_python_callers():
    """The direct Python entry applies the same rules (the OpenAI client never sends an invalid request)."""
    from megatron.rl.inference import build_inference_interface

    client = build_inference_interface("openai", base_url="http://127.0.0.1:9/v1", model="m", max_retries=0)
    bad = InferenceRequest.model_construct(prompt="x", messages=None, generation_args=GenerationArgs.model_construct(
        temperature=1.0, top_p=1.0, top_k=0, max_tokens=2, stop=[], seed=-5, n=2))
    out = client.generate([bad])  # would be "unreachable" if it were sent
    assert [r.finish_reason for r in out] == ["error", "error"] and "seed" in out[0].error
    with pytest.raises(ValueError, match="seed"):
        GenerationArgs(seed=2**63)
