"""Metrics writers: TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``), rank 0 only,
and the metrics JSONL file (``--rl-metrics-jsonl``).

``build_metrics_writer(cfg)`` returns None when neither is configured or on ranks other than 0 (every
caller guards with ``if writer is not None``). A writer takes flat ``{name: float}`` dicts; names use ``/``
for grouping (``train/lm loss``, ``validation/lm loss``, ``rl/reward_mean``), and text (markdown).
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Any, Mapping

from megatron.rl import parallel_utils
from megatron.rl.training.config import ConfigError, TrainingConfig

log = logging.getLogger(__name__)


class MetricsWriter:
    """Fans scalars out to TensorBoard and/or W&B. Construct through :func:`build_metrics_writer`."""

    def __init__(self, tensorboard_dir: str | None = None, wandb_project: str | None = None,
                 wandb_exp_name: str | None = None, wandb_save_dir: str | None = None,
                 run_config: Mapping | None = None) -> None:
        self._tb = None
        self._wandb = None
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ConfigError(f"--tensorboard-dir={tensorboard_dir} needs the tensorboard package: "
                                  f"pip install tensorboard") from e
            self._tb = SummaryWriter(log_dir=tensorboard_dir, max_queue=1000)
        if wandb_project:
            try:
                import wandb
            except ImportError as e:
                raise ConfigError(f"--wandb-project={wandb_project} needs the wandb package: pip install wandb "
                                  f"(or 'megatron-rl[wandb]'), or drop the flag") from e
            self._wandb = wandb.init(project=wandb_project, name=wandb_exp_name, dir=wandb_save_dir,
                                     config=dict(run_config or {}))

    def log_scalars(self, values: Mapping[str, float], step: int) -> None:
        """Write each finite scalar at ``step``."""
        clean = {k: float(v) for k, v in values.items() if v is not None and math.isfinite(float(v))}
        if self._tb is not None:
            for k, v in clean.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(clean, step=step)

    def log_text(self, tag: str, text: str, step: int) -> None:
        """Markdown ``text`` at ``step`` (TensorBoard's text tab; a one-cell table in W&B)."""
        if self._tb is not None:
            self._tb.add_text(tag, text, step)
        if self._wandb is not None:
            import wandb

            self._wandb.log({tag: wandb.Table(columns=["text"], data=[[text]])}, step=step)

    def log_iteration(self, stats, tokens_per_iteration: int) -> None:
        """Standard per-iteration training scalars from a :class:`~megatron.rl.training.loop.IterationStats`."""
        values = {f"train/{k}": v for k, v in stats.losses.items()}
        values["train/learning-rate"] = stats.learning_rate
        values["train/grad-norm"] = stats.grad_norm
        values["train/iteration-time"] = stats.elapsed_s
        values["train/tokens-per-second"] = tokens_per_iteration / max(stats.elapsed_s, 1e-9)
        values["train/consumed-samples"] = stats.consumed_samples
        values["train/skipped"] = float(stats.skipped)
        self.log_scalars(values, stats.iteration)

    def flush(self) -> None:
        if self._tb is not None:
            self._tb.flush()

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def _flat_config(cfg: TrainingConfig) -> dict:

    out = {}
    for section in ("model", "parallel", "optim", "train", "checkpoint", "logging", "tokenizer", "data"):
        for k, v in dataclasses.asdict(getattr(cfg, section)).items():
            out[f"{section}.{k}"] = v
    out.update({f"extra.{k}": v for k, v in vars(cfg.extra).items()})
    return out


def build_metrics_writer(cfg: TrainingConfig) -> MetricsWriter | None:
    """A writer on global rank 0 when --tensorboard-dir or --wandb-project is set; None otherwise."""
    lg = cfg.logging
    if not (lg.tensorboard_dir or lg.wandb_project) or not parallel_utils.is_rank0():
        return None
    writer = MetricsWriter(lg.tensorboard_dir, lg.wandb_project, lg.wandb_exp_name, lg.wandb_save_dir,
                           run_config=_flat_config(cfg))
    log.info("metrics: tensorboard=%s wandb=%s", lg.tensorboard_dir, lg.wandb_project)
    return writer


# --------------------------------------------------------------------------- the metrics JSONL file


def json_safe(record: Mapping[str, Any]) -> dict[str, Any]:
    """``record`` with non-finite floats as None, so it serialises as strict JSON."""
    return {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}


def metrics_json_line(record: Mapping[str, Any]) -> str:
    """One metrics JSONL line: strict JSON, a non-finite number (e.g. the mean reward of an iteration whose
    rollouts all failed) written as ``null`` rather than Python's ``NaN``."""
    return json.dumps(json_safe(record), allow_nan=False) + "\n"


def _keep_line(line: str, resume_iteration: int) -> bool:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return False  # the torn last line of a killed run
    it = record.get("iteration") if isinstance(record, dict) else None
    return isinstance(it, int) and (it < resume_iteration or (it == resume_iteration and resume_iteration > 0))


def truncate_metrics_jsonl(path: str | os.PathLike, resume_iteration: int) -> tuple[int, int]:
    """Make ``path`` hold only what the run resumed at ``resume_iteration`` will not write again.

    Keeps records with ``iteration < resume_iteration``, and those of ``resume_iteration`` itself when it
    is > 0 (its training and evaluation records were written before its checkpoint); a fresh start (0)
    keeps nothing, since its iteration-0 evaluation runs again. Unparsable lines (a line torn by a kill)
    are dropped. The file is rewritten atomically (temporary file, fsync, rename), so a crash leaves either
    the old or the new file; the old one is kept beside it as ``<name>.prev``. Returns ``(kept, dropped)``
    line counts.
    """
    path = Path(path)
    if not path.exists():
        return 0, 0
    lines = [line for line in path.read_text(encoding="utf-8").splitlines(keepends=True) if line.strip()]
    kept = [line if line.endswith("\n") else line + "\n" for line in lines if _keep_line(line, resume_iteration)]
    if len(kept) == len(lines):
        return len(kept), 0
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as f:
        f.writelines(kept)
        f.flush()
        os.fsync(f.fileno())
    shutil.copyfile(path, path.with_name(path.name + ".prev"))
    os.replace(tmp, path)
    return len(kept), len(lines) - len(kept)


class MetricsJsonl:
    """The ``--rl-metrics-jsonl`` file of one run: opened for a start at ``resume_iteration`` (dropping the
    lines a previous attempt wrote past it, see :func:`truncate_metrics_jsonl`), then appended to with one
    flushed line per record."""

    def __init__(self, path: str | os.PathLike, resume_iteration: int) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept, dropped = truncate_metrics_jsonl(self.path, resume_iteration)
        if dropped:
            log.info("%s: dropped %d line(s) an earlier attempt wrote past iteration %d (kept %d; the old file "
                     "is %s.prev)", self.path, dropped, resume_iteration, kept, self.path.name)

    def write(self, record: Mapping[str, Any]) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(metrics_json_line(record))

    def write_run_start(self, name: str, iteration: int) -> None:
        """The record saying which run this is and when this attempt started (UTC, ISO 8601) at ``iteration``:
        ``{"iteration": N, "run": {"name": ..., "started": ...}}``. A resumed run keeps its first attempt's record
        (``tools/plot_metrics.py`` titles the figure with the earliest)."""
        started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
        self.write({"iteration": iteration, "run": {"name": name, "started": started}})
