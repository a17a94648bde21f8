"""The inference server serving the Hugging Face backend (tiny random Llama), used through the OpenAI backend."""
from __future__ import annotations

import numpy as np
import pytest

from megatron.rl.inference import ChatMessage, GenerationArgs, InferenceRequest, build_inference_interface
from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model
from tests.unit_tests.rl.server.inference.conftest import ServerProcess


@pytest.fixture(scope="module")
def hf_setup(tmp_path_factory):
    path = build_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf_srv"), chat_template=True)
    server = ServerProcess(["--backend", "huggingface", "--backend-arg", f"model_path={path}",
                            "--backend-arg", "device=cpu", "--model-name", "tiny-llama"])
    try:
        local = build_inference_interface("huggingface", model_path=str(path), device="cpu")
        yield server, local
    finally:
        server.stop()


def test_hf_served_through_openai_backend(hf_setup):
    server, local = hf_setup
    remote = build_inference_interface("openai", base_url=server.url + "/v1", timeout=60)
    reqs = [InferenceRequest(prompt="Hello world", generation_args=GenerationArgs(temperature=0, max_tokens=8)),
            InferenceRequest(prompt="The quick brown", generation_args=GenerationArgs(temperature=0.7, max_tokens=8,
                                                                                      seed=5, n=2)),
            InferenceRequest(messages=[ChatMessage(role="user", content="hi")],
                             generation_args=GenerationArgs(temperature=1.0, max_tokens=6, seed=1))]
    out = remote.generate(reqs)
    assert len(out) == 4 and remote.model == "tiny-llama"
    temps = [0.0, 0.7, 0.7, 1.0]
    for r, t in zip(out, temps):
        assert r.prompt_length > 0 and len(r.generated_token_ids) == len(r.logprobs) > 0
        np.testing.assert_allclose(r.logprobs, local.score(r.token_ids, r.prompt_length, t), rtol=0, atol=1e-5)
    assert out[3].prompt_text == "[user]: hi\n[assistant]: "
    # greedy through the server == greedy in process
    assert out[0].token_ids == local.generate("Hello world", temperature=0, max_tokens=8)[0].token_ids
    assert out[1].token_ids != out[2].token_ids


def test_hf_server_too_long_prompt_400(hf_setup):
    server, _ = hf_setup
    remote = build_inference_interface("openai", base_url=server.url + "/v1", timeout=60)
    (r,) = remote.generate("fox " * 300, max_tokens=2)
    assert r.finish_reason == "error" and "maximum sequence length" in r.error
