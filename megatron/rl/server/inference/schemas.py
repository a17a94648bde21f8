"""Request bodies of the OpenAI-compatible endpoints and their translation to :class:`InferenceRequest`.

:func:`body_models` builds the bodies from the server's :class:`RequestLimits` and the annotated types of
:mod:`megatron.rl.inference.validation`, so the OpenAPI schema states every limit the server enforces and a body
the schema admits is served. Undeclared keys and OpenAI options the server cannot honour are 400 unless they
carry their neutral value. Extensions: ``top_k``, and ``token_ids`` / ``prompt_token_ids`` in every response.

Options, extensions and log-prob convention: docs/server.md.
"""
# no `from __future__ import annotations`: body_models() builds classes whose annotations use its locals
from typing import Annotated, Any

from pydantic import (AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, WithJsonSchema, create_model,
                      model_validator)
from pydantic_core import PydanticCustomError

from megatron.rl.inference.api import ChatMessage, GenerationArgs, InferenceRequest
from megatron.rl.inference.validation import (ChatRole, RequestLimits, Seed, Temperature, Text, TopK, TopP,
                                              limited_types)

__all__ = ["CompletionBody", "ChatCompletionBody", "ErrorBody", "body_models", "to_generation_args",
           "completion_requests", "chat_request", "UNSUPPORTED_ERROR_TYPES"]

ModelName = Annotated[Text, Field(max_length=256)]


def _served_model(name: str) -> Any:
    """``model``: the served model's name only (the schema's enum); another is a ``model_not_found`` error (404)."""

    def check(value: str) -> str:
        if value != name:
            raise PydanticCustomError("model_not_found", "model {model} is not served here; this server serves {name} "
                                      "(see GET /v1/models)", {"model": repr(value[:64]), "name": repr(name)})
        return value

    return Annotated[str, AfterValidator(check), WithJsonSchema({"type": "string", "enum": [name]})]


class _ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorBody(BaseModel):
    """OpenAI's error envelope, used for every 4xx/5xx answer."""
    error: _ErrorDetail


def _integral_float(value: Any) -> Any:
    # JSON Schema's integers include 1.0; the strict body models take them as 1 (and refuse 1.5, "1" and true)
    return int(value) if isinstance(value, float) and value.is_integer() else value


def _json_int(t: Any) -> Any:
    return Annotated[t, BeforeValidator(_integral_float)]


#: pydantic error types that mean "an option this server does not support" (answered 400, not 422)
UNSUPPORTED_ERROR_TYPES = ("extra_forbidden", "unsupported_option")


def _json_kind(value: Any) -> str:
    return "boolean" if isinstance(value, bool) else "number" if isinstance(value, (int, float)) else type(value).__name__


def _neutral_only(neutral: Any, hint: str) -> Any:
    """An OpenAI option this server cannot honour: accepted only with its neutral value (or null), which is all
    its schema admits; anything else is an ``unsupported_option`` error naming it."""

    def check(value: Any) -> Any:
        if value is not None and not (_json_kind(value) == _json_kind(neutral) and value == neutral):  # 0.0 != false
            raise PydanticCustomError("unsupported_option", "not supported by this server: {hint}", {"hint": hint})
        return value

    return Annotated[Any, AfterValidator(check),
                     WithJsonSchema({"anyOf": [{"const": neutral}, {"type": "null"}],
                                     "description": f"not supported: only {neutral!r} (or null) is accepted"})]


def _unsupported_options(chat: bool) -> dict[str, Any]:
    common = {
        "logit_bias": _neutral_only({}, "leave it out"),
        "frequency_penalty": _neutral_only(0, "send 0 or leave it out"),
        "presence_penalty": _neutral_only(0, "send 0 or leave it out"),
        "stream": _neutral_only(False, "send stream=false"),
        "stream_options": _neutral_only({}, "leave it out (no streaming)"),
    }
    if chat:
        return {**common, "tools": _neutral_only([], "leave it out (no tool calling)"),
                "tool_choice": _neutral_only("none", 'send "none" or leave it out'),
                "functions": _neutral_only([], "leave it out (no function calling)"),
                "function_call": _neutral_only("none", 'send "none" or leave it out'),
                "response_format": _neutral_only({"type": "text"},
                                                    'send {"type": "text"} or leave it out')}
    return {**common, "best_of": _neutral_only(1, "use n for several samples"),
            "suffix": _neutral_only("", "leave it out (no insertion)"),
            "echo": _neutral_only(False, "send echo=false; the prompt comes back in prompt_text and "
                                                       "prompt_token_ids")}


class _Body(BaseModel):
    # Everything this server reads is declared (with its limits) in body_models(), and so are the OpenAI options
    # it cannot honour (neutral values only): any other key is refused, never silently ignored. Strict: "5" is
    # not an integer nor "true" a boolean here, as the schema says.
    model_config = ConfigDict(extra="forbid", strict=True)


class _Part(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    # only text parts are meaningful for a text model: other types (image_url, ...) are unsupported options
    type: _neutral_only("text", 'only "text" content parts (no images or audio)')


def body_models(limits: RequestLimits, model_name: str | None = None) -> tuple[type[_Body], type[_Body]]:
    """``(CompletionBody, ChatCompletionBody)`` carrying ``limits`` (see the module docstring); with ``model_name``,
    ``model`` must name it (any other is answered 404)."""
    lim = limited_types(limits)
    # prompts x n <= max_samples, stated by the schema: n <= min(max_n, max_samples) and as many prompts as fit
    max_n = min(limits.max_n, limits.max_samples)
    common = _common_body(lim, max_n, model_name)
    CompletionBase = create_model("CompletionBase", __base__=common,
                                  **{k: (t, None) for k, t in _unsupported_options(chat=False).items()})
    ChatBase = create_model("ChatBase", __base__=common,
                            **{k: (t, None) for k, t in _unsupported_options(chat=True).items()})
    return _completion_body(CompletionBase, lim, limits, max_n), _chat_body(ChatBase, lim, limits)


def _common_body(lim: dict[str, Any], max_n: int, model_name: str | None) -> type[_Body]:
    """The fields both endpoints read: model, sampling, stop strings, seed."""
    Stop = lim["stop"]
    Stops = Annotated[list[Stop], Field(max_length=lim["stops_max"])]
    N = Annotated[int, Field(ge=1, le=max_n)]

    class CommonBody(_Body):
        model: (ModelName if model_name is None else _served_model(model_name)) | None = None
        max_tokens: _json_int(lim["max_tokens"]) | None = None
        temperature: Temperature | None = None
        top_p: TopP | None = None
        top_k: _json_int(TopK) | None = None
        n: _json_int(N) | None = None
        stop: Stop | Stops | None = None
        seed: _json_int(Seed) | None = None
        return_token_ids: bool | None = None
        user: Annotated[str, Field(max_length=256)] | None = None  # accepted, unused

    return CommonBody


def _completion_body(base: type[_Body], lim: dict[str, Any], limits: RequestLimits, max_n: int) -> type[_Body]:
    """/v1/completions: one prompt or a list of them, at most ``max_samples`` samples in all."""
    Prompt = Annotated[lim["prompt"], Field(min_length=1)]
    Prompts = Annotated[list[Prompt], Field(min_length=1, max_length=max(1, min(limits.max_prompts,
                                                                                 limits.max_samples // max_n)))]

    class CompletionBody(base):
        prompt: Prompt | Prompts
        logprobs: _json_int(lim["logprobs"]) | None = None

        @model_validator(mode="after")
        def _total_samples(self) -> "CompletionBody":
            prompts = 1 if isinstance(self.prompt, str) else len(self.prompt)
            if prompts * (self.n or 1) > limits.max_samples:
                raise ValueError(f"{prompts} prompt(s) x n={self.n} asks for more than this server's "
                                 f"{limits.max_samples} samples per request; split the request")
            return self

    return CompletionBody


def _chat_body(base: type[_Body], lim: dict[str, Any], limits: RequestLimits) -> type[_Body]:
    """/v1/chat/completions: messages of text or text parts."""

    class ContentPart(_Part):
        text: lim["prompt"] | None = None

    class MessageBody(_Body):
        role: ChatRole
        content: lim["prompt"] | Annotated[list[ContentPart], Field(max_length=lim["messages_max"])] | None = None

        def text(self) -> str:
            if self.content is None:
                return ""
            if isinstance(self.content, str):
                return self.content
            # OpenAI "content parts": only text parts are meaningful for a text model
            parts = [p.text or "" for p in self.content]
            text = "".join(parts)
            if len(text) > limits.max_prompt_chars:
                raise ValueError(f"messages: a message's text parts add up to more than {limits.max_prompt_chars} "
                                 "characters")
            return text

    class ChatCompletionBody(base):
        messages: Annotated[list[MessageBody], Field(min_length=1, max_length=lim["messages_max"])]
        logprobs: bool | None = False
        top_logprobs: _json_int(lim["top_logprobs"]) | None = None
        max_completion_tokens: _json_int(lim["max_tokens"]) | None = None

    return ChatCompletionBody


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
