"""torchrun --nproc-per-node 2: train_rl's loop with MoE routing replay; rank 0 writes the metrics history and, per
iteration, how many training sequences lack a route at a token other than their last to ``$RESULT_DIR/result.json``.

Flags are train_rl.py's.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[5]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402


def main(argv: list[str]) -> None:
    from megatron.rl import rl_utils
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import destroy_megatron

    incomplete: list[int] = []
    original_gather = rl_utils.gather_sequences

    def checking_gather(groups, rl):
        sequences, stats, observed = original_gather(groups, rl)
        incomplete.append(sum(1 for s in sequences if s.routes is None or bool((s.routes[:-1] < 0).any())))
        return sequences, stats, observed

    rl_utils.gather_sequences = checking_gather
    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    result = run_rl(cfg, rl_config_from_args(cfg))
    if dist.get_rank() == 0:
        Path(os.environ["RESULT_DIR"], "result.json").write_text(json.dumps({"history": result.history,
                                                                              "incomplete": incomplete}))
    destroy_megatron()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1:])
