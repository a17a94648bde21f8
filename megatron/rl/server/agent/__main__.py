r"""``python -m megatron.rl.server.agent``: serve an environment over HTTP (binds 127.0.0.1 by default).

    python -m megatron.rl.server.agent --env-config ENV.yaml --port 8100 \
        --inference-backend openai --inference-kwargs '{"base_url": "http://127.0.0.1:8000/v1"}'
    MEGATRON_RL_AGENT_TOKEN=secret python -m megatron.rl.server.agent --agent-type countdown --port 8100

Requests never choose the inference backend unless its spec is allowlisted (--allow-client-inference).
More examples: docs/server.md.
"""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config, resolve_agent_type
from megatron.rl.inference.api import build_inference_interface
from megatron.rl.logging import setup_server_logging
from megatron.rl.server.guard import LOOPBACK_HOSTS, add_limit_flag, limits_from_flags

logger = logging.getLogger("megatron.rl.server.agent")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.rl.server.agent", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--env-config", help="YAML environment config (served as one weighted multi-task agent)")
    src.add_argument("--agent-type", help="a registered agent type (or module:Class with --allow-imports)")
    p.add_argument("--agent-args", default="{}", help="JSON object of the agent's fields (with --agent-type)")
    p.add_argument("--imports", default="", help="comma-separated modules to import first (needs --allow-imports)")
    p.add_argument("--allow-imports", action="store_true", help="allow importing user modules / module:Class types")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default loopback; use a token otherwise)")
    p.add_argument("--port", type=int, default=8100)
    p.add_argument("--token-env", default="MEGATRON_RL_AGENT_TOKEN",
                   help="environment variable holding the bearer token (unset: no authentication)")
    p.add_argument("--inference-backend", default=None, help="default inference backend name (e.g. openai)")
    p.add_argument("--inference-kwargs", default="{}", help="JSON keyword arguments of the inference backend")
    p.add_argument("--seed", type=int, default=None, help="override the environments' seeds")
    p.add_argument("--log-level", default="info")
    # hostile inputs: client-chosen inference and per-request limits
    p.add_argument("--allow-client-inference", default="[]", metavar="JSON",
                   help="JSON list of {backend, kwargs} specs a request's `inference` may name (exact match); "
                        "default none: requests always use the server's own backend")
    p.add_argument("--max-rollouts", type=int, default=8192, help="most rollouts one request may ask for")
    p.add_argument("--max-dp-world-size", type=int, default=1024, help="largest X-DP-World-Size accepted")
    p.add_argument("--max-agents", type=int, default=256,
                   help="agent instances kept, one per (X-DP-Rank, X-DP-World-Size) (least recently used dropped)")
    add_limit_flag(p)
    return p


def _json_arg(parser: argparse.ArgumentParser, flag: str, value: str) -> dict:
    try:
        out = json.loads(value)
    except json.JSONDecodeError as e:
        parser.error(f"{flag}: not valid JSON ({e.msg} at column {e.colno}): {value!r}")
    if not isinstance(out, dict):
        parser.error(f"{flag}: expected a JSON object, got {value!r}")
    return out


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    setup_server_logging(args.log_level)

    import uvicorn

    from megatron.rl.server.agent.app import EnvServerConfig, create_app  # fastapi: after the flags are parsed

    modules = [m for m in args.imports.split(",") if m]
    if modules and not args.allow_imports:
        parser.error("--imports needs --allow-imports")
    for m in modules:
        importlib.import_module(m)
    try:
        if args.env_config:
            agent = build_agent_from_config(args.env_config, allow_imports=args.allow_imports, seed=args.seed)
        else:
            cls = resolve_agent_type(args.agent_type, args.allow_imports, "--agent-type")
            agent = cls(**_json_arg(parser, "--agent-args", args.agent_args))
            if args.seed is not None:
                agent.seed = args.seed
    except (EnvConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    inference = None
    if args.inference_backend:
        inference = build_inference_interface(args.inference_backend,
                                              **_json_arg(parser, "--inference-kwargs", args.inference_kwargs))
    try:
        allowed = json.loads(args.allow_client_inference)
        if not isinstance(allowed, list):
            raise ValueError("expected a JSON list of {backend, kwargs} objects")
        cfg = EnvServerConfig(allowed_inference=allowed, limits=limits_from_flags(args.limit, parser),
                              max_rollouts=args.max_rollouts, max_dp_world_size=args.max_dp_world_size,
                              max_agents=args.max_agents)
    except ValueError as e:  # JSON and pydantic errors are ValueErrors
        parser.error(f"--allow-client-inference / --max-*: {e}")
    token = os.environ.get(args.token_env) or None
    if token is None and args.host not in LOOPBACK_HOSTS:
        logger.warning("serving on %s without a token: anyone who can reach it can use it (set $%s)",
                       args.host, args.token_env)
    app = create_app(agent, token=token, inference=inference, config=cfg)
    logger.info("serving agent %r (%s) on http://%s:%d", agent.name, agent.type_name, args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                access_log=args.log_level == "debug", limit_concurrency=args.max_connections)


if __name__ == "__main__":
    main()
