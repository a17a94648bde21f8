"""FastAPI app exposing any :class:`InferenceInterface` as an OpenAI-compatible server.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /health``.
A :class:`RequestBatcher` hands concurrent requests to one ``agenerate`` call (a ``continuous_batching``
backend gets each at once). Failures stay with their request: schema errors 422/413/400 before the batcher, a
per-request backend error 400, a raising batch retried in halves so only the culprits get 500. Disconnected
clients' requests are cancelled. Every error is OpenAI's error object.

Batching and failure isolation in full: docs/server.md.
"""
# no `from __future__ import annotations`: the routes are typed with body classes built in create_app()
import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.inference.validation import RequestLimits, describe_validation_error
from megatron.rl.server.guard import BodySizeLimit, authorized, install_docs, safe_message
from megatron.rl.server.inference.schemas import (UNSUPPORTED_ERROR_TYPES, ErrorBody, body_models, chat_request,
                                                  completion_requests)
from megatron.rl.base.errors import RLError

logger = logging.getLogger(__name__)

__all__ = ["create_app", "RequestBatcher", "ServerConfig"]


@dataclass
class ServerConfig:
    """Server settings. ``api_key``: when set, every route but ``/health`` needs ``Authorization: Bearer <key>``.

    limits: how much one HTTP request may ask for (see :class:`RequestLimits`); ``default_max_tokens`` must
    be within ``limits.max_tokens``.
    """
    model_name: str = "megatron-rl"
    api_key: str | None = None
    batch_window_s: float = 0.005
    max_batch_requests: int = 256
    default_max_tokens: int = 256
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if not 1 <= self.default_max_tokens <= self.limits.max_tokens:
            raise ValueError(f"default_max_tokens={self.default_max_tokens} must be within 1..max_tokens limit "
                             f"{self.limits.max_tokens}")


class BackendFailure(RLError, RuntimeError):
    """The backend raised while serving a batch."""


@dataclass
class _Pending:
    requests: list[InferenceRequest]
    future: asyncio.Future
    num_samples: int = 0


@dataclass
class BatchStats:
    batches: int = 0
    requests: int = 0
    samples: int = 0
    max_batch_samples: int = 0
    dropped_disconnected: int = 0  # requests whose client left before their batch started
    cancelled_disconnected: int = 0  # requests whose client left while the backend worked on them
    backend_errors: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RequestBatcher:
    """Collects concurrent requests into ``agenerate`` batches (see the module docstring)."""

    def __init__(self, backend: InferenceInterface, window_s: float, max_batch_requests: int):
        self.backend = backend
        self.window_s = window_s
        self.max_batch_requests = max_batch_requests
        self.stats = BatchStats()
        self._queue: asyncio.Queue[_Pending] | None = None
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._queue = asyncio.Queue()
        if not self.backend.continuous_batching:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="inference-batcher")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def submit(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        n = sum(r.generation_args.n for r in requests)
        self.stats.requests += 1
        if self.backend.continuous_batching:
            self._count_batch(n)
            try:
                return await self._call_backend(requests)
            except asyncio.CancelledError:  # the client left while the backend worked on it
                self.stats.cancelled_disconnected += 1
                raise
        fut = asyncio.get_running_loop().create_future()
        await self._queue.put(_Pending(requests, fut, n))
        return await fut

    def _count_batch(self, samples: int) -> None:
        self.stats.batches += 1
        self.stats.samples += samples
        self.stats.max_batch_samples = max(self.stats.max_batch_samples, samples)

    async def _call_backend(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        try:
            out = await self.backend.agenerate(requests)
        except Exception as e:  # noqa: BLE001 - reported to the callers of this batch, the server carries on
            self.stats.backend_errors += 1
            logger.exception("inference backend failed on a batch of %d requests", len(requests))
            raise BackendFailure(f"the inference backend failed ({type(e).__name__}; see the server log)") from e
        expected = sum(r.generation_args.n for r in requests)
        if len(out) != expected:
            self.stats.backend_errors += 1
            logger.error("backend returned %d responses for %d samples", len(out), expected)
            raise BackendFailure(f"the inference backend returned {len(out)} responses for {expected} samples")
        return out

    async def _collect(self) -> list[_Pending]:
        first = await self._queue.get()
        batch, count = [first], len(first.requests)
        deadline = asyncio.get_running_loop().time() + self.window_s
        while count < self.max_batch_requests:
            remaining = deadline - asyncio.get_running_loop().time()
            try:
                item = self._queue.get_nowait() if remaining <= 0 else \
                    await asyncio.wait_for(self._queue.get(), remaining)
            except (asyncio.QueueEmpty, asyncio.TimeoutError):
                break
            batch.append(item)
            count += len(item.requests)
        return batch

    async def _run(self) -> None:
        while True:
            batch = await self._collect()
            live = [p for p in batch if not p.future.done()]  # done = cancelled by a client disconnect
            self.stats.dropped_disconnected += len(batch) - len(live)
            if not live:
                continue
            self._count_batch(sum(p.num_samples for p in live))
            await self._serve(live)

    async def _serve(self, live: list[_Pending]) -> None:
        """One backend call for ``live``; if it raises, retry in halves so only the culprits fail."""
        try:
            out = await self._call_backend([r for p in live for r in p.requests])
        except BackendFailure as e:
            if len(live) == 1:
                if not live[0].future.done():
                    live[0].future.set_exception(e)
                return
            mid = len(live) // 2
            await self._serve(live[:mid])
            await self._serve(live[mid:])
            return
        start = 0
        for p in live:
            if p.future.done():  # the client left while the backend worked on it
                self.stats.cancelled_disconnected += 1
            else:
                p.future.set_result(out[start:start + p.num_samples])
            start += p.num_samples


_HTTP_MESSAGES = {400: "the body could not be parsed as JSON (invalid UTF-8, or nested too deeply)",
                  404: "no such route: see GET /v1/models, POST /v1/completions, POST /v1/chat/completions",
                  405: "method not allowed on this route"}


def _validation_error(exc: RequestValidationError) -> JSONResponse:
    """400 for a body that is not JSON or names an unsupported option (the option named), else 422."""
    errors = exc.errors()
    if any(e.get("type") == "json_invalid" for e in errors):
        return _error(400, describe_validation_error(exc)[0])
    wrong_model = [e for e in errors if e.get("type") == "model_not_found"]
    if wrong_model:
        return _error(404, str(wrong_model[0]["msg"]), param="model", kind="not_found_error")
    unsupported = [e for e in errors if e.get("type") in UNSUPPORTED_ERROR_TYPES]
    if unsupported:
        names = [".".join(str(x) for x in e["loc"] if x != "body") for e in unsupported]
        hints = [str(e["msg"]) if e["type"] == "unsupported_option" else "not supported by this server (leave it "
                 "out)" for e in unsupported]
        return _error(400, "; ".join(f"{n}: {h}" for n, h in zip(names, hints)), param=names[0])
    msg, param = describe_validation_error(exc)
    return _error(422, msg, param=param)


def _error(status: int, message: str, param: str | None = None, kind: str = "invalid_request_error") -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": safe_message(message), "type": kind,
                                           "param": None if param is None else safe_message(param, 100),
                                           "code": status}})


async def _wait_unless_disconnected(request: Request, coro: Any) -> Any:
    """Await ``coro``; if the client disconnects first, cancel it and return None."""
    work = asyncio.ensure_future(coro)

    async def disconnected() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if work in done:
        return work.result()
    work.cancel()
    logger.info("client disconnected before its response was ready: its requests are dropped from the queue, or "
                "cancelled if their batch is running")
    return None


def _logprobs_completion(resp: InferenceResponse) -> dict[str, Any]:
    return {"tokens": [f"token_id:{t}" for t in resp.generated_token_ids], "token_logprobs": resp.logprobs,
            "top_logprobs": None, "text_offset": None}


def _logprobs_chat(resp: InferenceResponse) -> dict[str, Any]:
    return {"content": [{"token": f"token_id:{t}", "logprob": lp, "bytes": None, "top_logprobs": []}
                        for t, lp in zip(resp.generated_token_ids, resp.logprobs or [])]}


def _usage(responses: list[InferenceResponse]) -> dict[str, int]:
    prompt = sum(r.prompt_length for r in responses)
    completion = sum(len(r.generated_token_ids) for r in responses)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


_STATUS_TEXT = {400: "body not JSON, an unsupported option (named), or a prompt the model cannot serve (e.g. longer "
                     "than its context)", 401: "missing or wrong API key",
                404: "model not served here", 413: "request body too large",
                422: "body does not match the schema (type, range or limit)", 500: "inference backend failure"}
_RESPONSES: dict[int | str, dict[str, Any]] = {code: {"model": ErrorBody, "description": text}
                                               for code, text in _STATUS_TEXT.items()}


def create_app(backend: InferenceInterface, config: ServerConfig | None = None) -> FastAPI:
    """Build the FastAPI app serving ``backend``. Run it with uvicorn (see ``python -m megatron.rl.server.inference``)."""
    cfg = config or ServerConfig()
    batcher = RequestBatcher(backend, cfg.batch_window_s, cfg.max_batch_requests)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            await batcher.stop()
            await backend.aclose()

    app = FastAPI(title="megatron-rl inference server", lifespan=lifespan, openapi_url=None, docs_url=None,
                  redoc_url=None)
    app.state.batcher = batcher
    app.state.backend = backend
    app.add_middleware(BodySizeLimit, max_bytes=cfg.limits.max_body_bytes, timeout_s=cfg.limits.body_timeout_s,
                       reject=lambda status, message: _error(status, message))

    async def check_auth(request: Request) -> None:
        if not authorized(request.headers.get("authorization"), cfg.api_key):
            raise _AuthError()

    _install_error_handlers(app)
    install_docs(app, check_auth, app.title)
    _install_routes(app, backend, batcher, cfg, check_auth)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    """A missing key, a body off the schema and FastAPI's own answers, each as OpenAI's error object."""

    @app.exception_handler(_AuthError)
    async def _auth_failed(request: Request, exc: _AuthError) -> JSONResponse:
        return _error(401, "missing or invalid API key: send 'Authorization: Bearer <key>' (the server's --api-key)",
                      kind="authentication_error")

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # FastAPI's own answers: 404/405, and 400 for a body JSON cannot parse (bad UTF-8, nesting too deep)
        message = _HTTP_MESSAGES.get(exc.status_code, str(exc.detail))
        response = _error(exc.status_code, message, kind="not_found_error" if exc.status_code == 404 else
                          "invalid_request_error")
        response.headers.update(exc.headers or {})  # 405's Allow
        return response


def _install_routes(app: FastAPI, backend: InferenceInterface, batcher: RequestBatcher, cfg: ServerConfig,
                    check_auth: Any) -> None:
    """/health, /v1/models, /v1/completions and /v1/chat/completions."""
    CompletionBody, ChatCompletionBody = body_models(cfg.limits, cfg.model_name)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "backend": backend.name, "model": cfg.model_name, "stats": batcher.stats.as_dict()}

    @app.get("/v1/models", dependencies=[Depends(check_auth)], responses={401: _RESPONSES[401]})
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": cfg.model_name, "object": "model", "created": 0,
                                            "owned_by": f"megatron-rl:{backend.name}"}]}

    @app.post("/v1/completions", dependencies=[Depends(check_auth)], responses=_RESPONSES)
    async def completions(body: CompletionBody, request: Request):
        try:
            reqs = completion_requests(body, cfg.default_max_tokens)
        except (ValidationError, ValueError) as e:
            msg, param = describe_validation_error(e)
            return _error(400, msg, param=param)
        out = await _run(request, batcher, reqs)
        if isinstance(out, JSONResponse):
            return out
        choices = [{"index": i, "text": r.text, "finish_reason": r.finish_reason,
                    "logprobs": _logprobs_completion(r) if body.logprobs is not None else None,
                    "token_ids": r.generated_token_ids, "prompt_token_ids": r.token_ids[:r.prompt_length],
                    "prompt_text": r.prompt_text} for i, r in enumerate(out)]
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": cfg.model_name, "choices": choices, "usage": _usage(out)}

    @app.post("/v1/chat/completions", dependencies=[Depends(check_auth)], responses=_RESPONSES)
    async def chat_completions(body: ChatCompletionBody, request: Request):
        try:
            req = chat_request(body, cfg.default_max_tokens)
        except (ValidationError, ValueError) as e:
            msg, param = describe_validation_error(e)
            return _error(400, msg, param=param)
        out = await _run(request, batcher, [req])
        if isinstance(out, JSONResponse):
            return out
        choices = [{"index": i, "message": {"role": "assistant", "content": r.text}, "finish_reason": r.finish_reason,
                    "logprobs": _logprobs_chat(r) if body.logprobs else None, "token_ids": r.generated_token_ids,
                    "prompt_token_ids": r.token_ids[:r.prompt_length], "prompt_text": r.prompt_text}
                   for i, r in enumerate(out)]
        return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": cfg.model_name, "choices": choices, "usage": _usage(out),
                "prompt_token_ids": out[0].token_ids[:out[0].prompt_length]}


async def _run(request: Request, batcher: RequestBatcher,
               requests: list[InferenceRequest]) -> list[InferenceResponse] | JSONResponse:
    """The responses to one HTTP request's ``requests``, or the error that answers it."""
    try:
        out = await _wait_unless_disconnected(request, batcher.submit(requests))
    except BackendFailure as e:
        return _error(500, str(e), kind="server_error")
    if out is None:  # client gone; the status is never seen
        for r in requests:  # its share of a running batch ends at the backend's next step
            r.cancel()
        return _error(499, "client disconnected")
    errors = [r.error or "request failed" for r in out if r.finish_reason == "error"]
    if errors:
        return _error(400, errors[0], param="prompt")
    return out


class _AuthError(RLError):
    pass
