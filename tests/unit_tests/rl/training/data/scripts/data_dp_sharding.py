"""torchrun script: every DP rank builds the data iterator (collective megatron-core build, shared index
cache), reads its own micro-batches, and rank 0 checks they are exactly its share of the DP=1 stream. Args: JSONL_PATH CACHE_DIR."""
import sys

import torch
import torch.distributed as dist

from megatron.rl.runtime import setup_runtime
from megatron.rl.training.data import build_pretraining_data
from megatron.rl.training.tokenizer import ByteLevelTokenizer


class Cfg:
    mock_data, split, num_workers = False, "100,0,0", 0

    def __init__(self, path, cache):
        self.data_path, self.data_cache_path = [path], cache


def main():
    setup_runtime()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg, tok = Cfg(sys.argv[1], sys.argv[2]), ByteLevelTokenizer()
    it = build_pretraining_data(cfg, tok, 16, 2, 8, rank, world, seed=11, num_samples=64)
    # Building is collective (megatron-core's builder has barriers), so every rank builds the reference too.
    ref = build_pretraining_data(cfg, tok, 16, 2 * world, 8, 0, 1, seed=11, num_samples=64)
    mine = torch.cat([next(it)["tokens"] for _ in range(6)])
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine)
    if rank == 0:
        single = [next(ref)["tokens"] for _ in range(6)]
        # DP=1 step k with micro-batch 2*world holds exactly rank r's step-k micro-batch in rows [2r, 2r+2):
        # the ranks' samples are disjoint and together cover the single-rank stream, in Megatron's order.
        for r in range(world):
            expected = torch.cat([batch[2 * r: 2 * r + 2] for batch in single])
            assert torch.equal(gathered[r], expected), f"rank {r} read the wrong samples"
        print("DP_SHARDING_OK")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
