"""One training run's build sequence, shared by pretraining and RL: :class:`TrainingRun`.

``TrainingRun.build(cfg)`` does, in order, what pretraining and RL need before their first iteration (logging,
the ``--load`` check, tokenizer, process groups, model, optimizer, reference model, checkpoint flags, metrics
writer); :meth:`TrainingRun.resume` and :meth:`TrainingRun.save` load and write checkpoints with the caller's run
state. Pretraining, RL and ``--eval-only`` treat ``--load`` differently (:class:`ResumePolicy`,
:data:`EVAL_ONLY`).

Details: docs/training.md.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path
from typing import Any

from megatron.rl import parallel_utils
from megatron.rl.logging import current_rank, setup_distributed_logging
from megatron.rl.training.checkpoint.save_load import (CheckpointError, latest_checkpoint, load_checkpoint,
                                                       save_checkpoint)
from megatron.rl.runtime.cpu_malloc import keep_freed_memory
from megatron.rl.runtime.cpu_threads import ThreadBudget
from megatron.rl.training.config import TrainingConfig, parse_cpu_threads
from megatron.rl.training.initialize import initialize_megatron
from megatron.rl.training.metrics import build_metrics_writer
from megatron.rl.training.checkpoint.retention import RetentionPolicy, apply_retention, record_score
from megatron.rl.training.checkpoint.run_flags import RUN_FLAGS_KEY
from megatron.rl.training.model_provider import build_model, checkpoint_model_args
from megatron.rl.training.optimizer import build_optimizer
from megatron.rl.training.checkpoint.paths import remove_partial_dirs
from megatron.rl.training.run_lock import RunLock
from megatron.rl.training.tokenizer import build_tokenizer

log = logging.getLogger(__name__)

__all__ = ["ResumePolicy", "PRETRAIN_RESUME", "RL_RESUME", "EVAL_ONLY", "Resumed", "TrainingRun",
           "resolve_load_dir"]


@dataclasses.dataclass(frozen=True)
class ResumePolicy:
    """How a program treats ``--load`` and ``--finetune``.

    load_required: ``--load`` naming a place without a checkpoint is an error (except for auto-resume and
    ``--pretrained-checkpoint``, see :func:`resolve_load_dir`); else the run starts fresh.
    label: what an iteration is called in the log ("RL iteration").
    evaluate_only: the program only runs the model (``--eval-only``): no optimizer, scheduler, DDP wrapper or
    metrics writer is built, and checkpoints give their weights only.
    """

    load_required: bool
    label: str
    evaluate_only: bool = False


PRETRAIN_RESUME = ResumePolicy(load_required=True, label="iteration")
RL_RESUME = ResumePolicy(load_required=False, label="RL iteration")
EVAL_ONLY = ResumePolicy(load_required=True, label="iteration", evaluate_only=True)


@dataclasses.dataclass(frozen=True)
class Resumed:
    """Where a run starts: the iteration, the run state saved with it (empty for a fresh start) and whether a
    checkpoint of this run (not only pretrained weights) was loaded; ``loaded``: what the loader restored (its
    path and saved iteration), None without a checkpoint."""

    iteration: int
    run_state: dict
    from_checkpoint: bool
    loaded: Any = dataclasses.field(default=None, compare=False)  # checkpointing.LoadedCheckpoint


def resolve_load_dir(cfg: TrainingConfig, required: bool = True) -> str | None:
    """The directory ``--load`` resumes from, or None to start fresh; checked before any model is built.

    With ``required``, ``--load`` naming a place without a checkpoint is an error, except for the auto-resume
    pattern ``--save DIR --load DIR`` (first run of a job that resumes itself), or when
    ``--pretrained-checkpoint`` supplies the starting weights instead.
    """

    c = cfg.checkpoint
    if not c.load:
        return None
    if latest_checkpoint(c.load, c.load_newest_checkpoint) is not None:
        return c.load
    if not required:
        return None
    if c.save and os.path.abspath(c.save) == os.path.abspath(c.load):
        if not os.path.exists(c.load):  # a mistyped path would otherwise silently start over
            log.warning("--load %s does not exist: starting a new run (check the path if this run should resume)",
                        c.load)
        else:
            log.info("--load %s holds no checkpoint yet: starting from scratch (auto-resume run)", c.load)
        return None
    if c.pretrained_checkpoint:
        return None
    raise CheckpointError(f"--load {c.load}: no checkpoint there (missing directory or no "
                          f"latest_checkpointed_iteration.txt); check the path, or drop --load to start from scratch")


@dataclasses.dataclass
class TrainingRun:
    """Everything a training loop iterates with; build with :meth:`build` (on every rank)."""

    cfg: TrainingConfig
    policy: ResumePolicy
    load_dir: str | None
    runtime: Any
    tokenizer: Any
    model: list
    optimizer: Any
    scheduler: Any
    model_args: dict  # stored with every checkpoint and compared on load
    ref_model: list | None = None
    writer: Any = None
    run_lock: RunLock | None = None  # global rank 0's lock of --save, held until close()
    threads: ThreadBudget | None = None  # torch's CPU thread count (None on GPUs)
    cpu_malloc: str | None = None  # what --cpu-malloc did (None on GPUs)

    @classmethod
    def build(cls, cfg: TrainingConfig, policy: ResumePolicy = PRETRAIN_RESUME, *, ref_model: bool = False,
              metrics_writer: Any = None, run_flags: dict | None = None) -> "TrainingRun":
        """Build the run (collective: initialises megatron). ``ref_model``: also build a frozen copy of the
        model (no DDP), loaded from ``--pretrained-checkpoint`` by :meth:`resume`. ``metrics_writer``: use this
        writer instead of the one ``--tensorboard-dir`` / ``--wandb-project`` ask for. ``run_flags``: the
        trainer's flags to store with every checkpoint (``checkpoint.run_flags.record_run_flags``). With
        ``policy.evaluate_only`` the model is not DDP-wrapped and optimizer, scheduler and writer are None."""

        setup_distributed_logging(cfg.logging.log_level)
        # one run per --save directory, checked before anything is built (rank 0: one process per run holds it)
        writes = cfg.checkpoint.save and not policy.evaluate_only
        run_lock = RunLock(cfg.checkpoint.save) if writes and current_rank() == 0 else None
        if run_lock is not None:  # an interrupted save's leftovers go first: on a full disk they hold the space
            remove_partial_dirs(Path(cfg.checkpoint.save))  # that resuming (the rollout bank's compaction) needs
        load_dir = resolve_load_dir(cfg, required=policy.load_required)
        tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
        runtime = initialize_megatron(cfg)
        threads = None if runtime.is_cuda else ThreadBudget(parse_cpu_threads(cfg.train.cpu_threads))
        if threads is not None:
            threads.start()
        cpu_malloc = None if runtime.is_cuda else keep_freed_memory(cfg.train.cpu_malloc)
        trains = not policy.evaluate_only
        model = build_model(cfg, wrap_with_ddp=trains, tokenizer=tokenizer)
        optimizer, scheduler = build_optimizer(cfg, model) if trains else (None, None)
        ref = build_model(cfg, wrap_with_ddp=False, tokenizer=tokenizer) if ref_model else None
        writer = metrics_writer if metrics_writer is not None else build_metrics_writer(cfg) if trains else None
        model_args = checkpoint_model_args(cfg, tokenizer)
        if run_flags:
            model_args[RUN_FLAGS_KEY] = run_flags
        return cls(cfg, policy, load_dir, runtime, tokenizer, model, optimizer, scheduler, model_args, ref, writer,
                   run_lock, threads, cpu_malloc)

    def _load(self, path: str, *, weights_only: bool, model=None):

        c = self.cfg.checkpoint
        if weights_only:
            return load_checkpoint(path, model if model is not None else self.model,
                                   None if model is not None else self.optimizer,
                                   None if model is not None else self.scheduler, load_optimizer=False,
                                   load_rng=False, model_args=self.model_args,
                                   verify_checksums=not c.no_verify_checkpoint_checksums,
                                   newest=c.load_newest_checkpoint)
        return load_checkpoint(path, self.model, self.optimizer, self.scheduler,
                               load_optimizer=not (c.no_load_optim or c.finetune),
                               load_rng=not (c.no_load_rng or c.finetune), model_args=self.model_args,
                               verify_checksums=not c.no_verify_checkpoint_checksums,
                               newest=c.load_newest_checkpoint)

    def resume(self) -> Resumed:
        """Load the reference model (from ``--pretrained-checkpoint``), then resume from ``--load`` or start
        from ``--pretrained-checkpoint`` (weights only), or from the freshly initialised weights.

        ``--finetune`` (Megatron-LM's meaning, in every program): ``--load`` gives the weights only; the run
        starts at iteration 0 with a fresh optimizer, scheduler, RNG and run state (RL: the prompt streams
        start over)."""
        c = self.cfg.checkpoint
        if self.ref_model is not None:
            self._load(c.pretrained_checkpoint, weights_only=True, model=self.ref_model)
        if self.load_dir is not None:
            loaded = self._load(self.load_dir, weights_only=self.policy.evaluate_only)
            if c.finetune:
                log.info("--finetune: weights of %s (%s %s); starting at %s 0 with a fresh optimizer", loaded.path,
                         self.policy.label, loaded.iteration, self.policy.label)
                return Resumed(0, {}, True, loaded)
            if self.policy.evaluate_only:
                log.info("loaded the weights of %s", loaded.path)
            else:
                log.info("resumed from %s at %s %s", loaded.path, self.policy.label, loaded.iteration)
            return Resumed(int(loaded.iteration or 0), dict(loaded.run_state), True, loaded)
        if c.pretrained_checkpoint:
            loaded = self._load(c.pretrained_checkpoint, weights_only=True)
            log.info("starting from the pretrained checkpoint %s", c.pretrained_checkpoint)
            return Resumed(0, {}, False, loaded)
        return Resumed(0, {}, False)

    def save(self, iteration: int, run_state: dict, metrics: dict | None = None) -> None:
        """Save a checkpoint of ``iteration`` to ``--save`` with the caller's ``run_state``, then delete the
        checkpoints ``--save-retain-last`` / ``--save-retain-best`` do not keep (``metrics``: measured at
        ``iteration``, where the best-by-metric policy finds its value). Collective."""

        c = self.cfg.checkpoint
        save_checkpoint(c.save, iteration, self.model, None if c.no_save_optim else self.optimizer, self.scheduler,
                        run_state=run_state, model_args=self.model_args, dist_opt_format=c.dist_ckpt_optim_format)
        policy = RetentionPolicy.from_flags(c.save, c.save_retain_last, c.save_retain_best)
        if policy is not None and parallel_utils.is_rank0():
            record_score(Path(c.save), policy, iteration, metrics)
            apply_retention(c.save, policy)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self.run_lock is not None:
            self.run_lock.release()
