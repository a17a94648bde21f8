"""initialize_megatron in one process; megatron-core version policy; seeds."""
from __future__ import annotations

import logging
import os
import random

import numpy as np
import pytest
import torch

from megatron.rl.runtime import RuntimeInfo
from megatron.rl.runtime.cpu_patches import UnsupportedMegatronCoreVersion
from megatron.rl.training.config import ConfigError, parse_args
from megatron.rl.training.initialize import check_megatron_core_version, destroy_megatron, initialize_megatron
from tests.conftest import rerun_in_fresh_process

FLAGS = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--train-iters", "1",
         "--lr", "1e-3", "--seed", "42"]
GPU = RuntimeInfo(device=torch.device("cuda", 0), backend="nccl", cpu_layer_active=False)
CPU = RuntimeInfo(device=torch.device("cpu"), backend="gloo", cpu_layer_active=True)


def test_version_policy(caplog, monkeypatch):
    monkeypatch.delenv("MEGATRON_RL_ALLOW_UNTESTED_MCORE", raising=False)
    for supported in ("0.16.1", "0.19.0", "0.19.2"):
        assert check_megatron_core_version(CPU, supported) == supported
    with pytest.raises(UnsupportedMegatronCoreVersion, match="0.17.0"):
        check_megatron_core_version(CPU, "0.17.0")  # the CPU layer patches internals: supported releases only
    with pytest.raises(UnsupportedMegatronCoreVersion, match="older than"):
        check_megatron_core_version(GPU, "0.15.2")
    with caplog.at_level(logging.WARNING):
        assert check_megatron_core_version(GPU, "0.19.2") == "0.19.2"
    assert "has not been tested" not in caplog.text
    with caplog.at_level(logging.WARNING):
        assert check_megatron_core_version(GPU, "0.20.0") == "0.20.0"  # newer on GPU: warn, run
    assert "has not been tested" in caplog.text


def test_single_process_init_without_torchrun_env(monkeypatch, request):
    from megatron.core import parallel_state as ps
    import torch.distributed as dist

    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK"):
        monkeypatch.delenv(k, raising=False)
    if dist.is_initialized():  # an earlier test made a process group in this pytest process
        return rerun_in_fresh_process(request)
    cfg = parse_args(FLAGS, world_size=1)
    try:
        info = initialize_megatron(cfg)
        assert info.backend == "gloo" and dist.get_world_size() == 1
        assert ps.get_tensor_model_parallel_world_size() == 1 and ps.get_data_parallel_world_size() == 1
        assert "RANK" not in os.environ  # no fake torchrun env left behind
        a = (random.random(), np.random.rand(), torch.rand(1).item())
        initialize_megatron(cfg)  # re-initialising reseeds: same draws
        assert (random.random(), np.random.rand(), torch.rand(1).item()) == a
        with pytest.raises(ConfigError, match="validated for world size 2"):
            initialize_megatron(parse_args(FLAGS, world_size=2))
    finally:
        destroy_megatron()
