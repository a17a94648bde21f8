"""parallel_utils without a process group (single process) and over a 2-process gloo group."""
from __future__ import annotations

import json

import pytest
import torch

from megatron.rl import parallel_utils as pu
from tests.conftest import REPO_ROOT, rerun_in_fresh_process, run_torchrun


def test_single_process_fallbacks(request):
    if pu.is_initialized():  # an earlier test made a process group in this pytest process
        return rerun_in_fresh_process(request)
    t = torch.tensor([2.0, 4.0])
    assert pu.all_reduce_mean(t) is t and t.tolist() == [2.0, 4.0]
    assert pu.all_reduce_sum(t).tolist() == [2.0, 4.0]
    assert pu.broadcast_object({"a": 1}) == {"a": 1}
    assert (pu.get_rank(), pu.get_world_size(), pu.is_rank0()) == (0, 1, True)
    pu.barrier()


@pytest.mark.multiprocess
def test_two_process_reductions(tmp_path):
    out = tmp_path / "out.json"
    run_torchrun(REPO_ROOT / "tests/unit_tests/rl/training/scripts/parallel_utils_worker.py", [out], nproc=2, timeout=120)
    res = json.loads(out.read_text())
    assert res["sum"] == [1.0 + 2.0, 10.0 + 20.0]  # rank r holds [r+1, 10(r+1)]
    assert res["mean"] == [1.5, 15.0]
    assert res["max"] == [2.0]
    assert res["broadcast"] == [2.0] and res["object"] == {"from": 1}


def test_nccl_collectives_stage_cpu_tensors_through_the_gpu(monkeypatch):
    """NCCL has no CPU transport ("No backend type associated with device type cpu", seen on an H100 in
    refit's size reduction): a CPU tensor is copied to the group's device, reduced there and copied back.
    CUDA is stubbed here; the real NCCL path ran on a GPU (docs/benchmarks.md)."""
    seen = []
    monkeypatch.setattr(pu, "is_initialized", lambda: True)
    monkeypatch.setattr(pu, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)

    def fake_all_reduce(t, op=None, group=None):
        seen.append(t)
        t.mul_(2)  # as if the other rank held the same values

    monkeypatch.setattr(pu.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(pu.dist, "get_backend", lambda group=None: "gloo")
    assert pu.collective_device() is None
    t = torch.tensor([1.0, 3.0])
    pu.all_reduce_sum(t)
    assert seen[-1] is t and t.tolist() == [2.0, 6.0]  # gloo: the tensor itself, no copy

    monkeypatch.setattr(pu.dist, "get_backend", lambda group=None: "nccl")
    assert pu.collective_device() is not None  # CUDA (the CPU layer, when a test installed it, rewrites it to cpu)
    # the staging itself, with a stand-in device: CUDA cannot be allocated here
    monkeypatch.setattr(pu, "collective_device", lambda group=None: torch.device("meta"))
    staged_to = []
    real_to = torch.Tensor.to

    def fake_to(self, *args, **kwargs):
        if args and isinstance(args[0], torch.device) and args[0].type == "meta":
            staged_to.append(args[0])
            return self.clone()  # stands in for the GPU copy
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", fake_to)
    t = torch.tensor([1.0, 3.0])
    assert pu.all_reduce_max(t) is t
    assert staged_to == [torch.device("meta")] and seen[-1] is not t
    assert t.tolist() == [2.0, 6.0]  # the reduced values copied back into the caller's CPU tensor
