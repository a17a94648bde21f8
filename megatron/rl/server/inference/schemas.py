"""Request bodies of the OpenAI-compatible endpoints and their translation to :class:`InferenceRequest`.

Bodies only check JSON *types* (FastAPI answers 422 for malformed JSON or wrong types); value ranges are
checked by :class:`GenerationArgs` / :class:`InferenceRequest`, and the server turns those failures into
400 responses with a message naming the field (see :func:`describe_validation_error`).

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
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from megatron.rl.inference.api import ChatMessage, GenerationArgs, InferenceRequest

__all__ = ["CompletionBody", "ChatCompletionBody", "describe_validation_error", "to_generation_args"]


class _Body(BaseModel):
    # unknown OpenAI parameters (user, logit_bias, ...) are ignored rather than rejected, as OpenAI-compatible
    # servers usually do; everything we honour is declared below.
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    return_token_ids: bool | None = None


class CompletionBody(_Body):
    prompt: str | list[str]
    logprobs: int | None = None
    echo: bool | None = False


class _ChatMessageBody(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        # OpenAI "content parts": only text parts are meaningful for a text model
        parts = []
        for p in self.content:
            if p.get("type") != "text":
                raise ValueError(f"messages: content part of type {p.get('type')!r} is not supported "
                                 "(text parts only)")
            parts.append(str(p.get("text", "")))
        return "".join(parts)


class ChatCompletionBody(_Body):
    messages: list[_ChatMessageBody]
    logprobs: bool | None = False
    top_logprobs: int | None = None
    max_completion_tokens: int | None = None


def to_generation_args(body: _Body, default_max_tokens: int) -> GenerationArgs:
    """Map OpenAI parameters onto GenerationArgs (``None`` means "use the default")."""
    max_tokens = body.max_tokens
    if isinstance(body, ChatCompletionBody) and body.max_completion_tokens is not None:
        max_tokens = body.max_completion_tokens
    values = {"temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "n": body.n,
              "stop": body.stop, "seed": body.seed,
              "max_tokens": default_max_tokens if max_tokens is None else max_tokens}
    return GenerationArgs(**{k: v for k, v in values.items() if v is not None})


def completion_requests(body: CompletionBody, default_max_tokens: int) -> list[InferenceRequest]:
    args = to_generation_args(body, default_max_tokens)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    if not prompts:
        raise ValueError("prompt: an empty list of prompts was given; send at least one prompt string")
    return [InferenceRequest(prompt=p, generation_args=args) for p in prompts]


def chat_request(body: ChatCompletionBody, default_max_tokens: int) -> InferenceRequest:
    args = to_generation_args(body, default_max_tokens)
    msgs = [ChatMessage(role=m.role, content=m.text()) for m in body.messages]
    return InferenceRequest(messages=msgs, generation_args=args)


def describe_validation_error(err: Exception) -> tuple[str, str | None]:
    """A one-line message naming the offending field and value, plus the field name (OpenAI's ``param``)."""
    if isinstance(err, ValidationError):
        parts, param = [], None
        for e in err.errors():
            loc = ".".join(str(x) for x in e.get("loc", ()) if x != "generation_args")
            msg = e.get("msg", "invalid value")
            if loc:
                param = param or loc
                parts.append(f"{loc}: {msg} (got {e.get('input')!r})")
            else:
                parts.append(msg.removeprefix("Value error, "))
        return "; ".join(parts), param
    return str(err), None
