"""--cpu-malloc: the user's allocator choices kept, glibc's thresholds set, and fewer page faults in a real process."""
from __future__ import annotations

import subprocess
import sys

import pytest

from megatron.rl.runtime.cpu_malloc import KEEP_BYTES, keep_freed_memory, user_allocator

# A training step's pattern: the forward and backward of an RMS norm over 8 MB activations, run 20 times; prints the
# minor page faults per step after three warm-up steps. Its own process: mallopt changes the whole process.
_FAULTS = """
import resource, sys, torch
from megatron.rl.runtime.cpu_malloc import keep_freed_memory
print(keep_freed_memory(sys.argv[1], environ={}), file=sys.stderr)
torch.set_num_threads(1)
x = torch.randn(4096, 512, requires_grad=True); w = torch.ones(512, requires_grad=True); g = torch.randn(4096, 512)
def step():
    torch.nn.functional.rms_norm(x, (512,), w, 1e-5).backward(g)
for _ in range(3):
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(20):
    step()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 20)
"""


class _Mallopt:
    def __init__(self, answer: int = 1):
        self.calls, self.answer = [], answer

    def __call__(self, param: int, value: int) -> int:
        self.calls.append((param, value))
        return self.answer


@pytest.mark.parametrize("environ, named", [
    ({}, None),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ({"LD_PRELOAD": "/opt/libtcmalloc_minimal.so"}, "LD_PRELOAD"),
    ({"LD_PRELOAD": "/opt/libsomething_else.so"}, None),
    ({"MALLOC_ARENA_MAX": "2"}, "MALLOC_ARENA_MAX"),
    ({"MALLOC_TRIM_THRESHOLD_": "0"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"}, "GLIBC_TUNABLES"),
    ({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, None),
])
def test_user_allocator_names_the_choice(environ, named):
    found = user_allocator(environ)
    assert (found is None) if named is None else named in found


def test_keep_sets_both_thresholds():
    mallopt = _Mallopt()
    line = keep_freed_memory("keep", environ={}, mallopt=mallopt)
    assert mallopt.calls == [(-3, KEEP_BYTES), (-1, KEEP_BYTES)]  # M_MMAP_THRESHOLD, M_TRIM_THRESHOLD
    assert "kept for reuse" in line and "--cpu-malloc system" in line


@pytest.mark.parametrize("mode, environ", [("system", {}), ("keep", {"MALLOC_ARENA_MAX": "4"}),
                                           ("keep", {"LD_PRELOAD": "libmimalloc.so"})])
def test_user_choices_and_system_leave_glibc_alone(mode, environ):
    mallopt = _Mallopt()
    line = keep_freed_memory(mode, environ=environ, mallopt=mallopt)
    assert mallopt.calls == []
    assert ("system" in line) if mode == "system" else ("leaves it" in line)


def test_a_refused_threshold_is_reported():
    assert "refused" in keep_freed_memory("keep", environ={}, mallopt=_Mallopt(answer=0))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc and getrusage's fault counts: Linux")
def test_keep_stops_refaulting_a_training_steps_memory():
    def faults(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FAULTS, mode], capture_output=True, text=True, check=True)
        return float(out.stdout.split()[-1])

    system, keep = faults("system"), faults("keep")
    # glibc's defaults hand the step's 8 MB blocks back and fault them in again (~4,500 per step measured); kept,
    # they are reused (~300, the heap still growing)
    assert system > 1000, system
    assert keep < system / 4, (keep, system)
