"""FastAPI app serving one agent configuration to any number of training processes.

Routes (JSON bodies are the polymorphic pydantic types of :mod:`megatron.rl.agent.api`, tagged by
``type_name``):

* ``GET  /health``  -> ``{"status": "ok", "agent": <type>, "env_id": <name>}`` (no token needed)
* ``GET  /agent``   -> the agent's configuration (``agent.model_dump()``)
* ``POST /request`` -> an :class:`AgentRequest` (grouped rollouts, rollouts, evaluation) in, the matching
  :class:`AgentResponse` out
* ``GET  /state``   -> the agent's ``state_dict()``; ``POST /state`` loads one

Each client's data-parallel coordinates travel in the ``X-DP-Rank`` / ``X-DP-World-Size`` headers; the
server keeps one agent instance (with its own prompt stream) per coordinate pair, so ranks sharing a server
still draw disjoint prompts. With a token configured every route but ``/health`` needs
``Authorization: Bearer <token>``. Agent errors come back as HTTP 500 with ``{"error", "detail"}``.
"""
from __future__ import annotations

import hmac
import logging
from typing import Any

from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from megatron.rl.agent.api import Agent, AgentRequest
from megatron.rl.inference.api import InferenceInterface

logger = logging.getLogger(__name__)

__all__ = ["create_app"]


def create_app(agent: Agent, token: str | None = None, inference: InferenceInterface | None = None) -> FastAPI:
    """An app serving ``agent`` (see the module docstring).

    token: required bearer token (None: no authentication; only bind to loopback then).
    inference: default backend for requests that name none.
    """
    app = FastAPI(title="megatron-rl environment server")
    config = agent.model_dump()
    agents: dict[tuple[int, int], Agent] = {}

    def agent_for(rank: int, world: int) -> Agent:
        if not 0 <= rank < world:
            raise HTTPException(400, f"X-DP-Rank={rank} is outside X-DP-World-Size={world}")
        key = (rank, world)
        if key not in agents:
            # A fresh instance per data-parallel rank: same configuration, independent prompt stream.
            inst = type(agent).model_validate(config)
            inst.bind_inference(inference)
            inst.set_data_parallel(rank, world)
            agents[key] = inst
        return agents[key]

    def check_token(authorization: str | None) -> None:
        if token is None:
            return
        given = (authorization or "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise HTTPException(401, "missing or wrong bearer token (Authorization: Bearer <token>)")

    @app.exception_handler(Exception)
    async def _agent_error(request: Request, exc: Exception) -> JSONResponse:  # pragma: no cover - trivial
        logger.exception("agent error on %s", request.url.path)
        return JSONResponse(status_code=500, content={"error": type(exc).__name__, "detail": str(exc)})

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "agent": agent.type_name, "env_id": agent.name}

    @app.get("/agent")
    async def get_agent(authorization: str | None = Header(None)) -> dict[str, Any]:
        check_token(authorization)
        return config

    @app.post("/request")
    async def handle(request: Request, authorization: str | None = Header(None),
                     x_dp_rank: int = Header(0), x_dp_world_size: int = Header(1)) -> JSONResponse:
        check_token(authorization)
        try:
            req = AgentRequest.model_validate(await request.json())
        except (ValidationError, ValueError) as e:  # ValueError: the body is not JSON
            return JSONResponse(status_code=422, content={"error": "ValidationError", "detail": str(e)})
        if type(req) is AgentRequest:
            return JSONResponse(status_code=422, content={"error": "ValidationError", "detail":
                                f"request needs a type_name, one of {sorted(AgentRequest.registered_types())}"})
        response = await agent_for(x_dp_rank, x_dp_world_size).handle(req)
        return JSONResponse(content=response.model_dump(mode="json"))

    @app.get("/state")
    async def get_state(authorization: str | None = Header(None), x_dp_rank: int = Header(0),
                        x_dp_world_size: int = Header(1)) -> dict[str, Any]:
        check_token(authorization)
        return agent_for(x_dp_rank, x_dp_world_size).state_dict()

    @app.post("/state")
    async def set_state(state: dict[str, Any], authorization: str | None = Header(None), x_dp_rank: int = Header(0),
                        x_dp_world_size: int = Header(1)) -> dict[str, str]:
        check_token(authorization)
        agent_for(x_dp_rank, x_dp_world_size).load_state_dict(state)
        return {"status": "ok"}

    return app
