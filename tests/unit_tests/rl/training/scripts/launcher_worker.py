"""A torchrun worker that goes through the entry points' run_cli, writes its PID, then works for ever."""
import os
import sys
import time
from pathlib import Path

from megatron.rl.training.cli_errors import run_cli


def _work(argv) -> int:
    Path(argv[0], f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    time.sleep(600)
    return 0


if __name__ == "__main__":
    sys.exit(run_cli("launcher_worker.py", _work, sys.argv[1:]))
