"""The RL iteration line: short by default (fits a 160-column terminal with the log prefix), full on request.

``--log-line short``: iteration, reward and spread, latest pass@1, loss, KL, train-inference gap, seconds (then
``failed N`` / ``skipped`` when they happen). ``--log-line full`` adds learning rate, clip fractions, entropy,
importance weights, staleness, throughput, the time split and per-environment parts. Every figure goes to
TensorBoard / W&B / JSONL either way.

Example line: docs/observe.md.
"""
from __future__ import annotations

import math
from typing import Mapping

from megatron.rl.observe.metrics import format_env_line

__all__ = ["LINE_FORMS", "format_rl_line", "format_short_line", "format_full_line"]

LINE_FORMS = ("short", "full")

# Short names for the long line (the full set goes to TensorBoard / W&B / JSONL).
_LINE_KEYS = (("reward_mean", "reward"), ("reward_std", "reward std"), ("rl_loss", "loss"),
              ("response_length_mean", "resp len"), ("clip_fraction_low", "clip lo"),
              ("clip_fraction_high", "clip hi"), ("kl_mean", "kl"), ("entropy_mean", "entropy"),
              ("turns_per_episode_mean", "turns"), ("logprob_gap_mean", "lp gap"),
              ("logprob_gap_max", "lp gap max"), ("mismatch_kl_k3", "mm kl"), ("is_weight_mean", "is w"),
              ("is_truncated_fraction", "is trunc"), ("is_masked_fraction", "is masked"),
              ("is_rejected_fraction", "rejected"), ("staleness_mean", "stale"), ("staleness_max", "stale max"),
              ("off_policy_token_share", "off-policy"), ("router_replay_disagreement", "route diff"),
              ("grad_norm", "grad norm"), ("packing_efficiency", "packing"), ("prompt_tokens_shared", "shared"),
              ("generation_tokens_per_s", "gen tok/s"),
              ("train_tokens_per_s", "train tok/s"), ("time_generate_s", "t gen"), ("time_logprobs_s", "t lp"),
              ("time_train_s", "t train"), ("time_refit_s", "t refit"))


def _finite(metrics: Mapping[str, float], key: str) -> float | None:
    value = metrics.get(key)
    return value if value is not None and math.isfinite(value) else None


def _g(value: float, digits: int) -> str:
    """``value`` to ``digits`` significant digits, exponent without its leading zero (3.7e-8, not 3.7e-08)."""
    return f"{value:.{digits}g}".replace("e-0", "e-").replace("e+0", "e+")


def _trouble(metrics: Mapping[str, float]) -> list[str]:
    parts = []
    if metrics.get("failed_rollouts"):
        parts.append(f"failed rollouts: {int(metrics['failed_rollouts'])}")
    if metrics.get("skipped_update"):
        parts.append("update skipped")
    return parts


def format_full_line(iteration: int, total: int, metrics: Mapping[str, float], lr: float) -> str:
    """The long form (``--log-line full``): every figure of :data:`_LINE_KEYS` the iteration has."""
    parts = [f" iteration {iteration:6d}/{total:6d}", f"learning rate: {lr:.3E}"]
    for key, name in _LINE_KEYS:
        v = _finite(metrics, key)
        if v is None or (key == "turns_per_episode_mean" and v == 1.0):  # single-turn: nothing to say
            continue
        parts.append(f"{name}: {v:.4g}" if abs(v) < 1e4 else f"{name}: {v:.0f}")
    parts += _trouble(metrics)
    envs = format_env_line(metrics)
    if envs:
        parts.append(envs)
    return " | ".join(parts) + " |"


def format_short_line(iteration: int, total: int, metrics: Mapping[str, float],
                      last_eval: Mapping[str, float] | None = None) -> str:
    """The default form (see the module docstring). ``last_eval``: the latest evaluation's record, or None before
    the first."""
    parts = [f"iteration {iteration:>{len(str(total))}}/{total}"]
    reward, std = _finite(metrics, "reward_mean"), _finite(metrics, "reward_std")
    if reward is not None:
        parts.append(f"reward {_g(reward, 3)}" + (f"±{_g(std, 2)}" if std is not None else ""))
    pass1 = _finite(last_eval or {}, "eval/pass@1")
    if pass1 is not None:
        parts.append(f"pass@1 {_g(pass1, 3)}")
    for key, name in (("rl_loss", "loss"), ("kl_mean", "kl"), ("logprob_gap_mean", "gap")):
        v = _finite(metrics, key)
        if v is not None:
            parts.append(f"{name} {_g(v, 2)}")
    seconds = _finite(metrics, "time_total_s")
    if seconds is not None:
        parts.append(f"{_g(seconds, 3)}s" if seconds < 100 else f"{seconds:.0f}s")
    if metrics.get("failed_rollouts"):
        parts.append(f"failed {int(metrics['failed_rollouts'])}")
    if metrics.get("skipped_update"):
        parts.append("skipped")
    return " | ".join(parts)


def format_rl_line(iteration: int, total: int, metrics: Mapping[str, float], lr: float, form: str = "full",
                   last_eval: Mapping[str, float] | None = None) -> str:
    """The iteration line in ``form`` (one of :data:`LINE_FORMS`)."""
    if form == "short":
        return format_short_line(iteration, total, metrics, last_eval)
    return format_full_line(iteration, total, metrics, lr)
