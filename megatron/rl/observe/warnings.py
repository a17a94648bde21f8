"""Warnings at the classic failure points of an RL run, read off each iteration's metrics.

* **same reward**: most groups got one reward for every rollout, so their advantages are all zero and the
  update learns nothing from them (a task far too hard or too easy, a reward that ignores the completion,
  or generations that collapsed to one string);
* **length cap**: most responses stopped at the token budget (rambling, or a degenerate repetition);
* **log-prob gap**: the trainer's log-probs of the sampled tokens are far from the inference backend's,
  i.e. the rollouts come from a different policy (a server serving other weights, another tokenizer or
  chat template, a temperature mismatch).

:func:`check_failure_points` is pure (metrics and thresholds in, findings out); :class:`WarningLimiter`
decides which findings to report, so a persisting condition is repeated only every ``interval``
iterations and an iteration logs at most one warning record.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from typing import Sequence

__all__ = ["Finding", "WarningThresholds", "check_failure_points", "WarningLimiter", "warning_metrics", "RunWarnings"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class WarningThresholds:
    """Warn when a share / gap is strictly above its threshold (flags ``--rl-warn-*``)."""

    same_reward_share: float = 0.9
    length_cap_share: float = 0.5
    logprob_gap: float = 1.0


@dataclasses.dataclass(frozen=True)
class Finding:
    kind: str  # "same_reward" | "length_cap" | "logprob_gap"
    value: float
    threshold: float
    message: str


def _finite(metrics: dict, key: str) -> float | None:
    v = metrics.get(key)
    return float(v) if v is not None and math.isfinite(v) else None


def check_failure_points(metrics: dict[str, float], thresholds: WarningThresholds, max_new_tokens: int | None = None,
                         example: str | None = None, same_reward_value: float | None = None) -> list[Finding]:
    """The failure points ``metrics`` (one iteration's, see :mod:`megatron.rl.observe.metrics`) show.

    example: a completion to quote in the length-cap finding; same_reward_value: the reward most
    same-reward groups share (quoted in that finding).
    """
    out = []
    share = _finite(metrics, "same_reward_group_fraction")
    if share is not None and share > thresholds.same_reward_share:
        value = "" if same_reward_value is None else f", most often {same_reward_value:g}"
        out.append(Finding("same_reward", share, thresholds.same_reward_share, (
            f"{share:.0%} of groups got the same reward for every rollout{value} (> {thresholds.same_reward_share:.0%},"
            f" --rl-warn-same-reward-share): their advantages are zero, so they teach nothing. Usual causes: a task "
            f"too hard or too easy for this policy, a reward function that ignores the completion, or generations "
            f"that collapsed to one string; look at the samples (--rl-log-samples).")))
    share = _finite(metrics, "length_capped_fraction")
    if share is not None and share > thresholds.length_cap_share:
        cap = f" (--rl-max-new-tokens={max_new_tokens})" if max_new_tokens else ""
        quoted = f" e.g. {example[:120]!r}." if example is not None else ""
        out.append(Finding("length_cap", share, thresholds.length_cap_share, (
            f"{share:.0%} of responses stopped at the length cap{cap} (> {thresholds.length_cap_share:.0%}, "
            f"--rl-warn-length-cap-share): the policy rambles or repeats itself, and cut-off answers usually "
            f"score 0; raise the cap or look at the samples.{quoted}")))
    gap = _finite(metrics, "logprob_gap_mean")
    if gap is not None and gap > thresholds.logprob_gap:
        worst = _finite(metrics, "logprob_gap_max")
        worst_text = f", max {worst:.3g}" if worst is not None else ""
        out.append(Finding("logprob_gap", gap, thresholds.logprob_gap, (
            f"the train-inference log-prob gap is {gap:.3g} nats per generated token{worst_text} (> "
            f"{thresholds.logprob_gap:g}, --rl-warn-logprob-gap): the rollouts come from a different policy than "
            f"the one being trained. Check that the inference server serves the trained weights (refit), the "
            f"same tokenizer / chat template, and samples at --rl-default-temperature (the trainer scores at it).")))
    return out


def warning_metrics(findings: Sequence[Finding]) -> dict[str, float]:
    """``warn/<kind>: 1.0`` for each finding (every iteration it holds, unlike the rate-limited log)."""
    return {f"warn/{f.kind}": 1.0 for f in findings}


class WarningLimiter:
    """Reports a finding the first time its kind shows, then at most once every ``interval`` iterations
    while it keeps showing (0: never); counts the iterations it held back."""

    def __init__(self, interval: int) -> None:
        self.interval = interval
        self._last: dict[str, int] = {}
        self._held: dict[str, int] = {}

    def admit(self, findings: Sequence[Finding], iteration: int) -> list[tuple[Finding, int]]:
        """The findings to report now, each with the number of earlier iterations it was held back."""
        if self.interval <= 0:
            return []
        out = []
        for f in findings:
            last = self._last.get(f.kind)
            if last is None or iteration - last >= self.interval:
                out.append((f, self._held.pop(f.kind, 0)))
                self._last[f.kind] = iteration
            else:
                self._held[f.kind] = self._held.get(f.kind, 0) + 1
        return out

    def report(self, findings: Sequence[Finding], iteration: int, logger: logging.Logger = log) -> str | None:
        """Log the admitted findings of ``iteration`` as one warning record; returns its text (None: nothing)."""
        admitted = self.admit(findings, iteration)
        if not admitted:
            return None
        lines = [f"iteration {iteration}: possible training problem{'s' if len(admitted) > 1 else ''}:"]
        for f, held in admitted:
            again = f" [also in {held} iteration{'s' if held != 1 else ''} since the last report]" if held else ""
            lines.append(f"  - {f.message}{again}")
        text = "\n".join(lines)
        logger.warning(text)
        return text


class RunWarnings:
    """The checks of one run. :meth:`check` finds an iteration's failure points (quoting a length-capped
    sample and the most common constant reward from its :class:`~megatron.rl.observe.metrics.RolloutObservations`);
    :meth:`report` logs what the limiter admits when this process reports (``report``: rank 0)."""

    def __init__(self, thresholds: WarningThresholds, interval: int, max_new_tokens: int, report: bool = True) -> None:
        self.thresholds = thresholds
        self.limiter = WarningLimiter(interval)
        self.max_new_tokens = max_new_tokens
        self.reports = report

    def check(self, metrics: dict[str, float], observations=None) -> list[Finding]:
        example = same_value = None
        if observations is not None:
            capped = [s for s in observations.samples if "length" in (s.get("finish_reasons") or ())]
            example = capped[0]["completion"] if capped else None
            counts: dict[float, int] = {}
            for summary in observations.summaries.values():
                for value, n in summary.same_reward_values.items():
                    counts[value] = counts.get(value, 0) + n
            same_value = max(sorted(counts), key=counts.__getitem__) if counts else None
        return check_failure_points(metrics, self.thresholds, self.max_new_tokens, example, same_value)

    def report(self, findings: Sequence[Finding], iteration: int) -> str | None:
        return self.limiter.report(findings, iteration) if self.reports else None
