"""Device and process-group backend choice: CUDA + NCCL when a GPU is visible, else CPU + gloo."""
from __future__ import annotations

import dataclasses
import os

import torch


@dataclasses.dataclass(frozen=True)
class RuntimeInfo:
    """What this process runs on. ``device`` is the torch device tensors should live on."""

    device: torch.device
    backend: str  # torch.distributed backend: "nccl" or "gloo"
    cpu_layer_active: bool  # True when the CPU compatibility layer for megatron-core is installed

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def cuda_usable() -> bool:
    """True when CUDA is present and not disabled with MEGATRON_RL_FORCE_CPU=1."""
    if os.environ.get("MEGATRON_RL_FORCE_CPU", "0") == "1":
        return False
    return torch.cuda.is_available()


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def choose_device() -> torch.device:
    if cuda_usable():
        return torch.device("cuda", local_rank() % max(torch.cuda.device_count(), 1))
    return torch.device("cpu")


def choose_backend() -> str:
    return "nccl" if cuda_usable() else "gloo"
