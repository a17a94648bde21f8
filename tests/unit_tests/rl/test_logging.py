"""Rank-aware logging: rank stamped on each line, INFO only from rank 0, warnings from all ranks."""
from __future__ import annotations

import io
import logging

import pytest

from megatron.rl import logging as rl_logging


@pytest.fixture
def handler_stream():
    stream = io.StringIO()
    root = logging.getLogger()
    old_level, old_handlers = root.level, list(root.handlers)
    for h in old_handlers:  # start without our handler so a fresh one writes to `stream`
        if getattr(h, rl_logging._HANDLER_FLAG, False):
            root.removeHandler(h)
    yield stream
    for h in list(root.handlers):
        if getattr(h, rl_logging._HANDLER_FLAG, False):
            root.removeHandler(h)
    for h in old_handlers:
        if h not in root.handlers:
            root.addHandler(h)
    root.setLevel(old_level)


def test_rank0_logs_info_with_rank_prefix(handler_stream, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    rl_logging.setup_distributed_logging("INFO", stream=handler_stream)
    logging.getLogger("megatron.rl.test").info("hello %d", 7)
    assert "[rank 0] INFO megatron.rl.test: hello 7" in handler_stream.getvalue()


def test_other_ranks_only_warn_unless_all_ranks(handler_stream, monkeypatch):
    # Patch the rank itself: an earlier test in this process may have initialised torch.distributed
    # (rank 0), which current_rank() prefers over $RANK.
    monkeypatch.setattr(rl_logging, "current_rank", lambda: 3)
    rl_logging.setup_distributed_logging("INFO", stream=handler_stream)
    log = logging.getLogger("megatron.rl.test")
    log.info("quiet")
    log.warning("loud")
    out = handler_stream.getvalue()
    assert "quiet" not in out and "[rank 3] WARNING megatron.rl.test: loud" in out
    rl_logging.setup_distributed_logging("INFO", all_ranks=True)  # idempotent: same handler, new filter
    log.info("now heard")
    assert "now heard" in handler_stream.getvalue()
    assert sum(getattr(h, rl_logging._HANDLER_FLAG, False) for h in logging.getLogger().handlers) == 1


def test_megatron_core_info_is_quiet_at_info(handler_stream, monkeypatch):
    monkeypatch.setenv("RANK", "0")
    rl_logging.setup_distributed_logging("INFO", stream=handler_stream)
    logging.getLogger("megatron.core.distributed").info("bucket chatter")
    assert "bucket chatter" not in handler_stream.getvalue()
    rl_logging.setup_distributed_logging("DEBUG")
    logging.getLogger("megatron.core.distributed").info("bucket chatter")
    assert "bucket chatter" in handler_stream.getvalue()
    rl_logging.setup_distributed_logging("INFO")
