"""torchrun --nproc-per-node 2: train_rl's loop with a separate inference layout; prints one JSON line per rank.

Flags are train_rl.py's. The inference copy's weights are summarised (a float64 checksum over this rank's
parameters) before and after each refit, so the test can assert the refits really changed them.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _checksum(chunks) -> float:
    return float(sum(p.detach().double().abs().sum() for c in chunks for p in c.parameters()))


def main(argv: list[str]) -> None:
    from megatron.rl import refit
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron

    checksums: list[tuple[float, float]] = []
    original = refit.InferenceCopy.refit

    def recording_refit(self):
        before = _checksum(self.model)
        seconds = original(self)
        checksums.append((before, _checksum(self.model)))
        return seconds

    refit.InferenceCopy.refit = recording_refit
    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    rl = rl_config_from_args(cfg)
    result = run_rl(cfg, rl)
    out = {"rank": dist.get_rank(), "history": result.history, "evals": result.evals, "checksums": checksums}
    print("LAYOUT_RESULT " + json.dumps(out), flush=True)
    destroy_megatron()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
