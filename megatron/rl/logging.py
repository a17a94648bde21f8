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


# Libraries whose INFO output (bucket layouts, scheduler settings) drowns the iteration lines.
QUIET_LOGGERS = ("megatron.core",)


def setup_distributed_logging(level: str | int = "INFO", all_ranks: bool = False, stream=None) -> logging.Handler:
    """Configure root logging once (idempotent: a second call updates level and filter).

    ``all_ranks``: let every rank log at ``level`` (default: ranks other than 0 only log warnings and errors).
    At INFO, megatron-core's own INFO chatter is held back to WARNING (DEBUG shows it). Returns the handler.
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
    for f in list(handler.filters):
        handler.removeFilter(f)
    handler.addFilter(RankFilter(level_no if all_ranks else max(level_no, logging.WARNING)))
    root.setLevel(level_no)
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING if level_no > logging.DEBUG else logging.NOTSET)
    return handler
