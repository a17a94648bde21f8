"""When a training loop saves and stops: ``--save-interval``, ``--exit-interval``, ``--exit-signal-handler``
and the final save. Shared by the pretraining loop and the RL driver so both behave the same way.

With ``--exit-signal-handler`` the chosen signal (``--exit-signal``, default SIGTERM: what Slurm sends before
preemption or at the time limit, or SIGUSR1 with ``sbatch --signal=B:USR1@300``) does not kill the
process: the handler only records it, the loop finishes the iteration in progress, every rank agrees to
stop (one all-reduce per iteration, so a signal seen by a single rank stops all of them together and no rank
waits in a collective), a checkpoint is saved when ``--save`` is set, and the loop returns normally (exit 0).
"""
from __future__ import annotations

import logging
import signal
import threading
from typing import Callable

import torch

from megatron.rl import runtime

log = logging.getLogger(__name__)

EXIT_SIGNALS = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2")


class LoopControl:
    """Decides, after each iteration, whether to save and whether to stop.

    Args:
        save_dir / save_interval / exit_interval: ``--save`` / ``--save-interval`` / ``--exit-interval``.
        save_fn: ``save_fn(iteration)`` writes a checkpoint (collective); only called when ``save_dir`` is set.
        last_saved: the iteration the run resumed from (it is on disk already), or None for a fresh start.
        exit_signal: a signal name from :data:`EXIT_SIGNALS` to handle, or None (``--exit-signal-handler`` off).

    Use: ``stop = control.after_iteration(it)`` after every iteration (all ranks), ``control.finish(it)``
    once after the loop (final save if the last iteration is not saved yet; restores the signal handler).
    """

    def __init__(self, save_dir: str | None, save_interval: int | None, exit_interval: int | None,
                 save_fn: Callable[[int], None], last_saved: int | None = None, exit_signal: str | None = None):
        self.save_dir, self.save_interval, self.exit_interval = save_dir, save_interval, exit_interval
        self.save_fn = save_fn
        self.last_saved = last_saved
        self.exit_signal = exit_signal
        self.signal_received = False  # set by the handler on this rank
        self.stopped_by_signal = False  # all ranks agreed to stop because of a signal
        self._previous_handler = None
        if exit_signal is not None:
            self._install(exit_signal)

    @classmethod
    def from_config(cls, cfg, save_fn: Callable[[int], None], last_saved: int | None) -> "LoopControl":
        """From a :class:`~megatron.rl.training.config.TrainingConfig`."""
        c, t = cfg.checkpoint, cfg.train
        return cls(c.save, c.save_interval, t.exit_interval, save_fn, last_saved,
                   t.exit_signal if t.exit_signal_handler else None)

    # -------------------------------------------------------------------------------- signal handling

    def _install(self, name: str) -> None:
        if name not in EXIT_SIGNALS:
            raise ValueError(f"--exit-signal={name!r}: choose one of {EXIT_SIGNALS}")
        if threading.current_thread() is not threading.main_thread():
            # Python only lets the main thread install handlers; say so instead of failing mid-run
            log.warning("--exit-signal-handler: not on the main thread, %s is not handled", name)
            return
        self._signum = getattr(signal, name)
        self._previous_handler = signal.signal(self._signum, self._on_signal)

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        # only record it: saving from inside a handler could interrupt a collective or a half-done step
        self.signal_received = True

    def _agreed_signal(self) -> bool:
        """Whether any rank received the signal (collective when the handler is on)."""
        if self.exit_signal is None:
            return False
        if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
            return self.signal_received

        flag = torch.tensor([int(self.signal_received)], dtype=torch.int64,
                            device="cuda" if runtime.cuda_usable() else "cpu")
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        return bool(flag.item())

    # ------------------------------------------------------------------------------------- decisions

    def _save(self, iteration: int) -> None:
        if self.save_dir and self.last_saved != iteration:
            self.save_fn(iteration)
            self.last_saved = iteration

    def after_iteration(self, iteration: int) -> bool:
        """Save if due; return True when the loop should stop now (exit interval or signal). All ranks."""
        if self._agreed_signal():
            self.stopped_by_signal = True
            log.info("exiting at iteration %d: received %s (--exit-signal-handler)%s", iteration,
                     self.exit_signal, "; saving a checkpoint" if self.save_dir else " (no --save: nothing saved)")
            self._save(iteration)
            return True
        if self.save_dir and self.save_interval and iteration % self.save_interval == 0:
            self._save(iteration)
        if self.exit_interval and iteration % self.exit_interval == 0:
            log.info("exiting at iteration %d (--exit-interval %d)", iteration, self.exit_interval)
            return True
        return False

    def finish(self, iteration: int) -> None:
        """After the loop: save the last iteration if it is not on disk yet; restore the signal handler."""
        try:
            self._save(iteration)
        finally:
            if self._previous_handler is not None:
                signal.signal(self._signum, self._previous_handler)
                self._previous_handler = None
