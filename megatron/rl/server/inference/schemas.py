"""Request bodies of the OpenAI-compatible endpoints and their translation to :class:`InferenceRequest`.

The bodies are built by :func:`body_models` from the server's :class:`RequestLimits`, out of the annotated
types of :mod:`megatron.rl.inference.validation` (the same rules every backend applies), so the OpenAPI
schema states every range and limit (``maximum``, ``maxLength``, ``maxItems``, the chat roles) and a body
that breaks one is answered 422 before it reaches the batcher. Emptiness (``prompt: ""``, no messages) and
unsupported options (``stream``, ``echo``, non-text content parts) are answered 400.

Extensions to the OpenAI schema (all optional):
  request:  ``top_k`` (int, 0 = off), ``return_token_ids`` (accepted for vLLM compatibility; ids are always
            returned by this server).
  response: every choice carries ``token_ids`` (generated token ids), ``prompt_token_ids`` and
            ``prompt_text`` (the prompt as the model saw it; for chat: the rendered template); chat
            responses also carry ``prompt_token_ids`` at the top level (vLLM's layout).
Log-probs (``logprobs`` for completions, ``logprobs: true`` for chat) are those of the sampled tokens under
``softmax(logits / T)`` before top-k/top-p truncation (T=1 when greedy); tokens are spelled
``"token_id:<id>"`` because the server is tokenizer-free, and alternatives (``top_logprobs``) are not given.
"""
# no `from __future__ import annotations`: body_models() builds classes whose annotations use its locals
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from megatron.rl.inference.api import ChatMessage, GenerationArgs, InferenceRequest
from megatron.rl.inference.validation import (ChatRole, RequestLimits, Seed, Temperature, Text, TopK, TopP,
                                              limited_types)

__all__ = ["CompletionBody", "ChatCompletionBody", "ErrorBody", "body_models", "to_generation_args",
           "completion_requests", "chat_request"]

ModelName = Annotated[Text, Field(max_length=256)]


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """OpenAI's error envelope, used for every 4xx/5xx answer."""
    error: _ErrorDetail


class _Body(BaseModel):
    # unknown OpenAI parameters (user, logit_bias, ...) are ignored rather than rejected, as OpenAI-compatible
    # servers usually do; everything we honour is declared (with its limits) in body_models()
    model_config = ConfigDict(extra="ignore")


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Annotated[str, Field(max_length=64)]


def body_models(limits: RequestLimits) -> tuple[type[_Body], type[_Body]]:
    """``(CompletionBody, ChatCompletionBody)`` carrying ``limits`` (see the module docstring)."""
    lim = limited_types(limits)
    Stop = lim["stop"]
    Stops = Annotated[list[Stop], Field(max_length=lim["stops_max"])]
    Prompt = lim["prompt"]

    class CommonBody(_Body):
        model: ModelName | None = None
        max_tokens: lim["max_tokens"] | None = None
        temperature: Temperature | None = None
        top_p: TopP | None = None
        top_k: TopK | None = None
        n: lim["n"] | None = None
        stop: Stop | Stops | None = None
        seed: Seed | None = None
        stream: bool | None = False
        return_token_ids: bool | None = None

    class CompletionBody(CommonBody):
        prompt: Prompt | Annotated[list[Prompt], Field(max_length=lim["prompts_max"])]
        logprobs: lim["logprobs"] | None = None
        echo: bool | None = False

        @model_validator(mode="after")
        def _total_samples(self) -> "CompletionBody":
            prompts = 1 if isinstance(self.prompt, str) else len(self.prompt)
            if prompts * (self.n or 1) > limits.max_samples:
                raise ValueError(f"{prompts} prompt(s) x n={self.n} asks for more than this server's "
                                 f"{limits.max_samples} samples per request; split the request")
            return self

    class ContentPart(_Part):
        text: Prompt | None = None

    class MessageBody(_Body):
        role: ChatRole
        content: Prompt | Annotated[list[ContentPart], Field(max_length=lim["messages_max"])] | None = None

        def text(self) -> str:
            if self.content is None:
                return ""
            if isinstance(self.content, str):
                return self.content
            # OpenAI "content parts": only text parts are meaningful for a text model
            parts = []
            for p in self.content:
                if p.type != "text":
                    raise ValueError(f"messages: content part of type {p.type[:64]!r} is not supported "
                                     "(text parts only)")
                parts.append(p.text or "")
            text = "".join(parts)
            if len(text) > limits.max_prompt_chars:
                raise ValueError(f"messages: a message's text parts add up to more than {limits.max_prompt_chars} "
                                 "characters")
            return text

    class ChatCompletionBody(CommonBody):
        messages: Annotated[list[MessageBody], Field(max_length=lim["messages_max"])]
        logprobs: bool | None = False
        top_logprobs: lim["top_logprobs"] | None = None
        max_completion_tokens: lim["max_tokens"] | None = None

    return CompletionBody, ChatCompletionBody


CompletionBody, ChatCompletionBody = body_models(RequestLimits())


def to_generation_args(body: Any, default_max_tokens: int) -> GenerationArgs:
    """Map OpenAI parameters onto GenerationArgs (``None`` means "use the default")."""
    max_tokens = body.max_tokens
    if getattr(body, "max_completion_tokens", None) is not None:
        max_tokens = body.max_completion_tokens
    values = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "n": body.n,
              "stop": body.stop, "seed": body.seed,
              "max_tokens": default_max_tokens if max_tokens is None else max_tokens}
    return GenerationArgs(**{k: v for k, v in values.items() if v is not None})


def completion_requests(body: Any, default_max_tokens: int) -> list[InferenceRequest]:
    args = to_generation_args(body, default_max_tokens)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ValueError("prompt: an empty list of prompts was given; send at least one prompt string")
    return [InferenceRequest(prompt=p, generation_args=args) for p in prompts]


def chat_request(body: Any, default_max_tokens: int) -> InferenceRequest:
    args = to_generation_args(body, default_max_tokens)
    msgs = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    return InferenceRequest(messages=msgs, generation_args=args)
