"""Token-in prompts (InferenceRequest.prefix_token_ids): validity rules, the fake and Hugging Face backends use
the prefix exactly as given (even a sequence the tokenizer would never produce from text), the OpenAI backend
refuses it alone; TokenEpisode builds episodes from such turns."""
import asyncio

import pytest
import torch
from pydantic import ValidationError

from megatron.rl.agent.token_episode import TokenEpisode, TokenMismatchError
from megatron.rl.inference import InferenceRequest, build_inference_interface
from megatron.rl.inference.api import GenerationArgs, InferenceResponse
from megatron.rl.inference.fake import FakeInference


@pytest.mark.parametrize("kwargs, msg", [
    ({"messages": [{"role": "user", "content": "hi"}], "prefix_token_ids": [1]}, "goes with a text `prompt`"),
    ({"prompt": "x", "prefix_token_ids": []}, "prefix_token_ids is empty"),
    ({"prompt": "x", "prefix_token_ids": [3, -1]}, "greater than or equal to 0"),
])
def test_invalid_prefix_requests(kwargs, msg):
    with pytest.raises(ValidationError, match=msg):
        InferenceRequest(**kwargs)
    assert InferenceRequest(prompt="", prefix_token_ids=[5]).prompt == ""  # the text after a prefix may be empty


def test_fake_backend_prefix_equals_the_same_bytes_as_text():
    fake, ga = FakeInference(), GenerationArgs(max_tokens=6, seed=4, temperature=1.0)
    [whole] = fake.generate([InferenceRequest(prompt="Q: 1+2=? A:", generation_args=ga)])
    [split] = fake.generate([InferenceRequest(prompt="? A:", prefix_token_ids=list(b"Q: 1+2="), generation_args=ga)])
    assert split == whole.model_copy(update={"prompt_text": "? A:"})
    [bare] = fake.generate([InferenceRequest(prompt="", prefix_token_ids=list(b"Q: 1+2=? A:"), generation_args=ga)])
    assert bare.token_ids == whole.token_ids and bare.prompt_length == whole.prompt_length


def test_huggingface_backend_keeps_a_non_canonical_prefix(tmp_path):
    from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model

    hf = build_inference_interface("huggingface", model_path=str(build_tiny_hf_model(tmp_path)), device="cpu")
    text = "The quick brown fox"
    canonical = hf.tokenizer(text)["input_ids"]
    # the same text spelt one byte-level token per character: ids the tokenizer never produces for it
    spelt = [i for ch in text for i in hf.tokenizer(ch, add_special_tokens=False)["input_ids"]]
    assert spelt != canonical and hf.tokenizer.decode(spelt) == hf.tokenizer.decode(canonical)
    ga = GenerationArgs(max_tokens=5, seed=1, temperature=1.0)
    [resp] = hf.generate([InferenceRequest(prompt=" jumps", prefix_token_ids=spelt, generation_args=ga)])
    tail = hf.tokenizer(" jumps", add_special_tokens=False)["input_ids"]
    assert resp.token_ids[:resp.prompt_length] == spelt + tail
    torch.testing.assert_close(torch.tensor(resp.logprobs), torch.tensor(
        hf.score(resp.token_ids, resp.prompt_length, 1.0)), atol=1e-5, rtol=0)


def test_openai_backend_refuses_a_prefix_alone():
    oa = build_inference_interface("openai", base_url="http://127.0.0.1:9/v1", model="m")
    [resp] = asyncio.run(oa.agenerate([InferenceRequest(prompt="x", prefix_token_ids=[1, 2])]))
    assert resp.finish_reason == "error" and "cannot be sent to an OpenAI-compatible server" in resp.error


def _resp(ids, prompt_length, logprobs=None):
    return InferenceResponse(text="", token_ids=ids, prompt_length=prompt_length, finish_reason="stop",
                             logprobs=logprobs if logprobs is not None else [-1.0] * (len(ids) - prompt_length))


def test_token_episode_masks_logprobs_and_mismatch():
    ep = TokenEpisode()
    ga = GenerationArgs()
    assert ep.next_request("Q:", ga).prefix_token_ids is None
    ep.add(_resp([1, 2, 3, 4], 2, [-0.1, -0.2]))
    req = ep.next_request("obs", ga)
    assert req.prefix_token_ids == [1, 2, 3, 4] and req.prompt == "obs"
    ep.add(_resp([1, 2, 3, 4, 9, 9, 5], 6, [-0.3]))
    assert ep.generation_mask == [0, 0, 1, 1, 0, 0, 1] and ep.logprobs == [0, 0, -0.1, -0.2, 0, 0, -0.3]
    assert ep.prompt_length == 2 and ep.turns == 2
    with pytest.raises(TokenMismatchError, match="do not start with the 7 tokens"):
        ep.add(_resp([1, 2, 3, 0, 9, 9, 5, 6], 7))
    ep.add(InferenceResponse(text="", token_ids=ep.token_ids + [8], prompt_length=7, finish_reason="stop"))
    assert ep.logprobs is None  # a turn without log-probs: none for the episode
