"""Thin process-group helpers. Each works in a single process without ``torch.distributed`` initialised.

Callers pass groups in explicitly; nothing here reads global configuration.
"""
from __future__ import annotations

import torch
import torch.distributed as dist


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank(group=None) -> int:
    return dist.get_rank(group) if is_initialized() else 0


def get_world_size(group=None) -> int:
    return dist.get_world_size(group) if is_initialized() else 1


def is_rank0() -> bool:
    return get_rank() == 0


def barrier(group=None) -> None:
    if is_initialized():
        dist.barrier(group=group)


def collective_device(group=None) -> torch.device | None:
    """Where ``group``'s collectives need their tensors: CUDA for NCCL (it has no CPU transport), else None
    (any device). The trainer's metric reductions build small CPU tensors; under NCCL they would fail with
    "No backend type associated with device type cpu"."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return None


def _on_collective_device(tensor: torch.Tensor, group, call) -> None:
    """``call(t)`` on ``tensor``, or on a copy on the device ``group``'s backend needs, copied back in place."""
    device = collective_device(group)
    if device is None or tensor.device.type == device.type:
        call(tensor)
        return
    staged = tensor.to(device)
    call(staged)
    tensor.copy_(staged)


def all_reduce_sum(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place sum over ``group`` (a CPU tensor under NCCL is staged through the GPU); returns ``tensor``."""
    if is_initialized() and get_world_size(group) > 1:
        _on_collective_device(tensor, group, lambda t: dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group))
    return tensor


def all_reduce_mean(tensor: torch.Tensor, group=None) -> torch.Tensor:
    """In-place mean over ``group``; returns ``tensor``."""
    n = get_world_size(group)
    all_reduce_sum(tensor, group)
    if n > 1:
        tensor /= n
    return tensor


def all_reduce_max(tensor: torch.Tensor, group=None) -> torch.Tensor:
    if is_initialized() and get_world_size(group) > 1:
        _on_collective_device(tensor, group, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group))
    return tensor


def broadcast(tensor: torch.Tensor, src_global_rank: int, group=None) -> torch.Tensor:
    """In-place broadcast from ``src_global_rank`` (a global rank that belongs to ``group``)."""
    if is_initialized() and get_world_size(group) > 1:
        _on_collective_device(tensor, group, lambda t: dist.broadcast(t, src=src_global_rank, group=group))
    return tensor


def broadcast_object(obj, src_global_rank: int = 0, group=None):
    """Broadcast a picklable object; returns the source's object on every rank."""
    if not is_initialized() or get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src_global_rank, group=group)
    return box[0]


def all_gather_object(obj, group=None) -> list:
    """Every rank's ``obj`` (picklable), in rank order of ``group``; ``[obj]`` without a process group."""
    if not is_initialized() or get_world_size(group) == 1:
        return [obj]
    out = [None] * get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object_from_last_pipeline_stage(obj):
    """The last pipeline stage's ``obj`` (picklable) on every stage of this rank's pipeline."""
    from megatron.core import parallel_state as ps

    if ps.get_pipeline_model_parallel_world_size() == 1:
        return obj
    return broadcast_object(obj, ps.get_pipeline_model_parallel_last_rank(),
                            group=ps.get_pipeline_model_parallel_group())
