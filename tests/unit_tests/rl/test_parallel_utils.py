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
