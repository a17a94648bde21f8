"""torchrun worker for test_parallel_utils: each rank reduces its own values; rank 0 writes the results."""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 5)))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from megatron.rl import parallel_utils as pu  # noqa: E402

if __name__ == "__main__":
    dist.init_process_group("gloo")
    r = dist.get_rank()
    res = {
        "sum": pu.all_reduce_sum(torch.tensor([r + 1.0, 10.0 * (r + 1)])).tolist(),
        "mean": pu.all_reduce_mean(torch.tensor([r + 1.0, 10.0 * (r + 1)])).tolist(),
        "max": pu.all_reduce_max(torch.tensor([r + 1.0])).tolist(),
        "broadcast": pu.broadcast(torch.tensor([r + 1.0]), src_global_rank=1).tolist(),
        "object": pu.broadcast_object({"from": r}, src_global_rank=1),
    }
    pu.barrier()
    if r == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(res, f)
    dist.destroy_process_group()
