"""megatron-core's torch_dist checkpoint writer without a process that outlives the trainer.

megatron-core 0.16.1's ``FileSystemWriterAsync`` (the writer of every torch_dist save, synchronous ones too) hands
its write workers' results back through a queue of a ``multiprocessing`` Manager of the spawn context, made on the
first save and kept for the life of the process: a server process (~275 MB: a fresh interpreter importing the
entry script's modules) and a resource tracker. A trainer killed with SIGKILL leaves both behind, re-parented to
PID 1, run after run.

megatron-rl saves synchronously (``dist_checkpointing.save``): the write function then runs in the trainer's own
process (it forks short-lived write workers per save and joins them before it returns), so a queue of this process
carries the results and no long-lived child is started. An asynchronous save (megatron-core's
``AsyncCallsQueue``, which megatron-rl does not use) would need the Manager's queue back.
"""
from __future__ import annotations

import queue

from megatron.rl.runtime.patches import record, register

__all__ = ["WRITER_PATCH", "use_in_process_write_results"]

WRITER_PATCH = "torch_dist writer: in-process results queue"


@register(WRITER_PATCH, when="on use",
          changes="megatron.core.dist_checkpointing.strategies.filesystem_async:_results_queue (set)",
          why="FileSystemWriterAsync's results queue is a spawn-context Manager's, made on the first save and kept "
              "for the process's life: a server process (~275 MB) and a resource tracker that a SIGKILLed trainer "
              "leaves behind; synchronous saves (all of megatron-rl's) run the write in this process, so an "
              "in-process queue carries the results and no long-lived child is started")
def use_in_process_write_results() -> None:
    """Give megatron-core's torch_dist writer an in-process results queue (see the module docstring). Idempotent
    and cheap: called before every save, so a queue reset since (by anything) is set again."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # heavy: megatron-core

    if not isinstance(getattr(filesystem_async, "_results_queue", None), queue.Queue):
        filesystem_async._results_queue = queue.Queue()  # read by _get_write_results_queue() on every save
    record(WRITER_PATCH)
