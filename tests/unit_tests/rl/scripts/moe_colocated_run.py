"""torchrun --nproc-per-node 2: train_rl's loop at the training layout (default in-process backend); each rank
writes what it collected and trained on to ``$RESULT_DIR/rank<R>.json``.

Flags are train_rl.py's. Per iteration: this rank's rollout groups as collected (problem ids, rollouts per
group, failed rollouts) and the global training sequences after the data-parallel gather (count, rollouts,
failures, a digest of their tokens), so a test can count every requested rollout and compare the ranks' data.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv: list[str]) -> None:
    from megatron.rl import rl_utils
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.rollout.source import SynchronousRollouts
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron

    collected: list[dict] = []
    trained: list[dict] = []
    original_collect, original_gather = SynchronousRollouts.collect, rl_utils.gather_sequences

    def recording_collect(source, iteration):
        groups = original_collect(source, iteration)
        collected.append({"iteration": iteration,
                          "problems": [g.problem_id for g in groups],
                          "rollouts": [len(g.rollouts) for g in groups],
                          "failed": sum(1 for g in groups for r in g.rollouts if r.status == "failed")})
        return groups

    def recording_gather(groups, rl):
        sequences, stats, observed = original_gather(groups, rl)
        tokens = json.dumps([s.token_ids for s in sequences]).encode()
        trained.append({"sequences": len(sequences), "rollouts": stats.rollouts, "failed": stats.failed_rollouts,
                        "groups": stats.groups, "digest": hashlib.sha256(tokens).hexdigest()[:16]})
        return sequences, stats, observed

    SynchronousRollouts.collect, rl_utils.gather_sequences = recording_collect, recording_gather
    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    result = run_rl(cfg, rl_config_from_args(cfg))
    out = {"rank": dist.get_rank(), "history": result.history, "evals": result.evals, "collected": collected,
           "trained": trained}
    Path(os.environ["RESULT_DIR"], f"rank{dist.get_rank()}.json").write_text(json.dumps(out))
    destroy_megatron()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
