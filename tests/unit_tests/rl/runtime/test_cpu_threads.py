"""The CPU thread budget: the count it chooses, fixed counts kept, worker threads following, a real co-runner."""
from __future__ import annotations

import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron.rl.base.errors import ConfigError
from megatron.rl.runtime import cpu_threads
from megatron.rl.runtime.cpu_threads import ThreadBudget, _Mark, threads_for
from megatron.rl.training.config import parse_cpu_threads

pytestmark = pytest.mark.adaptive_cpu_threads


@pytest.fixture(autouse=True)
def _restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)
    cpu_threads._set(before)


@pytest.mark.parametrize("usable, others, expected", [
    (2, 0.0, 2), (2, 0.3, 2), (2, 0.6, 1), (2, 1.0, 1), (2, 2.0, 1),
    (8, 0.0, 8), (8, 1.0, 7), (8, 2.4, 6), (8, 7.9, 1), (1, 0.0, 1),
])
def test_threads_fit_the_cores_other_processes_leave(usable, others, expected):
    assert threads_for(usable, others) == expected


def test_cpu_threads_flag_values():
    assert parse_cpu_threads("auto") is None
    assert parse_cpu_threads("3") == 3
    for bad in ("0", "-1", "two", ""):
        with pytest.raises(ConfigError, match="--cpu-threads"):
            parse_cpu_threads(bad)


def _budget_with_load(monkeypatch, fixed, loads, cpus=(0, 1)):
    """A budget whose windows see other processes keep ``loads[i]`` cores busy over 1 s each."""
    marks = [_Mark(0.0, 0.0, 0.0)]
    for load in loads:  # our own process used 0.5 core-seconds per window
        last = marks[-1]
        marks.append(_Mark(last.wall + 1.0, last.busy + load + 0.5, last.own + 0.5))
    it = iter(marks)
    monkeypatch.setattr(ThreadBudget, "_now", lambda self: next(it))
    monkeypatch.setattr(cpu_threads, "_torch_default", lambda: len(cpus))
    budget = ThreadBudget(fixed, cpus=list(cpus))
    budget.start()
    return budget


def test_auto_follows_other_processes_load_and_recovers(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    budget = _budget_with_load(monkeypatch, None, [0.1, 1.0, 1.0, 0.05])
    assert budget.threads == 2 and torch.get_num_threads() == 2
    assert [budget.update() for _ in range(4)] == [2, 1, 1, 2]
    assert torch.get_num_threads() == 2 and budget.changes == 2


def test_fixed_counts_are_kept(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    budget = _budget_with_load(monkeypatch, 2, [1.0, 1.0])
    assert [budget.update(), budget.update()] == [2, 2]
    assert "fixed by --cpu-threads" in budget.describe()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    budget = _budget_with_load(monkeypatch, None, [0.0, 0.0])
    assert budget.threads == 1 and [budget.update(), budget.update()] == [1, 1]
    assert "fixed by OMP_NUM_THREADS" in budget.describe()


def test_a_worker_thread_follows_a_new_count_only_when_it_asks():
    cpu_threads._set(2)
    seen = {}
    go, changed = threading.Event(), threading.Event()

    def worker():
        torch.ones(1 << 16).sum()  # torch fixes this thread's count at its first parallel op
        go.set()
        changed.wait()
        seen["before_follow"] = torch.get_num_threads()
        cpu_threads.follow()
        seen["after_follow"] = torch.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    go.wait()
    cpu_threads._set(1)
    changed.set()
    t.join()
    assert seen == {"before_follow": 2, "after_follow": 1}


@pytest.mark.skipif(len(cpu_threads.usable_cpus()) < 2, reason="needs 2 usable cores")
def test_a_real_cpu_bound_process_takes_a_thread_away(monkeypatch):
    """A busy loop pinned to one of our cores: the next window's count leaves that core to it."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cpus = cpu_threads.usable_cpus()
    hog = subprocess.Popen([sys.executable, "-c", f"import os; os.sched_setaffinity(0, {{{cpus[-1]}}})\n"
                            "while True: pass"])
    try:
        time.sleep(0.3)  # the hog is running
        budget = ThreadBudget(None, cpus=cpus)
        budget.start()
        deadline = time.monotonic() + 1.2
        while time.monotonic() < deadline:
            torch.randn(256, 256) @ torch.randn(256, 256)  # our own work is not counted as another's
        assert budget.update() <= budget.ceiling - 1
    finally:
        hog.kill()
        hog.wait()
