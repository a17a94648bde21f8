"""RemoteAgent (``type: remote``): an environment served by ``python -m megatron.rl.server.agent``.

The in-process inference object cannot travel over HTTP: the server generates with the request's ``inference``
spec (only if its operator allowlisted it), else this agent's, else its own backend. Connection failures and
HTTP 502/503/504 are retried with backoff; a request the server accepted is never retried (it would advance
the server's prompt stream twice).

YAML example and failure behaviour: docs/agents.md.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any, Iterator

import httpx
from pydantic import Field

from megatron.rl.agent.api import (Agent, AgentError, AgentRequest, AgentResponse, EvaluationRequest,
                                   EvaluationResponse, GroupedRolloutRequest, GroupedRolloutResponse,
                                   InferenceSpec, RolloutRequest, RolloutResponse)

logger = logging.getLogger(__name__)

__all__ = ["RemoteAgent", "RemoteAgentError"]

_RETRY_STATUS = {502, 503, 504}


class RemoteAgentError(AgentError):
    """The environment server could not be reached or failed the request; the message says which and why."""


@Agent.register_subclass("remote")
class RemoteAgent(Agent):
    """Client of an environment server (see the module docstring).

    url: server base URL. token / token_env: bearer token, or the environment variable holding it.
    timeout_s: limit for one request (generation can take long). connect_timeout_s: limit to connect.
    max_retries / retry_backoff_s: retries of connection failures (backoff doubles each time).
    inference: backend spec sent with requests that carry none.
    """

    url: str
    token: str | None = Field(default=None, repr=False, exclude=True)
    token_env: str | None = None
    timeout_s: float = Field(default=600.0, gt=0)
    connect_timeout_s: float = Field(default=10.0, gt=0)
    max_retries: int = Field(default=3, ge=0)
    retry_backoff_s: float = Field(default=0.5, ge=0)
    inference: InferenceSpec | None = None

    # -- plumbing -----------------------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        headers = {"X-DP-Rank": str(self._dp_rank), "X-DP-World-Size": str(self._dp_world_size)}
        token = self.token or (os.environ.get(self.token_env) if self.token_env else None)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        return headers

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(self.timeout_s, connect=self.connect_timeout_s)

    def _error_from_response(self, resp: httpx.Response, what: str) -> RemoteAgentError:
        try:
            body = resp.json()
            detail = f"{body.get('error', '')}: {body.get('detail', body)}"
        except ValueError:
            detail = resp.text[:2000]
        return RemoteAgentError(f"environment server {self.url} answered {what} with HTTP {resp.status_code}: {detail}")

    def _classify(self, exc: Exception, what: str) -> tuple[bool, RemoteAgentError]:
        """``(retryable, error)`` for a transport exception."""
        if isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout)):
            return True, RemoteAgentError(f"cannot connect to environment server {self.url} for {what}: {exc!r}; "
                                          "is `python -m megatron.rl.server.agent` running there?")
        if isinstance(exc, httpx.ReadTimeout):
            return False, RemoteAgentError(f"environment server {self.url} did not answer {what} within "
                                           f"timeout_s={self.timeout_s}s")
        return False, RemoteAgentError(f"environment server {self.url} dropped the connection during {what} "
                                       f"({type(exc).__name__}: {exc}); did the server crash or restart?")

    def _retry_delays(self) -> Iterator[float]:
        """Seconds to wait before each attempt: 0 for the first, then exponential backoff."""
        delay = self.retry_backoff_s
        yield 0.0
        for _ in range(self.max_retries):
            yield delay
            delay *= 2

    def _judge(self, what: str, resp: httpx.Response | None, exc: Exception | None) -> tuple[bool, Any]:
        """One attempt's outcome: (True, json body) when done, (False, error) to retry; raises when final."""
        if exc is not None:
            retryable, error = self._classify(exc, what)
            if not retryable:
                raise error from exc
            return False, error
        if resp.status_code in _RETRY_STATUS:
            return False, self._error_from_response(resp, what)
        if resp.status_code != 200:
            raise self._error_from_response(resp, what)
        return True, resp.json()

    def _gave_up(self, last: RemoteAgentError | None) -> RemoteAgentError:
        return RemoteAgentError(f"{last} (gave up after {self.max_retries + 1} attempts)")

    async def _post(self, path: str, payload: dict[str, Any], what: str) -> Any:
        last = None
        async with httpx.AsyncClient(base_url=self.url, timeout=self._timeout()) as client:
            for attempt, delay in enumerate(self._retry_delays()):
                if attempt:
                    logger.warning("%s (attempt %d/%d); retrying in %.1fs", last, attempt, self.max_retries, delay)
                    await asyncio.sleep(delay)
                resp, exc = None, None
                try:
                    resp = await client.post(path, json=payload, headers=self._headers())
                except httpx.HTTPError as e:
                    exc = e
                done, last = self._judge(what, resp, exc)
                if done:
                    return last
        raise self._gave_up(last)

    def _sync(self, method: str, path: str, what: str, payload: Any = None) -> Any:
        last = None
        with httpx.Client(base_url=self.url, timeout=self._timeout()) as client:
            for attempt, delay in enumerate(self._retry_delays()):
                if attempt:
                    logger.warning("%s (attempt %d/%d); retrying in %.1fs", last, attempt, self.max_retries, delay)
                    time.sleep(delay)
                resp, exc = None, None
                try:
                    resp = client.request(method, path, json=payload, headers=self._headers())
                except httpx.HTTPError as e:
                    exc = e
                done, last = self._judge(what, resp, exc)
                if done:
                    return last
        raise self._gave_up(last)

    async def request(self, request: AgentRequest) -> AgentResponse:
        """Send any request; returns the server's response as its concrete type."""
        if request.inference is None and self.inference is not None:
            request = request.model_copy(update={"inference": self.inference})
        if request.inference is None and request.inference_interface is not None:
            logger.debug("%s: the in-process inference interface is not sent; the server uses its default "
                         "backend", self.name)
        what = type(request).__name__
        body = await self._post("/request", request.model_dump(mode="json"), what)
        try:
            return AgentResponse.model_validate(body)
        except ValueError as e:
            raise RemoteAgentError(f"environment server {self.url} sent an invalid {what} response: {e}") from e

    async def _expect(self, request: AgentRequest, cls: type) -> Any:
        response = await self.request(request)
        if not isinstance(response, cls):
            raise RemoteAgentError(f"environment server {self.url} answered {type(request).__name__} with a "
                                   f"{type(response).__name__}, expected {cls.__name__}")
        return response

    # -- the Agent API ------------------------------------------------------------------------------------
    async def generate_grouped_rollouts(self, request: GroupedRolloutRequest) -> GroupedRolloutResponse:
        return await self._expect(request, GroupedRolloutResponse)

    async def generate_rollouts(self, request: RolloutRequest) -> RolloutResponse:
        return await self._expect(request, RolloutResponse)

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        return await self._expect(request, EvaluationResponse)

    def health(self) -> dict[str, Any]:
        return self._sync("GET", "/health", "health check")

    def state_dict(self) -> dict[str, Any]:
        return {"remote": self._sync("GET", "/state", "state_dict")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "remote" not in state:
            raise ValueError(f"remote agent {self.name!r}: state has no 'remote' key (keys: {sorted(state)})")
        self._sync("POST", "/state", "load_state_dict", state["remote"])
