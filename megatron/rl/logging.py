"""Rank-aware logging for multi-process runs.

:func:`setup_distributed_logging` installs one handler on the root logger whose lines carry the global rank,
and (by default) lets only rank 0 emit INFO/DEBUG records so a torchrun job prints each message once while
warnings and errors from every rank still show. The rank is read at emit time, so the handler can be
installed before ``torch.distributed`` is initialised.
"""
from __future__ import annotations

import logging
import os
import sys

from megatron.rl.base.dependency_warnings import is_known_notice, summarize_dependency_warnings

_HANDLER_FLAG = "_megatron_rl_handler"


def current_rank() -> int:
    """Global rank: torch.distributed's when initialised, else $RANK, else 0."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", "0"))


class RankFilter(logging.Filter):
    """Stamps ``record.rank``; drops records below ``min_level_other_ranks`` on ranks other than 0."""

    def __init__(self, min_level_other_ranks: int = logging.WARNING) -> None:
        super().__init__()
        self.min_level_other_ranks = min_level_other_ranks

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = current_rank()
        return record.rank == 0 or record.levelno >= self.min_level_other_ranks


# Libraries whose INFO output drowns the iteration lines: megatron-core (bucket layouts, scheduler settings) and
# the HTTP clients (one line per request: a remote environment or a served policy makes thousands).
QUIET_LOGGERS = ("megatron.core", "httpx", "httpx2", "httpcore")


class _CoreRootInfoFilter(logging.Filter):
    """Drops INFO records megatron-core logs on the root logger (its inference context announces every KV-cache
    allocation, once per rollout phase), which QUIET_LOGGERS cannot reach by name, and megatron-core's known
    notices about its own API."""

    def filter(self, record: logging.LogRecord) -> bool:
        if is_known_notice(record):  # megatron-core's notices about its own API (dependency_warnings)
            return False
        return not (record.name == "root" and record.levelno < logging.WARNING
                    and f"{os.sep}megatron{os.sep}core{os.sep}" in record.pathname)


def quiet_dependencies(level_no: int) -> None:
    """At INFO and above: the loggers of QUIET_LOGGERS at WARNING, and megatron-core's and torch's known start-up
    warnings said once in one line (:mod:`megatron.rl.base.dependency_warnings`). DEBUG shows everything."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if level_no > logging.DEBUG else logging.NOTSET)
    if level_no > logging.DEBUG:
        summarize_dependency_warnings()


def setup_distributed_logging(level: str | int = "INFO", all_ranks: bool = False, stream=None) -> logging.Handler:
    """Configure root logging once (idempotent: a second call updates level, filter and, when given or when the
    old one was closed, the stream).

    ``all_ranks``: let every rank log at ``level`` (default: ranks other than 0 only log warnings and errors).
    At INFO, megatron-core's and the HTTP clients' INFO chatter is held back and the known dependency warnings are
    one line (:func:`quiet_dependencies`; DEBUG shows everything). Returns the handler.
    """
    root = logging.getLogger()
    level_no = logging.getLevelName(level) if isinstance(level, str) else level
    handler = next((h for h in root.handlers if getattr(h, _HANDLER_FLAG, False)), None)
    if handler is None:
        handler = logging.StreamHandler(stream or sys.stdout)
        setattr(handler, _HANDLER_FLAG, True)
        handler.setFormatter(logging.Formatter("[%(asctime)s] [rank %(rank)s] %(levelname)s %(name)s: %(message)s",
                                               datefmt="%Y-%m-%d %H:%M:%S"))
        root.addHandler(handler)
    elif stream is not None or getattr(handler.stream, "closed", False):
        # set directly: setStream would flush the old stream, which may be closed (an earlier test's capture)
        handler.stream = stream or sys.stdout
    for f in list(handler.filters):
        handler.removeFilter(f)
    handler.addFilter(RankFilter(level_no if all_ranks else max(level_no, logging.WARNING)))
    if level_no > logging.DEBUG:
        handler.addFilter(_CoreRootInfoFilter())
    root.setLevel(level_no)
    quiet_dependencies(level_no)
    return handler


def setup_server_logging(level: str) -> None:
    """Logging of a server process: :func:`setup_distributed_logging` at ``level`` (the one handler a megatron
    backend's own set-up then reuses, so no line is printed twice). The servers also turn uvicorn's per-request
    access log off unless at debug."""
    setup_distributed_logging(level.upper())
