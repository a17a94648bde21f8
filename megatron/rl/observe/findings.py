"""What the training-health checks share: their thresholds, what they find, and the window arithmetic.

The run-wide checks (:mod:`megatron.rl.observe.warnings`) and the per-environment ones
(:mod:`megatron.rl.observe.env_health`) both read :class:`WarningThresholds` and return :class:`Finding` s.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

__all__ = ["WarningThresholds", "Finding", "finite", "window_means", "GUARD_ACTIONS"]

# what a sustained collapse of one environment does (--rl-env-collapse-action; see megatron.rl.observe.guard)
GUARD_ACTIONS = ("off", "downweight", "stop")


@dataclasses.dataclass(frozen=True)
class WarningThresholds:
    """Warn when a share / gap is strictly above its threshold (flags ``--rl-warn-*``)."""

    same_reward_share: float = 0.9
    length_cap_share: float = 0.5
    logprob_gap: float = 1.0
    off_policy_kl: float = 0.03  # k3 KL(behaviour || trained policy) per token, asynchronous rollouts
    is_truncated_share: float = 0.05  # share of tokens whose importance weight was truncated
    reward_drop: float = 0.1  # an environment's windowed reward this far below its first window
    entropy_drop: float = 0.25  # windowed entropy below this fraction of the first window's
    trend_window: int = 20  # iterations per window of the trend checks
    top_answer_share: float = 0.8  # one environment's most common answer above this share: a collapse
    env_window: int = 5  # iterations pooled per environment by the per-environment checks
    pass_at_1_drop: float = 0.1  # held-out pass@1 this far below the run's first evaluation


@dataclasses.dataclass(frozen=True)
class Finding:
    # "same_reward" | "length_cap" | "logprob_gap" | "off_policy" | "entropy_collapse", and per environment
    # "<check>/<env>" ("answer_collapse/<env>", "same_reward/<env>", "reward_drop/<env>", ...)
    kind: str
    value: float
    threshold: float
    message: str

    @property
    def env(self) -> str | None:
        """The environment a per-environment finding names (None for a run-wide one)."""
        return self.kind.split("/", 1)[1] if "/" in self.kind else None


def finite(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if v is not None and math.isfinite(v) else None


def window_means(values: Sequence[float], window: int) -> tuple[float, float] | None:
    """(mean of the first ``window`` values, mean of the last ``window``), once there are two whole windows."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if window < 1 or len(vals) < 2 * window:
        return None
    return sum(vals[:window]) / window, sum(vals[-window:]) / window
