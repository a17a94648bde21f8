"""Warnings at the classic failure points of an RL run, read off each iteration's metrics.

Same reward, length cap, log-prob gap, off-policy drift (asynchronous rollouts), trends over a window, and the
per-environment checks of :mod:`megatron.rl.observe.env_health`. :func:`check_failure_points` and
:func:`check_trends` are pure; :class:`WarningLimiter` repeats a persisting condition only every ``interval``
iterations and logs at most one warning record per iteration.

What each warning means: docs/observe.md.
"""
from __future__ import annotations

import collections
import logging
import math
from typing import Sequence

from megatron.rl.observe.env_health import check_env_health, check_env_trends, check_pass_at_1
from megatron.rl.observe.findings import Finding, WarningThresholds, finite as _finite, window_means

__all__ = ["Finding", "WarningThresholds", "check_failure_points", "check_trends", "WarningLimiter", "warning_metrics",
           "RunWarnings"]

log = logging.getLogger(__name__)


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
    asynchronous = "staleness_mean" in metrics
    # asynchronous: the tokens the trained policy generated itself (stale ones differ by design)
    gap = _finite(metrics, "logprob_gap_fresh_mean" if asynchronous else "logprob_gap_mean")
    if gap is not None and gap > thresholds.logprob_gap:
        worst = _finite(metrics, "logprob_gap_fresh_max" if asynchronous else "logprob_gap_max")
        worst_text = f", max {worst:.3g}" if worst is not None else ""
        out.append(Finding("logprob_gap", gap, thresholds.logprob_gap, (
            f"the train-inference log-prob gap is {gap:.3g} nats per generated token{worst_text} (> "
            f"{thresholds.logprob_gap:g}, --rl-warn-logprob-gap): the rollouts come from a different policy than "
            f"the one being trained. Check that the inference server serves the trained weights (refit), the "
            f"same tokenizer / chat template, and samples at --rl-default-temperature (the trainer scores at it).")))
    if asynchronous:
        out += _off_policy(metrics, thresholds)
    return out


def _off_policy(metrics: dict[str, float], thresholds: WarningThresholds) -> list[Finding]:
    """Asynchronous rollouts: how far the trained tokens' policy is from the one being updated."""
    kl, trunc = _finite(metrics, "mismatch_kl_k3"), _finite(metrics, "is_truncated_fraction")
    if not ((kl is not None and kl > thresholds.off_policy_kl)
            or (trunc is not None and trunc > thresholds.is_truncated_share)):
        return []
    weight, masked = _finite(metrics, "is_weight_mean"), _finite(metrics, "is_masked_fraction")
    stale = _finite(metrics, "off_policy_token_share")
    parts = [f"KL {kl:.3g} nats per token (k3)" if kl is not None else None,
             f"importance weights mean {weight:.3f}" if weight is not None else None,
             f"{trunc:.1%} truncated" if trunc else None, f"{masked:.1%} outside the trust region" if masked else None,
             f"{stale:.0%} of the tokens stale" if stale is not None else None]
    value = kl if kl is not None else trunc
    return [Finding("off_policy", value, thresholds.off_policy_kl, (
        f"asynchronous rollouts drift off-policy: the policy being updated is far from the one that generated the "
        f"trained tokens ({', '.join(p for p in parts if p)}; > --rl-warn-off-policy-kl={thresholds.off_policy_kl:g}"
        f" or more than {thresholds.is_truncated_share:.0%} truncated), where the synchronous path trains at ~0. "
        f"Updates this large on stale tokens can feed on themselves (falling reward, collapsing entropy): lower --lr "
        f"(or warm it up: Adam's first updates are its largest, --lr-warmup-iters) or --rl-generation-lag, and keep "
        f"the update around the sampling policy (--rl-importance-sampling-mode trust_region, the default for "
        f"asynchronous rollouts)."))]


def check_trends(history: dict[str, Sequence[float]], thresholds: WarningThresholds,
                 asynchronous: bool = False) -> list[Finding]:
    """Trend findings from a run's per-iteration history (``{metric: [value per iteration]}``).

    ``reward_drop/<env>``: the mean of ``env/<env>/reward_mean`` over the last ``trend_window`` iterations is more
    than ``reward_drop`` below its mean over the first window (``reward_mean`` for a run without per-environment
    metrics). ``entropy_collapse``: the windowed ``entropy_mean`` fell below ``entropy_drop`` times its first
    window's. ``asynchronous`` adds the asynchronous remedies to the messages.
    """
    w = thresholds.trend_window
    hint = (" With asynchronous rollouts this is what the synchronous path usually does not do: compare a run "
            "without --rl-generation-lag / --rl-partial-rollouts, or lower --lr." if asynchronous else "")
    out = []
    rewards = {k.split("/")[1]: v for k, v in history.items() if k.startswith("env/") and k.endswith("/reward_mean")}
    if not rewards and "reward_mean" in history:
        rewards = {"all": history["reward_mean"]}
    for env, values in sorted(rewards.items()):
        means = window_means(values, w)
        if means is not None and means[0] - means[1] > thresholds.reward_drop:
            first, last = means
            out.append(Finding(f"reward_drop/{env}", first - last, thresholds.reward_drop, (
                f"the training reward of {env!r} fell from {first:.3f} (first {w} iterations) to {last:.3f} (last "
                f"{w}), more than --rl-warn-reward-drop={thresholds.reward_drop:g} below where the run started: the "
                f"policy got worse at it.{hint}")))
    means = window_means(history.get("entropy_mean", ()), w)
    if means is not None and means[1] < thresholds.entropy_drop * means[0]:
        first, last = means
        out.append(Finding("entropy_collapse", last, thresholds.entropy_drop * first, (
            f"the policy's entropy fell from {first:.3g} (first {w} iterations) to {last:.3g} (last {w}), below "
            f"--rl-warn-entropy-drop={thresholds.entropy_drop:g} of where it started: it is collapsing onto a few "
            f"answers.{hint}")))
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
    """The checks of one run. :meth:`check` finds an iteration's failure points, run-wide and per environment
    (quoting samples and the most common constant reward from its
    :class:`~megatron.rl.observe.metrics.RolloutObservations`); :meth:`check_eval` compares an evaluation's
    pass@1 with the run's first; :meth:`report` logs what the limiter admits when this process reports
    (``report``: rank 0). Every rank computes the same findings (the observations are gathered over DP)."""

    def __init__(self, thresholds: WarningThresholds, interval: int, max_new_tokens: int, report: bool = True) -> None:
        self.thresholds = thresholds
        self.limiter = WarningLimiter(interval)
        self.max_new_tokens = max_new_tokens
        self.reports = report
        # the trend checks' history of each watched metric: its first window (where the run started) and a sliding
        # window of the latest values
        self._first: dict[str, list[float]] = {}
        self._recent: dict[str, list[float]] = {}
        # the per-environment checks' window: each iteration's summaries per environment
        self._env_window: collections.deque = collections.deque(maxlen=max(thresholds.env_window, 1))
        self._first_eval: dict[str, float] = {}

    @staticmethod
    def _watched(key: str) -> bool:
        return key in ("reward_mean", "entropy_mean") or (key.startswith("env/") and (
            key.endswith("/reward_mean") or key.endswith("/sampled_entropy")))

    def _record(self, metrics: dict[str, float]) -> dict[str, list[float]]:
        w = self.thresholds.trend_window
        for key, value in metrics.items():
            if self._watched(key):
                if value is None or not math.isfinite(value):
                    continue  # an iteration without a successful rollout of it: no point, not a window slot
                first = self._first.setdefault(key, [])
                if len(first) < w:
                    first.append(value)
                else:
                    recent = self._recent.setdefault(key, [])
                    recent.append(value)
                    del recent[:-w]
        return {k: v + self._recent.get(k, []) for k, v in self._first.items()}

    def check(self, metrics: dict[str, float], observations=None) -> list[Finding]:
        example = same_value = None
        per_env: list[Finding] = []
        if observations is not None:
            capped = [s for s in observations.samples if "length" in (s.get("finish_reasons") or ())]
            example = capped[0]["completion"] if capped else None
            counts: dict[float, int] = {}
            for summary in observations.summaries.values():
                for value, n in summary.same_reward_values.items():
                    counts[value] = counts.get(value, 0) + n
            same_value = max(sorted(counts), key=counts.__getitem__) if counts else None
            self._env_window.append(observations.summaries)
            per_env = check_env_health(list(self._env_window), self.thresholds, observations.samples)
        history = self._record(metrics)
        return (check_failure_points(metrics, self.thresholds, self.max_new_tokens, example, same_value)
                + check_trends(history, self.thresholds, asynchronous="staleness_mean" in metrics)
                + per_env + check_env_trends(history, self.thresholds))

    def check_eval(self, metrics: dict[str, float]) -> list[Finding]:
        """Held-out pass@1 of each environment (and their mean) against the run's first evaluation of it."""
        for key, value in metrics.items():
            if key.startswith("eval/") and key.endswith("pass@1") and math.isfinite(value):
                self._first_eval.setdefault(key, value)
        return check_pass_at_1(self._first_eval, metrics, self.thresholds)

    def report(self, findings: Sequence[Finding], iteration: int) -> str | None:
        return self.limiter.report(findings, iteration) if self.reports else None
