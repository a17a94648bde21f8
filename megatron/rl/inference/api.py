"""The inference API every agent talks to: requests, responses and the backend interface.

Agents only ever see an :class:`InferenceInterface`. Backends (the in-process Megatron Core engine,
an OpenAI-compatible HTTP server, Hugging Face ``transformers``, a deterministic fake for tests)
register themselves by name with ``@InferenceInterface.register("name")`` and are built with
:func:`build_inference_interface` from a flag or a YAML value.

Log-prob convention (all backends): ``InferenceResponse.logprobs[i]`` is the log-probability of the
i-th *generated* token under ``softmax(logits / T)``, the temperature-scaled distribution *before*
top-p / top-k truncation. That is exactly what the trainer recomputes with a teacher-forced forward
at the sampling temperature. For greedy decoding (``temperature == 0``) backends use ``T = 1``.
"""
from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import logging
import threading
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, Sequence, TypeVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

# One rule for every backend and the trainer: greedy (T = 0) log-probs are reported under T = 1.
from megatron.rl.algorithms.logprobs import logprob_temperature
from megatron.rl.base.registry import Registry
from megatron.rl.base.chat import ChatMessage  # re-exported: requests carry chat messages
from megatron.rl.base.routes import Routes
from megatron.rl.inference.validation import (SEED_MAX, MaxTokens, NumSamples, Seed, StopString,
                                              Temperature, Text, TopK, TopP, request_error, sample_count)

from megatron.rl.base.errors import RLError
from megatron.rl.base.secrets import resolve_secrets

logger = logging.getLogger(__name__)

__all__ = [
    "GenerationArgs",
    "ChatMessage",
    "InferenceRequest",
    "InferenceResponse",
    "InferenceInterface",
    "InferenceError",
    "CANCELLED",
    "build_inference_interface",
    "backend_class",
    "backend_names",
    "registered_backends",
    "expand_requests",
    "expand_checked",
    "run_isolated",
    "logprob_temperature",
]


class InferenceError(RLError, RuntimeError):
    """A backend could not serve a request at all (unreachable server, unknown backend, ...)."""


class GenerationArgs(BaseModel):
    """Sampling parameters of one request. Invalid values raise ``pydantic.ValidationError`` naming the field.

    temperature: 0 means greedy (argmax), else in [1e-3, 100] (finite). top_p: in (0, 1]. top_k: 0 disables
    top-k. max_tokens: maximum number of generated tokens (>= 1). stop: generation ends *before* the first
    occurrence of any of these strings in the generated text (the stop string is not returned).
    seed: in [0, SEED_MAX = 2**53 - 1]; makes sampling reproducible per request (backends derive per-sample seeds for
    ``n > 1``). n: number of independent samples for this request (each becomes its own response).
    The rules live in :mod:`megatron.rl.inference.validation`.
    """

    model_config = ConfigDict(extra="forbid")

    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: TopK = 0
    max_tokens: MaxTokens = 256
    stop: list[StopString] = Field(default_factory=list)
    seed: Seed | None = None
    n: NumSamples = 1

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: Any) -> Any:
        # OpenAI accepts a single string or a list; None means "no stop strings".
        if v is None:
            return []
        if isinstance(v, str):
            return [v]
        return v



@dataclasses.dataclass
class _CancelFlag:
    cancelled: bool = False


#: the ``error`` of a cancelled request's responses
CANCELLED = "cancelled: the caller no longer wanted this request's responses"


class InferenceRequest(BaseModel):
    """Either a plain text ``prompt`` or chat ``messages`` (exactly one), plus generation args.

    Chat messages are rendered to text by the backend with the tokenizer's chat template (see
    :mod:`megatron.rl.inference.chat_template`); an agent never handles tokenizers itself.

    prefix_token_ids (token in): token ids placed before the prompt exactly as given, never re-tokenized; the
    text ``prompt`` is then tokenized on its own (no special tokens) and appended, and may be empty. A
    multi-turn episode passes the engine's own tokens so far plus the environment's next observation as the
    prompt, so the tokens it trains on are exactly the tokens the policy saw and generated. Text prompts only;
    a backend that cannot take token prompts (an OpenAI-compatible server) fails such a request alone.

    :meth:`cancel` (e.g. the inference server, when the client disconnected) asks the backend to stop generating
    for the request at its next step, even in the middle of a batch; its responses then fail with
    :data:`CANCELLED`. The samples of ``n > 1`` (:func:`expand_requests`) share the request's flag.
    """

    prompt: Text | None = None
    messages: list[ChatMessage] | None = None
    prefix_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    generation_args: GenerationArgs = Field(default_factory=GenerationArgs)
    _cancel: _CancelFlag = PrivateAttr(default_factory=_CancelFlag)

    def cancel(self) -> None:
        """Nobody waits for this request's responses any more (thread-safe; see the class docstring)."""
        self._cancel.cancelled = True

    @property
    def cancelled(self) -> bool:
        return self._cancel.cancelled

    @model_validator(mode="after")
    def _exactly_one_input(self) -> "InferenceRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("InferenceRequest needs exactly one of `prompt` or `messages` "
                             f"(got prompt={'set' if self.prompt is not None else 'None'}, "
                             f"messages={'set' if self.messages is not None else 'None'})")
        if self.prefix_token_ids is not None:
            if self.messages is not None:
                raise ValueError("InferenceRequest.prefix_token_ids goes with a text `prompt` (the text after the "
                                 "prefix), not with chat `messages`")
            if not self.prefix_token_ids:
                raise ValueError("InferenceRequest.prefix_token_ids is empty: leave it None for a text-only prompt")
            return self
        if self.prompt is not None and self.prompt == "":
            raise ValueError("InferenceRequest.prompt is empty: give at least one character of prompt text")
        if self.messages is not None and len(self.messages) == 0:
            raise ValueError("InferenceRequest.messages is empty: give at least one chat message")
        return self


class InferenceResponse(BaseModel):
    """The result of one sample.

    text: generated text only (without the prompt, without a matched stop string).
    token_ids: prompt token ids followed by generated token ids, shape [prompt_length + num_generated].
    prompt_length: number of prompt tokens at the front of ``token_ids``.
    logprobs: one float per generated token (see the module docstring for the convention), or None when
      the backend cannot provide them (e.g. a remote server that does not return them).
    finish_reason: "stop" (EOS or stop string), "length" (hit max_tokens / max sequence length),
      "error" (this request failed; ``error`` says why; other requests in the batch are unaffected).
    prompt_text: the prompt as the backend saw it (chat requests: the rendered template).
    error: human-readable reason when ``finish_reason == "error"`` (an addition to the contract).
    policy_versions: the policy version (trainer iteration) that generated each generated token, from backends
      whose weights change under in-flight requests (asynchronous partial rollouts); None otherwise.
    routes: the MoE experts every token of ``token_ids`` was routed to, ``[layers, len(token_ids), k]``
      (:class:`~megatron.rl.base.routes.Routes`), from the in-process engine when it records them; None otherwise.
    """

    text: str
    token_ids: list[int]
    prompt_length: int
    logprobs: list[float] | None = None
    finish_reason: Literal["stop", "length", "error"]
    prompt_text: str | None = None
    error: str | None = None
    policy_versions: list[int] | None = None
    routes: Routes | None = None

    @property
    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.prompt_length:]

    @classmethod
    def failed(cls, message: str, prompt_text: str | None = None) -> "InferenceResponse":
        """A per-request error response (the batch carries on)."""
        return cls(text="", token_ids=[], prompt_length=0, logprobs=None, finish_reason="error",
                   prompt_text=prompt_text, error=message)


# Built-in backends live in modules that may import heavy or optional packages, so they are imported
# on first use only. A backend in any other module registers itself when that module is imported.
_BUILTIN_BACKEND_MODULES: dict[str, str] = {
    "megatron": "megatron.rl.inference.megatron",
    "openai": "megatron.rl.inference.openai",
    "huggingface": "megatron.rl.inference.huggingface",
    "fake": "megatron.rl.inference.fake",
}

_T = TypeVar("_T", bound=type)


class InferenceInterface(abc.ABC):
    """Base class of all inference backends.

    Subclasses implement :meth:`agenerate`; many concurrent requests are handed over in one call and
    batched by the backend, never serialised. Register a subclass with
    ``@InferenceInterface.register("name")`` and build it with ``build_inference_interface("name", ...)``.
    Hooks with defaults: :meth:`rollout_phase` (what brackets a rollout phase), :meth:`from_cli`,
    :meth:`for_untrusted_spec`. This is generation only: what an RL trainer asks of the backend it generates
    with (how to build it from the run's flags, pausing across weight updates, refits, policy versions) is
    :class:`~megatron.rl.inference.control.TrainerControl`, which in-process backends implement too.
    Wrappers derive from :class:`~megatron.rl.inference.forwarding.ForwardingInference`.
    """

    _registry: ClassVar[Registry[type["InferenceInterface"]]] = Registry(
        "inference backend", builtins=_BUILTIN_BACKEND_MODULES, error=InferenceError)
    name: ClassVar[str] = ""
    #: True when the backend merges concurrent ``agenerate`` calls itself (continuous batching, e.g. a
    #: dynamic engine). The inference server then forwards each HTTP request as soon as it arrives instead
    #: of collecting requests into one ``agenerate`` call.
    continuous_batching: ClassVar[bool] = False

    # Abilities: what the run's checks ask of the backend --inference-backend names, declared by its class and read
    # from the registered class (``backend_class(name).records_routes``), never by comparing backend names. A new
    # backend declares what it can do here and every check follows. (Whether the trainer's weight updates reach it
    # is :attr:`TrainerControl.supports_weight_updates <megatron.rl.inference.control.TrainerControl>`.)
    #: It generates with this run's megatron-core model in this process: an engine sized by the engine flags
    #: (``--inference-dynamic-batching-*``), run in lockstep by the ranks of a model-parallel replica, that a separate
    #: inference layout can build as a copy and ``--rl-serve-inference`` can serve.
    in_process_engine: ClassVar[bool] = False
    #: Its responses carry the MoE experts every token was routed to (``InferenceResponse.routes``), which
    #: ``--rl-router-replay rollout`` replays in the trainer.
    records_routes: ClassVar[bool] = False
    #: It captures its own decode step in CUDA graphs (``--cuda-graph-impl local``).
    captures_decode_graphs: ClassVar[bool] = False
    #: It generates on a server at ``--inference-server-url``, which a run with it must give.
    needs_server_url: ClassVar[bool] = False
    #: Its constructor takes a live model, so a standalone server builds it from a checkpoint's flags
    #: (:meth:`from_cli`) only, never from ``--backend-arg`` values.
    serves_checkpoint: ClassVar[bool] = False

    @classmethod
    def from_cli(cls, argv: list[str]) -> "InferenceInterface":
        """Build the backend from command-line flags (used by ``python -m megatron.rl.server.inference``).

        A backend that needs its own flags (e.g. the Megatron backend: model architecture + ``--load``)
        overrides this; the server passes it every argument after ``--``.
        """
        raise NotImplementedError(f"inference backend {cls.name!r} takes no command-line flags; pass constructor "
                                  "arguments with --backend-arg KEY=VALUE instead")

    @classmethod
    def for_untrusted_spec(cls, **kwargs: Any) -> "InferenceInterface":
        """Build the backend from arguments a remote client sent (an environment server's allowlisted spec).

        The default refuses ``trust_remote_code`` and otherwise calls the constructor; a backend that would
        fall back on the server's own credentials (environment variables) overrides this to not do so.
        """
        if kwargs.get("trust_remote_code"):
            raise ValueError("trust_remote_code is never honoured from a request")
        return cls(**kwargs)

    @classmethod
    def register(cls, name: str) -> Callable[[_T], _T]:
        """Class decorator registering a backend under ``name`` (a different class under a taken name raises
        :class:`~megatron.rl.base.registry.DuplicateNameError`)."""

        def deco(backend_cls: _T) -> _T:
            if not (isinstance(backend_cls, type) and issubclass(backend_cls, InferenceInterface)):
                raise TypeError(f"@InferenceInterface.register({name!r}) needs an InferenceInterface subclass, "
                                f"got {backend_cls!r}")
            InferenceInterface._registry.add(name, backend_cls)
            backend_cls.name = name
            return backend_cls

        return deco

    @abc.abstractmethod
    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        """Generate for all ``requests`` together.

        Returns ``sum(r.generation_args.n for r in requests)`` responses: request order, and a request
        with ``n > 1`` yields ``n`` consecutive responses. A request the backend cannot serve (e.g. a
        prompt longer than the model's maximum length) gets a ``finish_reason="error"`` response; it
        never fails the other requests.
        """

    def generate(self, prompt: str | InferenceRequest | Sequence[InferenceRequest],
                 **generation_args: Any) -> list[InferenceResponse]:
        """Synchronous wrapper around :meth:`agenerate`; always returns a list of responses.

        ``generate("Hello", temperature=0, max_tokens=8)`` builds one request from a text prompt and
        keyword :class:`GenerationArgs`; ``generate([req1, req2])`` runs prepared requests (keyword
        args are then not allowed). Works from plain code and from inside a running event loop (it then
        runs the coroutine on a helper thread with its own loop).
        """
        if isinstance(prompt, str):
            requests = [InferenceRequest(prompt=prompt, generation_args=GenerationArgs(**generation_args))]
        else:
            if generation_args:
                raise TypeError("generate(): keyword generation args are only accepted with a text prompt; "
                                "put them in each InferenceRequest.generation_args instead "
                                f"(got {sorted(generation_args)})")
            requests = [prompt] if isinstance(prompt, InferenceRequest) else list(prompt)
        return run_sync(self.agenerate(requests))

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator["InferenceInterface"]:
        """Bracket a rollout phase (``with backend.rollout_phase(): ...``); the trainer does not train inside.

        A backend that holds resources only while generating (the in-process engine's KV cache) acquires
        them here and frees them on the way out. Default: nothing to do.
        """
        yield self

    async def aclose(self) -> None:
        """Release resources (connections, KV caches). Default: nothing to release."""

    def close(self) -> None:
        run_sync(self.aclose())

    def __enter__(self) -> "InferenceInterface":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def run_sync(coro: Any) -> Any:
    """Run a coroutine to completion from synchronous code, even when this thread has a running loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return _run(coro)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["value"] = _run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            result["error"] = e

    t = threading.Thread(target=target, name="inference-run-sync")
    t.start()
    t.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


def _run(coro: Any) -> Any:
    """``asyncio.run(coro)`` that keeps the result out of the task.

    On the main thread ``asyncio.run`` swaps the SIGINT handler in and out, and restoring it builds (and drops)
    an error message holding ``repr`` of the finished main task, result included: for a rollout phase that is
    the repr of every rollout, ~10 ms of pydantic formatting per call at 128 rollouts.
    """
    box: dict[str, Any] = {}

    async def main() -> None:
        box["value"] = await coro

    asyncio.run(main())
    return box["value"]


def registered_backends() -> list[str]:
    """Names of all registered backends, importing the built-in ones that can be imported."""
    InferenceInterface._registry.load_builtins()  # an optional dependency or a module not written yet: skipped
    return list(InferenceInterface._registry)


def backend_names() -> list[str]:
    """Names of the built-in backends and of every backend registered so far, sorted; imports nothing."""
    return InferenceInterface._registry.names()


def backend_class(name: str) -> type[InferenceInterface]:
    """The class registered as ``name`` (importing a built-in backend's module on first use; a real
    ImportError surfaces). Unknown names list the built-in ones without importing them (the megatron
    backend pulls in megatron-core)."""
    return InferenceInterface._registry.get(name)


def build_inference_interface(name: str, **kwargs: Any) -> InferenceInterface:
    """Build the backend registered as ``name`` with ``kwargs``; unknown names list the registered ones.

    A secret may be given through its source (``api_key_env: VAR``, ``api_key_file: PATH``), read here
    (:func:`megatron.rl.base.secrets.resolve_secrets`) so configuration dumps never hold it."""
    return backend_class(name)(**resolve_secrets(kwargs, where=f"{name} backend: "))


def expand_requests(requests: Sequence[InferenceRequest]) -> list[InferenceRequest]:
    """Flatten ``n > 1`` into ``n`` single-sample requests, in response order.

    Sample ``i`` of a seeded request gets seed ``seed + i`` (wrapping within [0, SEED_MAX]) so the samples
    differ but stay reproducible.
    """
    out: list[InferenceRequest] = []
    for req in requests:
        ga = req.generation_args
        if ga.n == 1:
            out.append(req)
            continue
        for i in range(ga.n):
            seed = None if ga.seed is None else (ga.seed + i) % (SEED_MAX + 1)
            out.append(req.model_copy(update={"generation_args": ga.model_copy(update={"n": 1, "seed": seed})}))
    return out




def expand_checked(requests: Sequence[InferenceRequest]) -> list[InferenceRequest | InferenceResponse]:
    """:func:`expand_requests` after checking each request with :func:`validation.request_error`.

    An invalid (or already cancelled) request becomes its failed responses (one per sample it owes) in place of its
    samples, so a backend can batch the rest: one bad request never fails the others.
    """
    out: list[InferenceRequest | InferenceResponse] = []
    for req in requests:
        problem = request_error(req)
        if req.cancelled:
            out.extend(InferenceResponse.failed(CANCELLED) for _ in range(sample_count(req)))
        elif problem is None:
            out.extend(expand_requests([req]))
        else:
            out.extend(InferenceResponse.failed(f"invalid request: {problem}") for _ in range(sample_count(req)))
    return out


def run_isolated(requests: Sequence[InferenceRequest],
                 run: Callable[[list[InferenceRequest]], list[InferenceResponse]]) -> list[InferenceResponse]:
    """Serve ``requests`` with ``run`` (a synchronous batch call on single-sample requests), isolating failures.

    Invalid requests fail alone (:func:`expand_checked`); if ``run`` raises on a batch, the batch is split in
    halves and retried until the requests that make it raise are alone, and only those fail.
    """
    checked = expand_checked(requests)
    todo = [(i, r) for i, r in enumerate(checked) if isinstance(r, InferenceRequest)]
    results = _run_bisecting([r for _, r in todo], run)
    out: list[Any] = list(checked)
    for (i, _), resp in zip(todo, results):
        out[i] = resp
    return out


def _run_bisecting(reqs: list[InferenceRequest],
                   run: Callable[[list[InferenceRequest]], list[InferenceResponse]]) -> list[InferenceResponse]:
    if not reqs:
        return []
    try:
        out = run(reqs)
        if len(out) != len(reqs):
            raise RuntimeError(f"backend returned {len(out)} responses for {len(reqs)} requests")
        return out
    except Exception as e:  # noqa: BLE001 - narrowed down below; the culprit gets a failed response
        if len(reqs) == 1:
            logger.exception("inference backend failed on one request")
            return [InferenceResponse.failed(f"the backend failed on this request ({type(e).__name__})")]
        mid = len(reqs) // 2
        return _run_bisecting(reqs[:mid], run) + _run_bisecting(reqs[mid:], run)
