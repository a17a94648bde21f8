"""Processes a trainer's main thread forks (the torch_dist save's write workers) die with the trainer: a SIGKILLed
trainer leaves none blocked behind it."""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time

import psutil
import pytest

# A stand-in trainer: it registers the fork handler (or not), forks a child from its main thread and one from another
# thread, prints their pids, and waits to be killed. The children sleep, as a write worker blocked on a full pipe.
_TRAINER = textwrap.dedent("""
    import os, sys, threading, time
    if sys.argv[1] == "register":
        from megatron.rl.runtime.checkpoint_writer import use_in_process_write_results
        use_in_process_write_results()

    def fork_sleeper():
        pid = os.fork()
        if pid == 0:
            time.sleep(120)
            os._exit(0)
        return pid

    main_child = fork_sleeper()
    box = []
    thread = threading.Thread(target=lambda: box.append(fork_sleeper()))
    thread.start(); thread.join()
    print(main_child, box[0], flush=True)
    time.sleep(120)
""")


def _children_after_kill(mode: str) -> tuple[bool, bool]:
    proc = subprocess.Popen([sys.executable, "-c", _TRAINER, mode], stdout=subprocess.PIPE, text=True)
    try:
        main_child, thread_child = (psutil.Process(int(p)) for p in proc.stdout.readline().split())
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        time.sleep(1.0)
        alive = (main_child.is_running() and main_child.status() != psutil.STATUS_ZOMBIE,
                 thread_child.is_running() and thread_child.status() != psutil.STATUS_ZOMBIE)
        for child in (main_child, thread_child):
            try:
                child.kill()
            except psutil.Error:
                pass
        return alive
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_trainers_main_thread_forks_die_with_it():
    assert _children_after_kill("register") == (False, True)  # a thread's fork is left alone (see the module)
    assert _children_after_kill("plain") == (True, True)  # without the handler both outlive the trainer
