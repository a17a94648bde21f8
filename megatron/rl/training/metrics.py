"""Metrics writers: TensorBoard (``--tensorboard-dir``) and Weights & Biases (``--wandb-project``), rank 0 only.

``build_metrics_writer(cfg)`` returns None when neither is configured or on ranks other than 0 (every
caller guards with ``if writer is not None``). A writer takes flat ``{name: float}`` dicts; names use ``/``
for grouping (``train/lm loss``, ``validation/lm loss``, ``rl/reward_mean``).
"""
from __future__ import annotations

import logging
import math
from typing import Mapping

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
    import dataclasses

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
