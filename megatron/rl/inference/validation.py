"""The rules an inference request must satisfy: one place for the servers' schemas and the backends' entry.

Validity (every backend): the annotated types the request models are built from, re-checked per request by
:func:`request_error` before batching, so a bad request fails alone. Limits (servers only, set by the
operator): :class:`RequestLimits`, turned into annotated types by :func:`limited_types` for the servers' body
models. Pure: no I/O, no globals beyond constants.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema, create_model

# The chat vocabulary lives in the base package (rollouts use it too); re-exported here with the other rules.
from megatron.rl.base.chat import CHAT_ROLES, ChatRole, Text, check_unicode

__all__ = [
    "SEED_MAX", "MIN_TEMPERATURE", "MAX_TEMPERATURE", "MAX_TOP_K", "MAX_N", "MAX_TOKENS", "CHAT_ROLES",
    "ChatRole", "Text", "Temperature", "TopP", "TopK", "Seed", "NumSamples", "MaxTokens", "StopString",
    "check_unicode", "RequestLimits", "limited_types", "generation_limits_model", "request_error", "sample_count", "describe_validation_error",
]

#: seeds are non-negative integers that a JSON number holds exactly (2**53 - 1, JavaScript's largest safe integer;
#: numpy, torch and megatron-core take up to 2**63 - 1): a client or schema tool that reads JSON numbers as doubles
#: rounds integers near 2**63 to another value, so a bound there means different seeds to it than to the server
SEED_MAX = 2**53 - 1
#: below this, ``logits / T`` overflows float32 (1e-38 gives NaN probabilities); 0 still means greedy
MIN_TEMPERATURE = 1e-3
#: above this the distribution is uniform to float precision anyway
MAX_TEMPERATURE = 100.0
#: int32: what the sampling kernels index with
MAX_TOP_K = 2**31 - 1
MAX_TOKENS = 2**31 - 1
#: samples of one request; a server caps it far lower (RequestLimits.max_n)
MAX_N = 65536
def _check_temperature(value: float) -> float:
    if 0.0 < value < MIN_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or at least {MIN_TEMPERATURE}")
    return value


Temperature = Annotated[float, Field(ge=0.0, le=MAX_TEMPERATURE, allow_inf_nan=False),
                        AfterValidator(_check_temperature),
                        WithJsonSchema({"anyOf": [{"type": "number", "const": 0},
                                                  {"type": "number", "minimum": MIN_TEMPERATURE,
                                                   "maximum": MAX_TEMPERATURE}],
                                        "description": f"0 = greedy, else {MIN_TEMPERATURE}..{MAX_TEMPERATURE}"})]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
TopK = Annotated[int, Field(ge=0, le=MAX_TOP_K)]
Seed = Annotated[int, Field(ge=0, le=SEED_MAX)]
NumSamples = Annotated[int, Field(ge=1, le=MAX_N)]
MaxTokens = Annotated[int, Field(ge=1, le=MAX_TOKENS)]
StopString = Annotated[str, Field(min_length=1), AfterValidator(check_unicode)]


@dataclass(frozen=True)
class RequestLimits:
    """How much work one HTTP request may ask of a server (the operator's choice; CLI flags of both servers).

    max_body_bytes: request body size (413 above it). max_n: samples per prompt. max_samples: samples of
    one HTTP request in total (prompts x n; for the environment server: rollouts of one request).
    max_tokens: the ``max_tokens`` a request may ask for. max_stop / max_stop_chars: stop strings and
    their length. max_prompt_chars: characters of a prompt or of one chat message. max_prompts: prompts
    of one completion request. max_messages: messages of one chat request. max_logprobs /
    max_top_logprobs: OpenAI's ``logprobs`` (completions) and ``top_logprobs`` (chat). body_timeout_s: seconds
    the whole body may take to arrive after the headers (408 and the connection closed after it).

    The defaults bound one request's work to ``max_samples`` x ``max_tokens`` (256 x 4096 tokens: a GRPO group of
    64 for each of 4 prompts), so that no client holds a server for long: a static-batching backend
    (Hugging Face, the fake) serves one batch at a time, and a request arriving meanwhile waits for it.
    """

    max_body_bytes: int = 8 * 2**20
    max_n: int = 64
    max_samples: int = 256
    max_tokens: int = 4096
    max_stop: int = 16
    max_stop_chars: int = 256
    max_prompt_chars: int = 1_000_000
    max_prompts: int = 4
    max_messages: int = 256
    max_logprobs: int = 5
    max_top_logprobs: int = 20
    body_timeout_s: int = 30

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"RequestLimits.{f.name} must be a positive integer, got {value!r}")
        if self.max_n > MAX_N or self.max_tokens > MAX_TOKENS:
            raise ValueError(f"RequestLimits: max_n <= {MAX_N} and max_tokens <= {MAX_TOKENS} (got "
                             f"{self.max_n}, {self.max_tokens})")


def limited_types(limits: RequestLimits) -> dict[str, Any]:
    """Annotated types carrying ``limits`` (validity rules included), keyed by what they type.

    ``n``, ``max_tokens``, ``stop`` (one string), ``stops`` (the list), ``prompt`` (one text),
    ``prompts`` (the list), ``messages_max``, ``logprobs``, ``top_logprobs``.
    """
    return {
        "n": Annotated[int, Field(ge=1, le=limits.max_n)],
        "max_tokens": Annotated[int, Field(ge=1, le=limits.max_tokens)],
        "stop": Annotated[str, Field(min_length=1, max_length=limits.max_stop_chars), AfterValidator(check_unicode)],
        "stops_max": limits.max_stop,
        "prompt": Annotated[str, Field(max_length=limits.max_prompt_chars), AfterValidator(check_unicode)],
        "prompts_max": limits.max_prompts,
        "messages_max": limits.max_messages,
        "logprobs": Annotated[int, Field(ge=0, le=limits.max_logprobs)],
        "top_logprobs": Annotated[int, Field(ge=0, le=limits.max_top_logprobs)],
    }


def generation_limits_model(limits: RequestLimits) -> type[BaseModel]:
    """A model checking a ``GenerationArgs`` dump against ``limits`` (n, max_tokens, stop strings) only."""
    lim = limited_types(limits)
    return create_model("GenerationLimits", __config__=ConfigDict(extra="ignore"),
                        n=(lim["n"], 1), max_tokens=(lim["max_tokens"], 1),
                        stop=(Annotated[list[lim["stop"]], Field(max_length=lim["stops_max"])], []))


def describe_validation_error(err: Exception, max_errors: int = 3) -> tuple[str, str | None]:
    """A short message naming the offending field(s), plus the first field's name (OpenAI's ``param``).

    Values are quoted only when short: a rejected 100 MB prompt is not echoed back.
    """
    if not callable(getattr(err, "errors", None)):  # a plain exception: its first line, bounded
        return (str(err).splitlines() or [type(err).__name__])[0][:300], None
    errors = [dict(e, loc=_clean_loc(e.get("loc", ()))) for e in err.errors()]
    # a union (`str | list[str]`) reports one error per member: keep the informative ones (a limit broken
    # by the list member) over "should be a valid string" from the members the value is not
    specific = {e["loc"][:1] for e in errors if not str(e.get("type", "")).endswith("_type")}
    errors = [e for e in errors if e["loc"][:1] not in specific or not str(e.get("type", "")).endswith("_type")]
    parts, param = [], None
    for e in errors[:max_errors]:
        if e.get("type") == "json_invalid":
            parts.append(f"the body is not valid JSON ({e.get('ctx', {}).get('error', 'decode error')})")
            continue
        loc = ".".join(str(x) for x in e["loc"])
        msg = str(e.get("msg", "invalid value")).removeprefix("Value error, ")
        shown = _short_repr(e.get("input"))
        if loc:
            param = param or loc
            parts.append(f"{loc}: {msg}" + (f" (got {shown})" if shown else ""))
        else:
            parts.append(msg)
    more = len(errors) - max_errors
    return "; ".join(parts) + (f"; and {more} more" if more > 0 else ""), param


def _clean_loc(loc: Any) -> tuple:
    """Field path without the wrappers' names and pydantic's union-member tags (``function-after[...]``)."""
    return tuple(x for x in loc if x not in ("generation_args", "body")
                 and not (isinstance(x, str) and ("[" in x or "-" in x or x in ("str", "int", "float", "list"))))


def _short_repr(value: Any, limit: int = 40) -> str | None:
    if isinstance(value, (dict, list)) or value is None:
        return None
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    text = repr(value)
    return text if len(text) <= limit else None


def request_error(request: Any) -> str | None:
    """None when ``request`` (an ``InferenceRequest``) satisfies every validity rule, else a short reason.

    Re-validates from a dump, so requests that skipped pydantic (``model_construct``, mutation) are
    checked too; never raises.
    """
    try:
        type(request).model_validate(request.model_dump())
    except ValidationError as e:
        return describe_validation_error(e)[0]
    except Exception as e:  # noqa: BLE001 - anything a malformed object raises makes it invalid, not the batch
        return f"malformed request ({type(e).__name__})"
    return None


def sample_count(request: Any) -> int:
    """How many responses a request owes: its ``n`` when that is valid, else 1 (an invalid ``n``)."""
    n = getattr(getattr(request, "generation_args", None), "n", 1)
    return n if isinstance(n, int) and not isinstance(n, bool) and 1 <= n <= MAX_N else 1
