"""Per-environment rollout metrics and sample completions of an RL iteration.

:func:`summarize_groups` (pure) counts what each environment's groups did; :func:`merge_summaries` adds ranks'
summaries; :func:`summary_metrics` turns them into flat ``env/<name>/...`` metrics; :func:`format_env_line` is the
short form. Must not hold a process group: the gather is the trainer's one all-gather of rollouts. Means are over
successful rollouts; failed ones are counted.

Definitions of every metric: docs/observe.md.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Sequence

from megatron.rl.observe.samples import sample_candidates, select_samples
from megatron.rl.base.types import RolloutGroup

__all__ = ["ANSWER_KEY_CHARS", "answer_key", "EnvSummary", "RolloutObservations", "summarize_groups",
           "merge_summaries", "top_answer", "health_metrics", "summary_metrics",
           "format_env_line", "is_length_capped", "local_observations", "merge_observations"]


ANSWER_KEY_CHARS = 200  # enough to tell short answers apart, small enough to gather every rank's


def answer_key(rollout) -> str:
    """What the answer-diversity counts compare (see the module docstring)."""
    answer = (rollout.metadata or {}).get("extracted_answer")
    text = rollout.completion if answer is None else str(answer)
    return text.strip()[:ANSWER_KEY_CHARS]


@dataclasses.dataclass
class EnvSummary:
    """Counts and sums over one environment's groups (additive across ranks)."""

    groups: int = 0
    rollouts: int = 0
    ok: int = 0
    failed: int = 0
    reward_sum: float = 0.0
    length_sum: int = 0
    turns_sum: int = 0
    length_capped: int = 0
    scored_groups: int = 0  # groups with >= 2 ok rollouts
    same_reward_groups: int = 0
    same_reward_values: dict[float, int] = dataclasses.field(default_factory=dict)  # constant reward -> groups
    # metadata["reward_components"] of ok rollouts (name -> [sum, count]); metadata["failure_kind"] of failed ones
    components: dict[str, list[float]] = dataclasses.field(default_factory=dict)
    failure_kinds: dict[str, int] = dataclasses.field(default_factory=dict)
    answers: dict[str, int] = dataclasses.field(default_factory=dict)  # answer_key of ok rollouts -> count
    neg_logprob_sum: float = 0.0  # over generated tokens with an inference log-prob
    logprob_tokens: int = 0
    rewards: list[float] = dataclasses.field(default_factory=list)  # of ok rollouts, for the run-wide spread
    failure_reasons: dict[str, int] = dataclasses.field(default_factory=dict)  # failed rollouts' reasons (80 chars)

    def add(self, other: "EnvSummary") -> None:
        for f in dataclasses.fields(self):
            if f.name not in ("same_reward_values", "components", "failure_kinds", "answers", "failure_reasons"):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        for reason, c in other.failure_reasons.items():
            self.failure_reasons[reason] = self.failure_reasons.get(reason, 0) + c
        for v, c in other.same_reward_values.items():
            self.same_reward_values[v] = self.same_reward_values.get(v, 0) + c
        for a, c in other.answers.items():
            self.answers[a] = self.answers.get(a, 0) + c
        for name, (value_sum, count) in other.components.items():
            mine = self.components.setdefault(name, [0.0, 0])
            mine[0] += value_sum
            mine[1] += count
        for kind, c in other.failure_kinds.items():
            self.failure_kinds[kind] = self.failure_kinds.get(kind, 0) + c


def is_length_capped(rollout, max_new_tokens: int) -> bool:
    """Whether any turn of the rollout stopped at the token budget (see the module docstring)."""
    reasons = (rollout.metadata or {}).get("finish_reasons")
    if reasons:
        return "length" in reasons
    return getattr(rollout, "num_generated_tokens", 0) >= max_new_tokens


def summarize_groups(groups: Sequence[RolloutGroup], max_new_tokens: int) -> dict[str, EnvSummary]:
    """``{env: EnvSummary}`` over ``groups`` (the env is the group's ``env_id``, else its first rollout's)."""
    out: dict[str, EnvSummary] = {}
    for g in groups:
        env = g.env_id or next((r.env_id for r in g.rollouts if r.env_id), "") or "unknown"
        s = out.setdefault(env, EnvSummary())
        s.groups += 1
        ok = [r for r in g.rollouts if r.ok]
        s.rollouts += len(g.rollouts)
        s.ok += len(ok)
        s.failed += len(g.rollouts) - len(ok)
        for r in ok:
            s.reward_sum += r.reward
            s.rewards.append(r.reward)
            s.length_sum += getattr(r, "num_generated_tokens", 0)
            s.turns_sum += int((r.metadata or {}).get("num_turns", 1))
            s.length_capped += is_length_capped(r, max_new_tokens)
            key = answer_key(r)
            s.answers[key] = s.answers.get(key, 0) + 1
            logprobs = getattr(r, "generated_logprobs", None)  # TokenRollout only
            if logprobs:
                s.neg_logprob_sum -= sum(logprobs)
                s.logprob_tokens += len(logprobs)
            for name, value in ((r.metadata or {}).get("reward_components") or {}).items():
                acc = s.components.setdefault(str(name), [0.0, 0])
                acc[0] += float(value)
                acc[1] += 1
        for r in (r for r in g.rollouts if not r.ok):
            reason = (r.failure_reason or "unknown")[:80]
            s.failure_reasons[reason] = s.failure_reasons.get(reason, 0) + 1
            kind = (r.metadata or {}).get("failure_kind")
            if kind:
                s.failure_kinds[str(kind)] = s.failure_kinds.get(str(kind), 0) + 1
        if len(ok) >= 2:
            s.scored_groups += 1
            if all(r.reward == ok[0].reward for r in ok):
                s.same_reward_groups += 1
                s.same_reward_values[ok[0].reward] = s.same_reward_values.get(ok[0].reward, 0) + 1
    return out


def merge_summaries(parts: Sequence[dict[str, EnvSummary]]) -> dict[str, EnvSummary]:
    """Add per-rank summaries environment by environment (in the order given: deterministic sums)."""
    out: dict[str, EnvSummary] = {}
    for part in parts:
        for env, s in part.items():
            out.setdefault(env, EnvSummary()).add(s)
    return out


def _mean(total: float, count: int) -> float:
    return total / count if count else float("nan")


def top_answer(s: EnvSummary) -> tuple[str, int] | None:
    """The most common answer and its count (ties: the first in sorted order), None without ok rollouts."""
    if not s.answers:
        return None
    best = max(sorted(s.answers), key=s.answers.__getitem__)
    return best, s.answers[best]


def health_metrics(s: EnvSummary, prefix: str) -> dict[str, float]:
    """An environment's health numbers (``<prefix>same_reward_group_fraction``, ``distinct_answers``,
    ``top_answer_share``, ``sampled_entropy``), each only when measured (no NaN placeholders)."""
    out: dict[str, float] = {}
    if s.scored_groups:
        out[prefix + "same_reward_group_fraction"] = s.same_reward_groups / s.scored_groups
    top = top_answer(s)
    if top is not None:
        out[prefix + "distinct_answers"] = float(len(s.answers))
        out[prefix + "top_answer_share"] = top[1] / sum(s.answers.values())
    if s.logprob_tokens:
        out[prefix + "sampled_entropy"] = s.neg_logprob_sum / s.logprob_tokens
    return out


def summary_metrics(summaries: dict[str, EnvSummary]) -> dict[str, float]:
    """Flat metrics: ``env/<name>/{groups,reward_mean,response_length_mean,failed_rollouts,turns_mean,
    length_capped_fraction}`` per environment plus its :func:`health_metrics` (and ``reward/<component>``: the
    mean of each reward component agents report, and ``failures/<kind>``: failed rollouts by the kind agents
    report), and run-wide ``turns_per_episode_mean``, ``length_capped_fraction``, ``same_reward_groups``,
    ``same_reward_group_fraction``."""
    out: dict[str, float] = {}
    total = EnvSummary()
    for env in sorted(summaries):
        s = summaries[env]
        total.add(s)
        p = f"env/{env}/"
        out[p + "groups"] = float(s.groups)
        out[p + "reward_mean"] = _mean(s.reward_sum, s.ok)
        out[p + "response_length_mean"] = _mean(s.length_sum, s.ok)
        out[p + "failed_rollouts"] = float(s.failed)
        out[p + "turns_mean"] = _mean(s.turns_sum, s.ok)
        out[p + "length_capped_fraction"] = _mean(s.length_capped, s.ok)
        out.update(health_metrics(s, p))
        for name, (value_sum, count) in sorted(s.components.items()):
            out[f"{p}reward/{name}"] = _mean(value_sum, int(count))
        for kind, count in sorted(s.failure_kinds.items()):
            out[f"{p}failures/{kind}"] = float(count)
    out["turns_per_episode_mean"] = _mean(total.turns_sum, total.ok)
    out["length_capped_fraction"] = _mean(total.length_capped, total.ok)
    out["same_reward_groups"] = float(total.same_reward_groups)
    out["same_reward_group_fraction"] = _mean(total.same_reward_groups, total.scored_groups)
    return out


def format_env_line(metrics: dict[str, float]) -> str:
    """The per-environment part of the iteration line: ``envs: a 12g r=0.5 len=7.2, b 4g r=0.1 len=30 fail=2``;
    empty for a single environment (the line's overall numbers are its numbers)."""
    envs = sorted({k.split("/")[1] for k in metrics if k.startswith("env/") and k.endswith("/groups")})
    if len(envs) < 2:
        return ""
    parts = []
    for env in envs:
        m = {k.rsplit("/", 1)[1]: v for k, v in metrics.items() if k.startswith(f"env/{env}/")}
        part = f"{env} {int(m['groups'])}g r={m['reward_mean']:.3g} len={m['response_length_mean']:.3g}"
        if m.get("turns_mean", 1.0) != 1.0 and math.isfinite(m.get("turns_mean", 1.0)):
            part += f" turns={m['turns_mean']:.3g}"
        if m.get("failed_rollouts"):
            part += f" fail={int(m['failed_rollouts'])}"
        parts.append(part)
    return "envs: " + ", ".join(parts)


@dataclasses.dataclass
class RolloutObservations:
    """What :func:`observe_rollouts` found over all DP ranks (identical on every rank)."""

    metrics: dict[str, float]
    summaries: dict[str, EnvSummary]
    samples: list[dict]


def local_observations(groups: Sequence[RolloutGroup], max_new_tokens: int,
                       num_samples: int) -> tuple[dict[str, EnvSummary], list]:
    """This rank's part of the observations: its summaries and its sample candidates (small, picklable)."""
    return summarize_groups(groups, max_new_tokens), sample_candidates(groups, num_samples)


def merge_observations(parts: Sequence[tuple[dict[str, EnvSummary], list]], num_samples: int) -> RolloutObservations:
    """Every rank's :func:`local_observations` (in rank order) -> the metrics, summaries and samples of all ranks."""
    summaries = merge_summaries([s for s, _ in parts])
    samples = select_samples([c for _, cands in parts for c in cands], num_samples)
    return RolloutObservations(summary_metrics(summaries), summaries, samples)
