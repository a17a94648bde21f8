"""What both HTTP servers do to untrusted input before any route runs: one rule each, written once.

Authorization (:func:`authorized`: ``Bearer`` scheme required, case-insensitive, constant-time compare); body
size and pace (:class:`BodySizeLimit`: 413 over the limit, 408 past ``body_timeout_s``); connections
(``--max-connections``, 503 past it); docs routes behind the key (:func:`install_docs`); bounded caches
(:class:`LRUCache`).

Reasons: docs/server.md.
"""
from __future__ import annotations

import asyncio
import hmac
import time
from collections import OrderedDict
from typing import Any, Awaitable, Callable, Generic, Hashable, TypeVar

from fastapi import Depends, FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response

from megatron.rl.inference.validation import RequestLimits

__all__ = ["bearer_token", "authorized", "BodySizeLimit", "install_docs", "LRUCache", "LOOPBACK_HOSTS",
           "safe_message"]

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
MAX_CONNECTIONS = 1024


def safe_message(text: str, limit: int = 500) -> str:
    """An error message fit to send: bounded, and encodable even when it quotes a client's lone surrogate."""
    text = text if len(text) <= limit else text[:limit] + "..."
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def bearer_token(header: str | None) -> str | None:
    """The token of ``Authorization: Bearer <token>`` (scheme case-insensitive), or None."""
    scheme, _, token = (header or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        return None
    return token.strip()


def authorized(header: str | None, expected: str | None) -> bool:
    """True when no token is expected or ``header`` carries exactly ``expected`` (see the module docstring)."""
    if expected is None:
        return True
    given = bearer_token(header)
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


class BodySizeLimit:
    """ASGI middleware answering 413 for request bodies over ``max_bytes`` (``reject(status, message)``).

    The body is read here (at most ``max_bytes``) and replayed to the app; later ``receive`` calls (the
    servers' disconnect watch) go to the connection as usual.
    """

    def __init__(self, app: Any, max_bytes: int, reject: Callable[[int, str], Response], timeout_s: float = 30.0):
        self.app, self.max_bytes, self.reject, self.timeout_s = app, int(max_bytes), reject, float(timeout_s)

    def _too_large(self) -> Response:
        return self.reject(413, f"request body is larger than this server's limit of {self.max_bytes} bytes "
                                f"(--limit max_body_bytes=N)")

    def _too_slow(self) -> Response:
        response = self.reject(408, f"the request body did not arrive within {self.timeout_s:g} s "
                                    f"(--limit body_timeout_s=N)")
        response.headers["Connection"] = "close"
        return response

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                await self.reject(400, "Content-Length is not an integer")(scope, receive, send)
                return
            if declared > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except asyncio.TimeoutError:
                await self._too_slow()(scope, receive, send)
                return
            if message["type"] != "http.request":  # disconnected while sending: nothing to answer
                return
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._too_large()(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def install_docs(app: FastAPI, auth: Callable[..., Any], title: str) -> None:
    """``GET /openapi.json`` and ``GET /docs`` behind the ``auth`` dependency (create the app with
    ``openapi_url=None, docs_url=None, redoc_url=None``)."""

    @app.get("/openapi.json", include_in_schema=False, dependencies=[Depends(auth)])
    async def openapi() -> JSONResponse:
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=[Depends(auth)])
    async def docs() -> HTMLResponse:
        # the schema is embedded ("spec"): the page's own fetch of /openapi.json could not send the key
        return get_swagger_ui_html(openapi_url="", title=title, swagger_ui_parameters={"spec": app.openapi()})


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class LRUCache(Generic[K, V]):
    """At most ``capacity`` entries; adding one more evicts the least recently used (``on_evict(key, value)``)."""

    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None):
        if capacity < 1:
            raise ValueError(f"LRUCache capacity must be >= 1, got {capacity}")
        self.capacity, self.on_evict = capacity, on_evict
        self._items: OrderedDict[K, V] = OrderedDict()

    def get(self, key: K) -> V | None:
        if key not in self._items:
            return None
        self._items.move_to_end(key)
        return self._items[key]

    def put(self, key: K, value: V) -> None:
        self._items[key] = value
        self._items.move_to_end(key)
        while len(self._items) > self.capacity:
            old_key, old_value = self._items.popitem(last=False)
            if self.on_evict is not None:
                self.on_evict(old_key, old_value)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, key: object) -> bool:
        return key in self._items


def add_limit_flag(parser: Any) -> None:
    """``--limit KEY=VALUE`` (repeatable): override one field of :class:`RequestLimits`; ``--max-connections``."""

    defaults = ", ".join(f"{k}={v}" for k, v in RequestLimits().__dict__.items())
    parser.add_argument("--limit", action="append", default=[], metavar="KEY=VALUE",
                        help=f"per-request limit (repeatable); defaults: {defaults}")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS, metavar="N",
                        help="connections and requests in flight at once; past it new ones are answered 503 "
                             f"(default {MAX_CONNECTIONS})")


def limits_from_flags(values: list[str], parser: Any) -> Any:
    """The :class:`RequestLimits` of ``--limit`` values; a bad one is a usage error naming it."""

    known = RequestLimits().__dict__
    chosen: dict[str, int] = {}
    for text in values:
        key, sep, value = text.partition("=")
        if not sep or key not in known:
            parser.error(f"--limit {text!r}: expected KEY=VALUE with KEY one of {', '.join(known)}")
        try:
            chosen[key] = int(value)
        except ValueError:
            parser.error(f"--limit {text!r}: VALUE must be an integer")
    try:
        return RequestLimits(**chosen)
    except ValueError as e:
        parser.error(f"--limit: {e}")
