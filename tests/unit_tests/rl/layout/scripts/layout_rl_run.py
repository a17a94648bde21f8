"""torchrun --nproc-per-node 2: train_rl's loop with a separate inference layout; prints one JSON line per rank.

Flags are train_rl.py's. The inference copy's weights are summarised (a float64 checksum over this rank's
parameters) before and after each refit, so the test can assert the refits really changed them. Also
reported: a digest of each iteration's rollout tokens (so a test can tell sampling from training apart when
two runs disagree) and, for MoE, the ranks of the copy's token-dispatcher groups.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def _checksum(chunks) -> float:
    return float(sum(p.detach().double().abs().sum() for c in chunks for p in c.parameters()))


def _dispatcher_groups(chunks) -> list[dict[str, list[int]]]:
    """Global ranks of the process groups every MoE token dispatcher of ``chunks`` communicates over."""
    out = []
    for chunk in chunks:
        for module in chunk.modules():
            d = getattr(module, "token_dispatcher", None)
            if d is not None:
                out.append({name: dist.get_process_group_ranks(getattr(d, name))
                            for name in ("ep_group", "tp_group", "tp_ep_group")})
    return out


def main(argv: list[str]) -> None:
    from megatron.rl import rl_utils
    from megatron.rl.layout import refit
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron

    checksums: list[tuple[float, float]] = []
    copy_groups: list = []
    token_digests: list[str] = []
    original = refit.InferenceCopy.refit
    original_gather = rl_utils.gather_sequences

    def recording_refit(self):
        if not copy_groups:
            copy_groups.append(_dispatcher_groups(self.model))
        before = _checksum(self.model)
        seconds = original(self)
        checksums.append((before, _checksum(self.model)))
        return seconds

    def recording_gather(groups, rl):
        sequences, stats, observed = original_gather(groups, rl)
        tokens = json.dumps([s.token_ids for s in sequences]).encode()
        token_digests.append(hashlib.sha256(tokens).hexdigest()[:16])
        return sequences, stats, observed

    refit.InferenceCopy.refit = recording_refit
    rl_utils.gather_sequences = recording_gather
    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    rl = rl_config_from_args(cfg)
    result = run_rl(cfg, rl)
    out = {"rank": dist.get_rank(), "history": result.history, "evals": result.evals, "checksums": checksums,
           "copy_dispatcher_groups": copy_groups[0] if copy_groups else [], "token_digests": token_digests}
    # one file per rank: printed, the two ranks' long result lines interleaved on the shared stdout pipe
    Path(os.environ["LAYOUT_RESULT_DIR"], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_megatron()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
