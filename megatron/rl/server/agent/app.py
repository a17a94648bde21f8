"""FastAPI app serving one agent configuration to any number of training processes.

Routes: ``GET /health``, ``GET /agent``, ``POST /request``, ``GET``/``POST /state``; bodies are the polymorphic
types of :mod:`megatron.rl.agent.api`. One agent instance (own prompt stream) per ``X-DP-Rank`` /
``X-DP-World-Size`` pair, at most ``max_agents`` (LRU). Must not: generate with a client's inference spec unless
the operator allowlisted exactly it, or put exception text in a 500 (its detail names an error id in the log).
Limits and authorization: :class:`EnvServerConfig`, :mod:`megatron.rl.server.guard`.

Routes and hostile inputs in full: docs/server.md.
"""
from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass, field
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from megatron.rl.base.secrets import redact
from megatron.rl.agent.api import (Agent, AgentRequest, EvaluationRequest, GroupedRolloutRequest, InferenceSpec,
                                   RolloutRequest)
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, backend_class
from megatron.rl.inference.validation import RequestLimits, describe_validation_error, generation_limits_model
from megatron.rl.server.guard import BodySizeLimit, LRUCache, authorized, install_docs, safe_message
from megatron.rl.server.agent.schema import request_body_schema
from megatron.rl.base.errors import RLError

logger = logging.getLogger(__name__)

__all__ = ["create_app", "EnvServerConfig", "ClientError"]


@dataclass
class EnvServerConfig:
    """Limits and policy of an environment server (``python -m megatron.rl.server.agent`` flags).

    allowed_inference: the inference specs a request may name (exact match on backend and kwargs); empty:
      requests never choose the backend. Specs with ``trust_remote_code`` are refused here.
    limits: body size and generation-args limits (shared with the inference server).
    max_rollouts: rollouts of one request (num_groups x rollouts_per_group, num_rollouts,
      num_prompts x (num_samples + greedy); without num_prompts, the agent's validation ``dataset_size``
      counts, and one that has none must give num_prompts). max_ks: entries of ``ks``.
    max_dp_world_size: largest ``X-DP-World-Size``. max_agents: agent instances kept (one per rank, world).
    """

    allowed_inference: list[InferenceSpec] = field(default_factory=list)
    limits: RequestLimits = field(default_factory=RequestLimits)
    max_rollouts: int = 8192
    max_ks: int = 64
    max_dp_world_size: int = 1024
    max_agents: int = 256

    def __post_init__(self) -> None:
        self.allowed_inference = [InferenceSpec.model_validate(s) for s in self.allowed_inference]
        for spec in self.allowed_inference:
            if spec.kwargs.get("trust_remote_code"):
                raise ValueError(f"allowed inference spec {spec.backend!r}: trust_remote_code is never allowed "
                                 "for a client-chosen backend")
        for name in ("max_rollouts", "max_ks", "max_dp_world_size", "max_agents"):
            if getattr(self, name) < 1:
                raise ValueError(f"EnvServerConfig.{name} must be >= 1, got {getattr(self, name)}")
        default_tokens = GenerationArgs().max_tokens  # what a request without generation_args.max_tokens asks for
        if self.limits.max_tokens < default_tokens:
            raise ValueError(f"--limit max_tokens={self.limits.max_tokens} is below {default_tokens}, the max_tokens of "
                             f"a request that gives none: every such request would be refused")


class ClientError(RLError):
    """A client mistake: answered ``status`` with ``{"error": kind, "detail": message}``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequest"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def _spec_key(spec: InferenceSpec) -> str:
    return json.dumps(spec.model_dump(mode="json"), sort_keys=True)


def _validation_size(agent: Agent) -> int | None:
    size = getattr(agent, "dataset_size", None)
    try:
        n = size(True) if callable(size) else None
    except Exception:  # noqa: BLE001 - unknown size: the caller asks for num_prompts instead
        return None
    return n if isinstance(n, int) and n >= 0 else None


def check_request_limits(req: AgentRequest, cfg: EnvServerConfig, gen_limits: type, agent: Agent) -> None:
    """Raise :class:`ClientError` (422) when ``req`` asks for more work than ``cfg`` allows."""
    try:
        gen_limits.model_validate(req.generation_args.model_dump())
    except ValidationError as e:
        raise ClientError(422, f"generation_args: {describe_validation_error(e)[0]}", "ValidationError") from None
    if isinstance(req, GroupedRolloutRequest):
        if req.num_groups < 1:
            raise ClientError(422, "num_groups must be >= 1", "ValidationError")
        rollouts, what = req.num_groups * req.rollouts_per_group, "num_groups x rollouts_per_group"
    elif isinstance(req, RolloutRequest):
        rollouts, what = req.num_rollouts, "num_rollouts"
    elif isinstance(req, EvaluationRequest):
        if len(req.ks or []) > cfg.max_ks:
            raise ClientError(422, f"ks has {len(req.ks)} entries; at most {cfg.max_ks}", "ValidationError")
        prompts = req.num_prompts if req.num_prompts is not None else _validation_size(agent)
        if prompts is None:  # "the whole split" of a task whose size the server cannot tell
            raise ClientError(422, "num_prompts is required for this environment (it bounds the work per request)",
                              "ValidationError")
        rollouts, what = prompts * (req.num_samples + int(req.greedy)), "num_prompts x (num_samples + greedy)"
    else:
        return
    if rollouts > cfg.max_rollouts:
        raise ClientError(422, f"{what} = {rollouts} is more than this server's {cfg.max_rollouts} rollouts per "
                               "request (--max-rollouts); split the request", "ValidationError")


def create_app(agent: Agent, token: str | None = None, inference: InferenceInterface | None = None,
               config: EnvServerConfig | None = None) -> FastAPI:
    """An app serving ``agent`` (see the module docstring).

    token: required bearer token (None: no authentication; only bind to loopback then).
    inference: the server's own backend, for requests that name none.
    config: limits and the inference allowlist (default: no client-chosen backends, default limits).
    """
    server = _EnvServer(agent, token, inference, config or EnvServerConfig())
    cfg = server.cfg
    app = FastAPI(title="megatron-rl environment server", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, max_bytes=cfg.limits.max_body_bytes, timeout_s=cfg.limits.body_timeout_s,
                       reject=lambda status, message: _error(status, message, "RequestTooLarge"
                                                             if status == 413 else "RequestTimeout" if status == 408
                                                             else "BadRequest"))
    _install_error_handlers(app)
    install_docs(app, server.check_token, app.title)
    _install_routes(app, server)
    return app


class _EnvServer:
    """What the routes share: the agent's configuration, one agent per data-parallel rank, the allowlisted
    client backends, and the request checks."""

    def __init__(self, agent: Agent, token: str | None, inference: InferenceInterface | None,
                 cfg: EnvServerConfig):
        self.agent, self.token, self.inference, self.cfg = agent, token, inference, cfg
        self.gen_limits = generation_limits_model(cfg.limits)
        self.config_dump = agent.model_dump()
        self.described = redact(agent.model_dump(mode="json"))  # what GET /agent shows: secrets never leave
        self.allowed = {_spec_key(s): s for s in cfg.allowed_inference}
        # bounded by the allowlist; built lazily, kept for the server's life (a backend may hold a loaded model)
        self.backends: LRUCache[str, InferenceInterface] = LRUCache(max(1, len(self.allowed)))
        self.agents: LRUCache[tuple[int, int], Agent] = LRUCache(cfg.max_agents, on_evict=self._evicted)

    def _evicted(self, key: tuple[int, int], _: Agent) -> None:
        logger.warning("dropping the agent of X-DP-Rank=%d X-DP-World-Size=%d (more than --max-agents=%d pairs); "
                       "if that rank comes back its prompt stream starts again", key[0], key[1], self.cfg.max_agents)

    def fresh_agent(self, rank: int, world: int) -> Agent:
        inst = type(self.agent).model_validate(self.config_dump)
        inst.bind_inference(self.inference)
        inst.set_data_parallel(rank, world)
        return inst

    def coordinates(self, request: Request) -> tuple[int, int]:
        try:
            rank = int(request.headers.get("x-dp-rank", "0"))
            world = int(request.headers.get("x-dp-world-size", "1"))
        except ValueError:
            raise ClientError(400, "X-DP-Rank and X-DP-World-Size must be integers") from None
        if not 1 <= world <= self.cfg.max_dp_world_size:
            raise ClientError(400, f"X-DP-World-Size={world} is outside 1..{self.cfg.max_dp_world_size} "
                                   "(--max-dp-world-size)")
        if not 0 <= rank < world:
            raise ClientError(400, f"X-DP-Rank={rank} is outside 0..X-DP-World-Size-1={world - 1}")
        return rank, world

    def agent_for(self, request: Request) -> Agent:
        key = self.coordinates(request)
        inst = self.agents.get(key)
        if inst is None:
            # A fresh instance per data-parallel rank: same configuration, independent prompt stream.
            inst = self.fresh_agent(*key)
            self.agents.put(key, inst)
        return inst

    def client_backend(self, spec: InferenceSpec) -> InferenceInterface:
        key = _spec_key(spec)
        if key not in self.allowed:
            hint = ("it matches none of the specs allowlisted with --allow-client-inference" if self.allowed else
                    "this server does not accept client-chosen inference backends")
            raise ClientError(403, f"request.inference refused: {hint}; omit it to generate with the server's "
                                   "own backend", "Forbidden")
        built = self.backends.get(key)
        if built is None:
            built = backend_class(spec.backend).for_untrusted_spec(**spec.kwargs)
            self.backends.put(key, built)
        return built

    def check_token(self, request: Request) -> None:
        if not authorized(request.headers.get("authorization"), self.token):
            raise ClientError(401, "missing or wrong bearer token (Authorization: Bearer <token>)", "Unauthorized")

    async def handle(self, request: Request) -> JSONResponse:
        """POST /request: validate, check the limits, pick the rank's agent and backend, serve."""
        data = await _json_body(request)
        try:
            req = AgentRequest.model_validate(data)
        except (ValidationError, ValueError) as e:
            raise ClientError(422, describe_validation_error(e)[0], "ValidationError") from None
        if type(req) is AgentRequest:
            raise ClientError(422, f"request needs a type_name, one of {sorted(AgentRequest.registered_types())}",
                              "ValidationError")
        check_request_limits(req, self.cfg, self.gen_limits, self.agent)
        target = self.agent_for(request)
        if req.inference is not None:
            req = req.model_copy(update={"inference_interface": self.client_backend(req.inference),
                                         "inference": None})
        elif self.inference is None:
            raise ClientError(400, "this server has no inference backend of its own (--inference-backend); send "
                                   "request.inference with a spec it allowlists")
        try:
            response = await target.handle(req)
        except NotImplementedError:
            raise ClientError(400, f"this environment does not support {type(req).__name__}") from None
        except ValidationError:
            raise  # something the agent built (from its backend's output) is invalid: a server fault, 500
        except ValueError as e:  # the agent cannot serve these values (e.g. fewer groups than weighted environments)
            raise ClientError(422, f"{type(req).__name__}: {describe_validation_error(e)[0]}",
                              "ValidationError") from None
        return JSONResponse(content=response.model_dump(mode="json"))

    async def set_state(self, request: Request) -> dict[str, str]:
        """POST /state: the rank's agent from a state_dict, loaded aside and swapped in."""
        key = self.coordinates(request)
        state = await _json_body(request)
        if not isinstance(state, dict):
            raise ClientError(422, "the state must be a JSON object (as GET /state returns)", "ValidationError")
        inst = self.fresh_agent(*key)  # loaded aside and swapped in: a bad state leaves the current one untouched
        try:
            inst.load_state_dict(state)
        except ValueError as e:  # a well-formed JSON object that is not a state: 422, as for /request
            raise ClientError(422, f"invalid agent state: {describe_validation_error(e)[0]}",
                              "ValidationError") from None
        except (TypeError, KeyError, AttributeError, ArithmeticError):
            raise ClientError(422, "invalid agent state (wrong keys or types; GET /state shows the expected "
                                   "shape)", "ValidationError") from None
        self.agents.put(key, inst)
        return {"status": "ok"}


async def _json_body(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
        raise ClientError(422, "the body is not valid JSON", "ValidationError") from None


def _install_error_handlers(app: FastAPI) -> None:
    """Client mistakes, HTTP errors and server faults, each as ``{"error": kind, "detail": message}``."""

    @app.exception_handler(ClientError)
    async def _client_error(request: Request, exc: ClientError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.kind)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = _error(exc.status_code, str(exc.detail), "NotFound" if exc.status_code == 404 else "BadRequest")
        response.headers.update(exc.headers or {})  # 405's Allow
        if exc.status_code == 405:  # starlette names the first route of the path only; GET and POST /state are two
            methods = {m for r in app.routes if getattr(r, "path", None) == request.url.path
                       for m in getattr(r, "methods", None) or ()}
            response.headers["Allow"] = ", ".join(sorted(methods))
        return response

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception) -> JSONResponse:
        error_id = uuid.uuid4().hex[:12]
        logger.error("error %s on %s %s", error_id, request.method, request.url.path, exc_info=exc)
        return _error(500, f"the environment failed on this request (error id {error_id}; see the server log)",
                      "InternalError")


def _install_routes(app: FastAPI, server: _EnvServer) -> None:
    """/health, /agent, /request and /state (GET and POST)."""
    agent, cfg = server.agent, server.cfg

    def check_token(request: Request) -> None:
        server.check_token(request)

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "agent": agent.type_name, "env_id": agent.name}

    @app.get("/agent", dependencies=[Depends(check_token)], responses=_responses(401))
    async def get_agent() -> dict[str, Any]:
        return server.described

    @app.post("/request", dependencies=[Depends(check_token)], responses=_responses(400, 401, 403, 413, 422),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": request_body_schema(cfg.limits, cfg.max_rollouts, cfg.max_ks,
                                                num_prompts_required=_validation_size(agent) is None)}}}})
    async def handle(request: Request) -> JSONResponse:
        return await server.handle(request)

    @app.get("/state", dependencies=[Depends(check_token)], responses=_responses(400, 401))
    async def get_state(request: Request) -> dict[str, Any]:
        return server.agent_for(request).state_dict()

    @app.post("/state", dependencies=[Depends(check_token)], responses=_responses(400, 401, 413, 422),
              openapi_extra={"requestBody": {"required": True, "content": {"application/json": {
                  "schema": {"type": "object", "description": "a state_dict from GET /state"}}}}})
    async def set_state(request: Request) -> dict[str, str]:
        return await server.set_state(request)


_STATUS_TEXT = {400: "client mistake (bad header, unsupported request)", 401: "missing or wrong token",
                403: "request.inference not allowlisted", 413: "request body too large",
                422: "body does not match the schema, exceeds a limit, asks for what this environment cannot serve, "
                     "or is not a valid agent state",
                500: "environment failure (see log)"}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    schema = {"type": "object", "properties": {"error": {"type": "string"}, "detail": {"type": "string"}}}
    return {c: {"description": _STATUS_TEXT[c], "content": {"application/json": {"schema": schema}}}
            for c in (*codes, 500)}


def _error(status: int, message: str, kind: str) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": kind, "detail": safe_message(message)})
