"""Process start-up: runtime (device/backend, CPU layer), process group, megatron-core parallel state, seeds.

``initialize_megatron(cfg)`` works under ``torchrun`` (reads RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT) and in a
plain ``python`` process (a one-rank group on a free loopback port).
"""
from __future__ import annotations

import logging
import os
import random
import socket
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from megatron.rl.logging import setup_distributed_logging
from megatron.rl.runtime import RuntimeInfo, cpu_patches, patches, setup_runtime, versions
from megatron.rl.training.config import ConfigError, TrainingConfig

log = logging.getLogger(__name__)

# megatron-core versions this training loop was tested against (CPU and GPU).
TESTED_MCORE_VERSIONS = versions.SUPPORTED
# Oldest release whose public API (GPTModel vp_stage, finalize_model_grads, dist_checkpointing) we rely on.
MIN_MCORE_VERSION = (0, 16, 0)
# The kinds of registered changes to megatron-core that a GPU machine uses (all but the CPU layer).
_GPU_KINDS = ("cuda", "on use", "per call", "subclass")


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split(".")[:3]:
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits or 0))
    return tuple(out)


def check_megatron_core_version(info: RuntimeInfo, version: str | None = None) -> str:
    """Refuse megatron-core versions we cannot run; warn for untested ones on GPU.

    Every change megatron-rl makes to megatron-core is an entry of :mod:`megatron.rl.runtime.patches` with the
    versions it was written for. On CPU the CPU layer patches internals that every step runs through, so only
    the versions it was written for are accepted (``cpu_patches.check_mcore_version`` raises). On GPU fewer
    entries apply (the paged-attention fallback without flash-attn, the reshard planner's expert names for an
    inference copy, the packed forward's per-call attention, and our subclasses of megatron-core's engine,
    context and dataset classes): versions below :data:`MIN_MCORE_VERSION` raise, other untested versions log a
    warning naming the entries not written for them.
    """
    if version is None:
        version = versions.installed_version()
    if info.cpu_layer_active:
        return cpu_patches.check_mcore_version(version)
    if _version_tuple(version) < MIN_MCORE_VERSION:
        raise cpu_patches.UnsupportedMegatronCoreVersion(
            f"megatron-core {version} is older than {'.'.join(map(str, MIN_MCORE_VERSION))}, the oldest release "
            f"megatron-rl's training loop supports; pip install megatron-core=={TESTED_MCORE_VERSIONS[-1]}.")
    if not versions.release(version):
        untested = [p.name for p in patches.not_written_for(version, _GPU_KINDS)]
        log.warning("megatron-core %s has not been tested with megatron-rl (tested: %s); changes to megatron-core "
                    "not written for it (megatron.rl.runtime.patches): %s", version,
                    ", ".join(TESTED_MCORE_VERSIONS), "; ".join(untested) or "none")
    return version


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_process_group(backend: str, timeout_minutes: int = 30) -> None:
    """Initialise torch.distributed from torchrun's env, or as a one-process group when run with plain python.

    The one-process case uses a free loopback port and leaves ``os.environ`` untouched (so a later torchrun
    launched from this process does not inherit a fake RANK/WORLD_SIZE).
    """
    if dist.is_initialized():
        return
    kwargs = dict(backend=backend, timeout=timedelta(minutes=timeout_minutes))
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        kwargs.update(rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    else:
        kwargs.update(rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{_free_port()}")
    if backend == "nccl":
        kwargs["device_id"] = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(**kwargs)


def set_random_seeds(seed: int) -> int:
    """Seed python, numpy, torch and megatron's model-parallel RNG tracker. Returns the per-rank seed.

    As in Megatron-LM, each pipeline stage offsets the seed by 100 * stage so stages do not draw the same
    numbers; tensor-parallel ranks share the default seed (megatron's tracker gives TP regions their own).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    return seed


def initialize_megatron(cfg: TrainingConfig) -> RuntimeInfo:
    """Runtime, process group, parallel state and seeds for ``cfg``. Idempotent for the process group.

    Raises :class:`ConfigError` when the launched world size differs from the one ``cfg`` was validated for.
    """
    from megatron.core import parallel_state as ps

    setup_distributed_logging(cfg.logging.log_level)
    info = setup_runtime()
    check_megatron_core_version(info)
    if info.is_cuda:
        torch.cuda.set_device(info.device)
    init_process_group(info.backend)
    world = dist.get_world_size()
    if world != cfg.parallel.world_size:
        raise ConfigError(f"the config was validated for world size {cfg.parallel.world_size} but {world} "
                          f"processes were launched; parse the flags after setting WORLD_SIZE (torchrun does).")
    p = cfg.parallel
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        expert_tensor_parallel_size=p.expert_tensor_parallel_size,
    )
    set_random_seeds(cfg.train.seed)
    log.info("initialised megatron: world=%d TP=%d PP=%d VPP=%s EP=%d DP=%d device=%s backend=%s", world,
             p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
             p.expert_model_parallel_size, p.data_parallel_size, info.device, info.backend)
    return info


def destroy_megatron() -> None:
    """Tear down parallel state and the process group (tests and scripts that initialise more than once)."""
    from megatron.core import parallel_state as ps

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()
