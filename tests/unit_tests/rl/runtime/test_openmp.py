"""release_thread_pool frees the calling thread's OpenMP workers (observed as OS threads, not timings)."""
import os
import sys
import time

import pytest
import torch

from megatron.rl.runtime.openmp import release_thread_pool

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts threads in /proc/self/task")


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _settled_threads() -> int:
    for _ in range(50):  # released workers exit asynchronously
        before = _threads()
        time.sleep(0.01)
        if _threads() == before:
            return before
    return _threads()


def test_release_frees_the_callers_pool_and_it_comes_back():
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        x = torch.randn(1 << 18)
        (x + x).sum()  # a parallel region: this thread now owns a pool with one worker
        with_pool = _settled_threads()
        assert release_thread_pool() is True
        without_pool = _settled_threads()
        assert without_pool == with_pool - 1
        assert release_thread_pool() is True  # nothing to free: still fine
        assert torch.equal((x + x), 2 * x)  # torch works after the release and rebuilds the pool
        assert _settled_threads() == with_pool
    finally:
        torch.set_num_threads(old)

