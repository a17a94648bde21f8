"""Per-rank RNG state for checkpoints: capture, restore, and the parallel layout it belongs to.

Each rank's generators differ (megatron seeds the tensor-parallel tracker per TP rank, data shuffles
may differ per DP rank), so the state is saved as one ``ShardedObject`` entry per global rank. It is
only meaningful under the same parallel layout; when the layout changes on load it is dropped with a
log line and the generators keep the values the fresh run seeded them with.
"""
from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

RNG_KEY = "rng_state"


def parallel_layout() -> dict[str, int]:
    """The parallel layout of this run (world size and each parallel dimension); json-able."""
    from megatron.core import parallel_state as ps

    return {
        "world_size": torch.distributed.get_world_size(),
        "tp": ps.get_tensor_model_parallel_world_size(),
        "pp": ps.get_pipeline_model_parallel_world_size(),
        "vpp": ps.get_virtual_pipeline_model_parallel_world_size() or 0,
        "cp": ps.get_context_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "dp": ps.get_data_parallel_world_size(),
    }


def capture_rng_state(include_cuda: bool) -> dict[str, Any]:
    """This rank's generator states: python, numpy, torch CPU, CUDA (when ``include_cuda``) and
    megatron's ``CudaRNGStatesTracker`` (which on CPU tracks CPU generator states)."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch_cpu": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in get_cuda_rng_tracker().get_states().items()},
    }
    if include_cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng_state(state: dict[str, Any], include_cuda: bool) -> None:
    """Inverse of :func:`capture_rng_state`. A saved CUDA state is ignored on a CPU run and vice versa."""
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if include_cuda and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"])
    if state.get("tracker"):
        get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["tracker"].items()})


def rng_sharded_object(state: dict[str, Any] | None):
    """The ShardedObject holding this rank's RNG state: global shape (world_size,), offset (rank,).

    ``state=None`` builds the request used for loading.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    return ShardedObject(RNG_KEY, state, (world,), (rank,), replica_id=0)
