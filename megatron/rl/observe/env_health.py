"""Training-health checks per environment: a collapse inside one environment of a mixture.

Each check pools an environment's :class:`~megatron.rl.observe.metrics.EnvSummary` over ``env_window``
iterations and runs once that holds at least 8 successful rollouts: ``answer_collapse/<env>``,
``same_reward/<env>``, ``length_cap/<env>``; trends in :func:`check_env_trends` and :func:`check_pass_at_1`.
Pure: summaries and thresholds in, findings out.

What each check means and why: docs/observe.md.
"""
from __future__ import annotations

import math
from typing import Sequence

from megatron.rl.observe.metrics import EnvSummary, merge_summaries, top_answer
from megatron.rl.observe.findings import Finding, WarningThresholds, window_means

__all__ = ["check_env_health", "check_env_trends", "check_pass_at_1", "quote_sample", "MIXTURE"]

MIXTURE = "mixture"  # the label of the checks over every environment together
_MIN_ANSWERS = 8  # fewer successful rollouts in a window say nothing about a share
_MIN_GROUPS = 2


def quote_sample(env: str, answer: str | None, samples: Sequence[dict]) -> str:
    """One sample of ``env`` for a message: a logged sample whose completion is ``answer`` if there is one,
    else any of the environment's, else the answer alone."""
    mine = [s for s in samples if s.get("env") == env or env == MIXTURE]
    match = [s for s in mine if answer is not None and s.get("completion", "").strip()[:len(answer)] == answer]
    chosen = (match or mine or [None])[0]
    if chosen is None:
        return f" e.g. the answer {answer[:120]!r}." if answer is not None else ""
    prompt = chosen.get("prompt", "")
    prompt = prompt if len(prompt) <= 120 else "..." + prompt[-117:]
    return (f" Sample ({chosen.get('env')}, problem {chosen.get('problem_id')}, reward {chosen.get('reward', 0):g}): "
            f"prompt {prompt!r} -> completion {chosen.get('completion', '')[:120]!r}.")


def _answer_collapse(env: str, s: EnvSummary, t: WarningThresholds, samples: Sequence[dict]) -> list[Finding]:
    top = top_answer(s)
    total = sum(s.answers.values())
    if top is None or total < _MIN_ANSWERS:
        return []
    answer, count = top
    share = count / total
    if share <= t.top_answer_share:
        return []
    who = "the mixture (all environments)" if env == MIXTURE else f"environment {env!r}"
    return [Finding(f"answer_collapse/{env}", share, t.top_answer_share, (
        f"{who}: {share:.0%} of its last {total} rollouts ({t.env_window} iterations) gave the same answer "
        f"{answer[:80]!r} ({len(s.answers)} distinct; > --rl-warn-top-answer-share={t.top_answer_share:g}): the "
        f"policy collapsed to a constant answer there, whatever the problem. Usual causes: an answer format that "
        f"a constant string games, or a learning rate too high for this environment (lower --lr)."
        f"{quote_sample(env, answer, samples)}"))]


def _same_reward(env: str, s: EnvSummary, t: WarningThresholds, samples: Sequence[dict]) -> list[Finding]:
    if s.scored_groups < _MIN_GROUPS:
        return []
    share = s.same_reward_groups / s.scored_groups
    if share <= t.same_reward_share:
        return []
    common = max(sorted(s.same_reward_values), key=s.same_reward_values.__getitem__) if s.same_reward_values else None
    value = "" if common is None else f", most often {common:g}"
    top = top_answer(s)
    return [Finding(f"same_reward/{env}", share, t.same_reward_share, (
        f"environment {env!r}: {share:.0%} of its groups over the last {t.env_window} iterations got the same reward "
        f"for every rollout{value} (> --rl-warn-same-reward-share={t.same_reward_share:g}), while the mixture's "
        f"share may look healthy: this environment teaches nothing (a task too hard or too easy, or generations "
        f"that collapsed).{quote_sample(env, top[0] if top else None, samples)}"))]


def _length_cap(env: str, s: EnvSummary, t: WarningThresholds, samples: Sequence[dict]) -> list[Finding]:
    if s.ok < _MIN_ANSWERS:
        return []
    share = s.length_capped / s.ok
    if share <= t.length_cap_share:
        return []
    return [Finding(f"length_cap/{env}", share, t.length_cap_share, (
        f"environment {env!r}: {share:.0%} of its responses over the last {t.env_window} iterations stopped at the "
        f"length cap (> --rl-warn-length-cap-share={t.length_cap_share:g}): the policy rambles or repeats itself "
        f"there.{quote_sample(env, None, samples)}"))]


def check_env_health(window: Sequence[dict[str, EnvSummary]], thresholds: WarningThresholds,
                     samples: Sequence[dict] = ()) -> list[Finding]:
    """Per-environment findings over ``window``: the summaries of the last iterations, oldest first (checked
    only once it holds ``thresholds.env_window`` of them). ``samples``: the latest iteration's logged samples,
    one of which each message quotes."""
    if thresholds.env_window < 1 or len(window) < thresholds.env_window:
        return []
    pooled = merge_summaries(window[-thresholds.env_window:])
    mixture = len(pooled) > 1
    out: list[Finding] = []
    for env in sorted(pooled):
        s = pooled[env]
        out += _answer_collapse(env, s, thresholds, samples)
        if mixture:
            out += _same_reward(env, s, thresholds, samples) + _length_cap(env, s, thresholds, samples)
    if mixture:
        out += _answer_collapse(MIXTURE, _total(pooled), thresholds, samples)
    return out


def _total(summaries: dict[str, EnvSummary]) -> EnvSummary:
    total = EnvSummary()
    for env in sorted(summaries):
        total.add(summaries[env])
    return total


def check_env_trends(history: dict[str, Sequence[float]], thresholds: WarningThresholds) -> list[Finding]:
    """``entropy_collapse/<env>``: an environment's windowed ``env/<env>/sampled_entropy`` (``trend_window``
    iterations) fell below ``entropy_drop`` times its first window's. (Its reward trend is
    ``reward_drop/<env>`` in :func:`megatron.rl.observe.warnings.check_trends`.)"""
    w = thresholds.trend_window
    out = []
    for key in sorted(history):
        if not (key.startswith("env/") and key.endswith("/sampled_entropy")):
            continue
        env = key[len("env/"):-len("/sampled_entropy")]
        means = window_means(history[key], w)
        if means is not None and means[1] < thresholds.entropy_drop * means[0]:
            first, last = means
            out.append(Finding(f"entropy_collapse/{env}", last, thresholds.entropy_drop * first, (
                f"environment {env!r}: the sampled tokens' entropy fell from {first:.3g} (first {w} iterations) to "
                f"{last:.3g} (last {w}), below --rl-warn-entropy-drop={thresholds.entropy_drop:g} of where it "
                f"started: the policy is collapsing onto a few answers there.")))
    return out


def check_pass_at_1(first: dict[str, float], latest: dict[str, float], thresholds: WarningThresholds) -> list[Finding]:
    """``pass_at_1_drop/<env>`` (``/mixture`` for the mean over environments): the latest evaluation's held-out
    pass@1 is more than ``pass_at_1_drop`` below the run's first evaluation of it. ``first`` / ``latest``:
    evaluation metrics (``eval/<env>/pass@1``, ``eval/pass@1``)."""
    out = []
    for key in sorted(latest):
        if not (key.startswith("eval/") and key.endswith("pass@1")) or key not in first:
            continue
        start, now = first[key], latest[key]
        if not (math.isfinite(start) and math.isfinite(now)) or start - now <= thresholds.pass_at_1_drop:
            continue
        env = key[len("eval/"):-len("/pass@1")] if key != "eval/pass@1" else MIXTURE
        who = "the mixture (mean over environments)" if env == MIXTURE else f"environment {env!r}"
        out.append(Finding(f"pass_at_1_drop/{env}", start - now, thresholds.pass_at_1_drop, (
            f"{who}: held-out pass@1 fell from {start:.3f} (first evaluation) to {now:.3f}, more than "
            f"--rl-warn-pass-at-1-drop={thresholds.pass_at_1_drop:g} below where the run started: the policy got "
            f"worse at it (lower --lr, or look at this environment's samples).")))
    return out
