"""Start the OpenAI-compatible inference server on a registered backend.

    python -m megatron.rl.server.inference --backend fake --port 8000
    python -m megatron.rl.server.inference --backend megatron --port 8000 -- --load /ckpts/run1

Flags after ``--`` go to the backend's ``from_cli(argv)``. Binds 127.0.0.1 by default. ``--api-key`` (or
``MEGATRON_RL_INFERENCE_API_KEY``) makes every route but ``/health`` require ``Authorization: Bearer <key>``;
``--limit KEY=VALUE`` bounds one request's work (:class:`megatron.rl.inference.validation.RequestLimits`).
More examples: docs/server.md.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from megatron.rl.inference.api import (InferenceError, InferenceInterface, backend_class,
                                       build_inference_interface)
from megatron.rl.base.errors import UserError
from megatron.rl.logging import setup_server_logging
from megatron.rl.server.guard import LOOPBACK_HOSTS, add_limit_flag, limits_from_flags
from megatron.rl.server.inference.app import ServerConfig, create_app

logger = logging.getLogger("megatron.rl.server.inference")

API_KEY_ENV = "MEGATRON_RL_INFERENCE_API_KEY"


_EXAMPLES = """examples:
  # a checkpoint of train_rl.py / pretrain_gpt.py: its flags follow '--' (the checkpoint carries its model flags)
  python -m megatron.rl.server.inference --backend megatron --port 8000 -- --load CKPT
  # a Hugging Face directory (e.g. written by tools/convert_megatron_to_hf.py)
  python -m megatron.rl.server.inference --backend huggingface --backend-arg model_path=DIR
  # requests name the model '--model-name' (default megatron-rl)"""


def _parse_backend_arg(text: str) -> tuple[str, object]:
    if "=" not in text:
        raise argparse.ArgumentTypeError(f"--backend-arg {text!r}: expected KEY=VALUE (VALUE is JSON or a string)")
    key, value = text.split("=", 1)
    try:
        return key, json.loads(value)
    except json.JSONDecodeError:
        return key, value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron.rl.server.inference",
                                description="OpenAI-compatible inference server over a megatron-rl backend.",
                                epilog=_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", required=True, help="registered backend name (e.g. megatron, huggingface, fake)")
    p.add_argument("--backend-arg", action="append", type=_parse_backend_arg, default=[], metavar="KEY=VALUE",
                   help="constructor argument for the backend (repeatable; VALUE parsed as JSON when it is JSON)")
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: loopback only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--model-name", default="megatron-rl", help="model id reported by /v1/models and expected "
                                                                "in requests' `model` field")
    p.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                   help=f"require this bearer token on /v1/* (default: ${API_KEY_ENV} if set)")
    p.add_argument("--batch-window-ms", type=float, default=5.0,
                   help="collect requests arriving within this window into one backend call")
    p.add_argument("--max-batch-requests", type=int, default=256, help="most requests per backend call")
    p.add_argument("--default-max-tokens", type=int, default=256, help="max_tokens when a request gives none")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    # hostile inputs: per-request limits
    add_limit_flag(p)
    return p


def build_backend(name: str, backend_args: dict, extra_argv: list[str]) -> InferenceInterface:
    if extra_argv:
        if backend_args:
            raise SystemExit("--backend-arg and backend flags after '--' cannot be combined; use one or the other")
        return backend_class(name).from_cli(extra_argv)
    if backend_class(name).serves_checkpoint and not backend_args:  # its constructor takes a live model
        raise InferenceError(f"the {name} backend serves a checkpoint: add `-- --load CKPT_DIR` after the server "
                             "flags (older checkpoints also need their model flags there)")
    return build_inference_interface(name, **backend_args)


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1:]
    parser = build_parser()
    args = parser.parse_args(argv)
    limits = limits_from_flags(args.limit, parser)
    setup_server_logging(args.log_level)
    if args.host not in LOOPBACK_HOSTS and not args.api_key:
        logger.warning("binding %s without --api-key: anyone who can reach this port can use the model", args.host)
    try:
        backend = build_backend(args.backend, dict(args.backend_arg), extra)
    except (UserError, InferenceError) as e:  # a bad checkpoint, flag or file: one line, as train_rl.py says it
        print(f"error: --backend {args.backend}: {e}", file=sys.stderr)
        sys.exit(2)
    except (TypeError, ValueError) as e:  # bad name or constructor args: say so, no traceback
        build_parser().error(f"--backend {args.backend}: {e}")
    try:
        cfg = ServerConfig(model_name=args.model_name, api_key=args.api_key, batch_window_s=args.batch_window_ms / 1000,
                           max_batch_requests=args.max_batch_requests, default_max_tokens=args.default_max_tokens,
                           limits=limits)
    except ValueError as e:
        parser.error(f"--default-max-tokens: {e}")
    logger.info("serving backend %r as model %r on http://%s:%d", args.backend, args.model_name, args.host, args.port)
    uvicorn.run(create_app(backend, cfg), host=args.host, port=args.port, log_level=args.log_level,
                timeout_graceful_shutdown=5, access_log=args.log_level == "debug",
                limit_concurrency=args.max_connections)


if __name__ == "__main__":
    main()
