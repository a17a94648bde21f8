"""Bad input at an entry point (``train_rl.py``, ``pretrain_gpt.py``): one clear line, not a buried traceback.

Under torchrun a failing worker's message is followed by torchrun's own failure report, which says only
"To enable traceback see ..." unless the worker wrote an error file. :func:`report_user_error` prints the
error as one line on stderr (global rank 0, or every rank outside torchrun) and records it in torchrun's
error file (``$TORCHELASTIC_ERROR_FILE``), so the report's root cause names it too.
"""
from __future__ import annotations

import json
import os
import sys
import time

from megatron.rl.base.errors import UserError
from megatron.rl.logging import current_rank, setup_distributed_logging
from megatron.rl.training.launcher_watch import watch_launcher

__all__ = ["report_user_error", "run_cli"]

_GRACE_S = 2.0


def _rank() -> int:
    return current_rank()


def report_user_error(program: str, error: BaseException, stream=None) -> str:
    """Print ``<program>: error: <Type>: <message>`` (rank 0 only) and write torchrun's error file; returns
    the line."""
    line = f"{program}: error: {type(error).__name__}: {error}"
    if _rank() == 0:
        print(line, file=stream or sys.stderr, flush=True)
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        # The format torch.distributed.elastic's ErrorHandler writes; torchrun's report shows "py_callstack".
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
        try:
            with open(error_file, "w") as f:
                json.dump(data, f)
        except OSError:
            pass  # the report then falls back to its generic text; the line above was printed already
    return line


def _log_level(argv) -> str:
    """The value of ``--log-level`` in ``argv`` (either spelling), else INFO; an invalid one is left to the parser."""
    argv = [str(a) for a in argv]
    for i, arg in enumerate(argv):
        value = arg.split("=", 1)[1] if arg.startswith("--log-level=") else (
            argv[i + 1] if arg == "--log-level" and i + 1 < len(argv) else None)
        if value in ("DEBUG", "INFO", "WARNING", "ERROR"):
            return value
    return "INFO"


def run_cli(program: str, main, argv=None) -> int:
    """The ``main()`` of ``pretrain_gpt.py`` and ``train_rl.py``: ``main(argv)``, then megatron torn down (even
    on error); user errors reported by :func:`report_user_error` as one line, with exit status 2.

    Logging is set up first, at the ``--log-level`` the command line gives (INFO by default): whatever loads
    megatron-core first (the flags' checks, ``--use-checkpoint-args`` reading a checkpoint, the trainer), its
    import-time warnings about missing kernels become one INFO line, and what the flags' parsing logs is shown.
    ``main`` sets the level again from the parsed flags."""
    setup_distributed_logging(_log_level(sys.argv[1:] if argv is None else argv))
    from megatron.rl.training.initialize import destroy_megatron  # torch: the CLI's first steps stay torch-free

    watch_launcher()  # a torchrun worker stops when torchrun is killed, instead of training on unsupervised
    try:
        try:
            return main(argv)
        finally:
            destroy_megatron()
    except Exception as e:  # noqa: BLE001 - anything but a user error is re-raised with its traceback
        if not isinstance(e, UserError):  # flags, files, checkpoints, tokenizer, megatron-core version
            raise
        report_user_error(program, e)
        if _rank() != 0:
            # Usually every rank hits the same error; torchrun kills the others as soon as one exits, so the
            # other ranks give rank 0 a moment to print its line first.
            time.sleep(_GRACE_S)
        return 2
