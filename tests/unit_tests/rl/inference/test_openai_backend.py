"""OpenAI backend response parsing for servers that do / do not return the token-id extension fields."""
from openai.types import Completion
from openai.types.chat import ChatCompletion

from megatron.rl.inference import ChatMessage, InferenceRequest, build_inference_interface


def _backend():
    return build_inference_interface("openai", base_url="http://127.0.0.1:9/v1", model="m")


def test_completion_without_token_ids_keeps_text_and_logprobs():
    resp = Completion.model_validate({
        "id": "x", "object": "text_completion", "created": 0, "model": "m",
        "choices": [{"index": 1, "text": " b", "finish_reason": "length",
                     "logprobs": {"tokens": [" b"], "token_logprobs": [-0.5]}},
                    {"index": 0, "text": " a", "finish_reason": "stop",
                     "logprobs": {"tokens": [" a"], "token_logprobs": [-0.25]}}]})
    out = _backend()._parse(InferenceRequest(prompt="p"), resp)
    assert [r.text for r in out] == [" a", " b"]  # ordered by choice index
    assert [r.logprobs for r in out] == [[-0.25], [-0.5]] and [r.finish_reason for r in out] == ["stop", "length"]
    assert out[0].token_ids == [] and out[0].prompt_length == 0 and out[0].prompt_text == "p"


def test_chat_with_vllm_style_token_ids():
    resp = ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "m", "prompt_token_ids": [1, 2, 3],
        "choices": [{"index": 0, "finish_reason": "tool_calls", "token_ids": [7, 8],
                     "message": {"role": "assistant", "content": "hi"},
                     "logprobs": {"content": [{"token": "h", "logprob": -1.0, "top_logprobs": []},
                                              {"token": "i", "logprob": -2.0, "top_logprobs": []}]}}]})
    (r,) = _backend()._parse(InferenceRequest(messages=[ChatMessage(role="user", content="q")]), resp)
    assert r.token_ids == [1, 2, 3, 7, 8] and r.prompt_length == 3 and r.generated_token_ids == [7, 8]
    assert r.logprobs == [-1.0, -2.0] and r.text == "hi" and r.finish_reason == "stop"
