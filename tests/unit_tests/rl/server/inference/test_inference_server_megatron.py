"""The inference server serving the Megatron backend (tiny megatron-core GPT), used through the OpenAI backend.

Marked slow (a megatron-core model in a server subprocess): run with ``-m slow``.
"""
from __future__ import annotations

import asyncio

import httpx
import numpy as np
import pytest

from megatron.rl.inference import ChatMessage, GenerationArgs, InferenceRequest, build_inference_interface
from megatron.rl.training.tokenizer import ByteLevelTokenizer
from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.server.inference.conftest import ServerProcess

pytestmark = pytest.mark.slow

SCRIPT = REPO_ROOT / "tests/unit_tests/rl/server/inference/scripts/serve_megatron.py"


@pytest.fixture(scope="module")
def megatron_server():
    server = ServerProcess([], script=SCRIPT, startup_timeout=180)
    try:
        yield server
    finally:
        server.stop()


def test_megatron_served_through_openai_backend(megatron_server):
    remote = build_inference_interface("openai", base_url=megatron_server.url + "/v1", timeout=120)
    reqs = [InferenceRequest(prompt="The quick brown fox", generation_args=GenerationArgs(temperature=0,
                                                                                           max_tokens=10)),
            InferenceRequest(prompt="1 + 1 =", generation_args=GenerationArgs(temperature=0.7, max_tokens=10,
                                                                              seed=3, n=2)),
            InferenceRequest(messages=[ChatMessage(role="user", content="hi")],
                             generation_args=GenerationArgs(temperature=1.0, max_tokens=8, seed=1))]
    out = remote.generate(reqs)
    assert len(out) == 4 and remote.model == "tiny-gpt"
    tok = ByteLevelTokenizer()
    for r, t in zip(out, [0.0, 0.7, 0.7, 1.0]):
        assert r.finish_reason in ("stop", "length") and len(r.logprobs) == len(r.generated_token_ids) > 0
        assert r.token_ids[:r.prompt_length] == tok.tokenize(r.prompt_text)
        ref = httpx.post(megatron_server.url + "/test/score", timeout=60,
                         json={"token_ids": r.token_ids, "prompt_length": r.prompt_length, "temperature": t}).json()
        np.testing.assert_allclose(r.logprobs, ref["logprobs"], rtol=0, atol=1e-5)
    assert out[3].prompt_text == "<|user|>\nhi\n<|assistant|>\n"
    again = remote.generate(reqs[:1])[0]
    assert again.token_ids == out[0].token_ids  # greedy is deterministic through the server


def test_megatron_server_concurrent_and_bad_requests(megatron_server):
    remote = build_inference_interface("openai", base_url=megatron_server.url + "/v1", timeout=120,
                                       max_concurrency=64)
    reqs = [InferenceRequest(prompt=f"request {i}:", generation_args=GenerationArgs(max_tokens=4, seed=i))
            for i in range(64)]
    reqs.append(InferenceRequest(prompt="x" * 400, generation_args=GenerationArgs(max_tokens=4)))
    out = asyncio.run(remote.agenerate(reqs))
    assert all(r.finish_reason in ("stop", "length") for r in out[:-1])
    assert out[-1].finish_reason == "error" and "400" in out[-1].error
    r = httpx.post(megatron_server.url + "/v1/completions", json={"prompt": "Hi", "temperature": -1})
    assert r.status_code == 422 and "temperature" in r.json()["error"]["message"]  # out of the schema's range
    assert megatron_server.health()["status"] == "ok"
