"""Checkpoint retention: ``--save-retain-last N`` and ``--save-retain-best METRIC K``.

After every save, :func:`apply_retention` (rank 0) keeps the checkpoint the tracker names, the newest ``N`` and
the ``K`` best by ``METRIC`` (``min:`` for lower is better), and deletes the rest; without either flag every
checkpoint is kept. Scores live in ``<save>/checkpoint_scores.json``. A deletion is an atomic rename to
``.replaced-`` first, so a kill never touches a kept checkpoint or the tracker.

Details: docs/training.md.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Mapping, Sequence

from megatron.rl.base.errors import ConfigError
from megatron.rl.training.checkpoint import paths

log = logging.getLogger(__name__)

__all__ = ["RetentionPolicy", "SCORES_FILENAME", "apply_retention", "record_score", "retained", "read_scores"]

SCORES_FILENAME = "checkpoint_scores.json"
_MIN_PREFIX = "min:"


@dataclasses.dataclass(frozen=True)
class RetentionPolicy:
    """Which checkpoints to keep. ``keep_last`` / ``keep_best``: None = no limit of that kind."""

    keep_last: int | None = None
    metric: str | None = None
    keep_best: int | None = None
    lower_is_better: bool = False

    @classmethod
    def from_flags(cls, save: str | None, retain_last: int | None,
                   retain_best: Sequence[str] | None) -> "RetentionPolicy | None":
        """The policy of ``--save-retain-last`` / ``--save-retain-best`` (None when neither is given);
        ConfigError naming the flag for a value that cannot work."""
        if retain_last is None and retain_best is None:
            return None
        if save is None:
            raise ConfigError("--save-retain-last / --save-retain-best choose which checkpoints of --save to keep: "
                              "pass --save DIR, or drop them.")
        if retain_last is not None and retain_last < 1:
            raise ConfigError(f"--save-retain-last={retain_last}: must be >= 1 (the newest checkpoint is always kept).")
        if retain_best is None:
            return cls(keep_last=retain_last)
        metric, count = retain_best
        try:
            k = int(count)
        except ValueError:
            k = 0
        if k < 1 or not metric.strip():
            raise ConfigError(f"--save-retain-best {metric} {count}: give a metric name and a count >= 1, e.g. "
                              f"--save-retain-best eval/pass@1 1 (or min:NAME when lower is better).")
        lower = metric.startswith(_MIN_PREFIX)
        return cls(keep_last=retain_last, metric=metric[len(_MIN_PREFIX):] if lower else metric, keep_best=k,
                   lower_is_better=lower)

    def describe(self) -> str:
        parts = [f"the last {self.keep_last}"] if self.keep_last else []
        if self.metric:
            parts.append(f"the best {self.keep_best} by {'lowest' if self.lower_is_better else 'highest'} "
                         f"{self.metric}")
        return " and ".join(parts) + " (and always the latest)"


def read_scores(root: Path) -> dict[int, float]:
    """``<root>/checkpoint_scores.json`` as iteration -> value ({} when absent or unreadable: nothing scored)."""
    try:
        raw = json.loads((root / SCORES_FILENAME).read_text())
        return {int(k): float(v) for k, v in raw.items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}


def _write_scores(root: Path, scores: Mapping[int, float]) -> None:
    tmp = root / f"{SCORES_FILENAME}{paths.TMP_INFIX}{os.getpid()}"
    tmp.write_text(json.dumps({str(k): v for k, v in sorted(scores.items())}) + "\n")
    os.replace(tmp, root / SCORES_FILENAME)


def record_score(root: Path, policy: RetentionPolicy, iteration: int, metrics: Mapping[str, float] | None) -> None:
    """Record ``policy.metric``'s value in ``metrics`` (measured at ``iteration``) as that checkpoint's score."""
    if policy.metric is None:
        return
    value = (metrics or {}).get(policy.metric)
    if value is None or not math.isfinite(value):
        log.info("checkpoint %d has no value of %s (--save-retain-best): kept only while among the newest", iteration,
                 policy.metric)
        return
    _write_scores(root, {**read_scores(root), iteration: float(value)})


def retained(iterations: Sequence[int], policy: RetentionPolicy, scores: Mapping[int, float],
             tracked: int | None) -> set[int]:
    """The iterations to keep among ``iterations`` (complete checkpoints). Pure."""
    present = sorted(iterations)
    keep = set(present) if policy.keep_last is None and policy.metric is None else set()
    if policy.keep_last is not None:
        keep.update(present[-policy.keep_last:])
    if policy.metric is not None:
        scored = [it for it in present if it in scores]
        sign = 1.0 if policy.lower_is_better else -1.0
        keep.update(sorted(scored, key=lambda it: (sign * scores[it], -it))[:policy.keep_best])
    if tracked is not None and tracked in present:
        keep.add(tracked)
    elif present:
        keep.add(present[-1])
    return keep


def _delete(ckpt: Path) -> None:
    """Rename aside (one atomic step), make the rename durable, then remove."""
    trash = ckpt.with_name(f"{ckpt.name}{paths.TRASH_INFIX}{paths.new_stamp()}")
    os.rename(ckpt, trash)
    paths._fsync_dir(ckpt.parent)  # noqa: SLF001 - the same durability step as publishing
    shutil.rmtree(trash, ignore_errors=True)


def apply_retention(root: str | os.PathLike, policy: RetentionPolicy | None) -> list[int]:
    """Delete the checkpoints of ``root`` that ``policy`` does not keep (call on one rank, after the tracker
    names the newest save). Returns the deleted iterations."""
    if policy is None:
        return []
    root = Path(root)
    tracked = paths.read_tracker(root)
    present = paths.complete_iterations(root)
    scores = read_scores(root)
    keep = retained(present, policy, scores, tracked if isinstance(tracked, int) else None)
    deleted = [it for it in present if it not in keep]
    for it in deleted:
        _delete(root / paths.checkpoint_dir_name(it))
    if deleted:
        log.info("removed checkpoint(s) %s of %s: keeping %s (%s)", deleted, root, sorted(keep), policy.describe())
    if set(scores) - set(keep):
        _write_scores(root, {it: v for it, v in scores.items() if it in keep})
    return deleted
