"""Sample completions for the logs (``--rl-log-samples N``): which rollouts to show and how to render them.

Pure functions. A sample is a JSON-able dict (``env``, ``problem_id``, ``reward``, ``status``,
``failure_reason``, ``reward_components``, ``response_tokens``, ``turns``, ``finish_reasons``, ``prompt``,
``completion``); long texts are cut in the middle so both the start and the end stay visible. The choice is
deterministic: the ``N`` samples are dealt round-robin over the environments (sorted by name), and within an
environment spread evenly over its rollouts sorted by reward (failed ones first), so the lowest and the
highest reward both show, and a run that collapsed shows it in every sample.
"""
from __future__ import annotations

from typing import Any, Sequence

from megatron.rl.base.types import RolloutGroup

__all__ = ["rollout_sample", "sample_candidates", "select_samples", "spread_indices", "truncate_middle",
           "samples_markdown", "PROMPT_MAX_CHARS", "COMPLETION_MAX_CHARS"]

PROMPT_MAX_CHARS = 1000
COMPLETION_MAX_CHARS = 2000


def truncate_middle(text: str, max_chars: int) -> str:
    """``text`` if it fits, else its head and tail around a marker saying how much was cut (``<= max_chars``
    plus the marker's length)."""
    if len(text) <= max_chars:
        return text
    head = (max_chars * 2) // 3
    tail = max_chars - head
    return f"{text[:head]}[... {len(text) - head - tail} characters cut ...]{text[len(text) - tail:]}"


def _prompt_text(prompt: Any) -> str:
    if isinstance(prompt, str):
        return prompt
    lines = []
    for m in prompt:  # chat messages (ChatMessage models or dicts)
        role = m.get("role") if isinstance(m, dict) else m.role
        content = m.get("content") if isinstance(m, dict) else m.content
        lines.append(f"{role}: {content}")
    return "\n".join(lines)


def rollout_sample(rollout, env: str) -> dict[str, Any]:
    """The JSON-able view of one rollout shown in the logs (texts truncated)."""
    meta = rollout.metadata or {}
    return {
        "env": env,
        "problem_id": rollout.problem_id,
        "reward": float(rollout.reward),
        "status": rollout.status,
        "failure_reason": rollout.failure_reason,
        "reward_components": meta.get("reward_components"),
        "response_tokens": getattr(rollout, "num_generated_tokens", None),
        "turns": meta.get("num_turns"),
        "finish_reasons": meta.get("finish_reasons"),
        "prompt": truncate_middle(_prompt_text(rollout.prompt), PROMPT_MAX_CHARS),
        "completion": truncate_middle(rollout.completion, COMPLETION_MAX_CHARS),
    }


def spread_indices(n: int, k: int) -> list[int]:
    """``min(k, n)`` distinct indices spread evenly over ``range(n)``: both ends for k >= 2, the middle for k = 1."""
    k = min(k, n)
    if k <= 0:
        return []
    if k == 1:
        return [(n - 1) // 2]
    return [round(i * (n - 1) / (k - 1)) for i in range(k)]


def _order_key(sample: dict) -> tuple:
    return (sample["status"] == "ok", sample["reward"])


def select_samples(candidates: Sequence[dict], n: int) -> list[dict]:
    """``n`` samples (fewer if there are fewer candidates): round-robin over environments (sorted by name),
    spread over reward levels within each (see the module docstring). Ties keep the candidates' order, so
    the same candidates in the same order always give the same choice."""
    by_env: dict[str, list[dict]] = {}
    for c in candidates:
        by_env.setdefault(c["env"], []).append(c)
    envs = sorted(by_env)
    quota = dict.fromkeys(envs, 0)
    left = n
    while left > 0 and any(quota[e] < len(by_env[e]) for e in envs):
        for e in envs:
            if left > 0 and quota[e] < len(by_env[e]):
                quota[e] += 1
                left -= 1
    out = []
    for e in envs:
        ranked = sorted(by_env[e], key=_order_key)  # stable
        out.extend(ranked[i] for i in spread_indices(len(ranked), quota[e]))
    return out


def sample_candidates(groups: Sequence[RolloutGroup], n: int) -> list[dict]:
    """This rank's candidates: up to ``n`` per environment (chosen like :func:`select_samples`), so the final
    choice over all data-parallel ranks still sees every environment and its reward extremes."""
    if n <= 0:
        return []
    by_env: dict[str, list[dict]] = {}
    for g in groups:
        for r in g.rollouts:
            env = r.env_id or g.env_id or "unknown"
            by_env.setdefault(env, []).append(rollout_sample(r, env))
    return [s for env in sorted(by_env) for s in select_samples(by_env[env], n)]


def _fence(text: str) -> str:
    # A code block keeps whitespace visible (a completion of 8 spaces must not render as nothing).
    fence = "```"
    while fence in text:
        fence += "`"
    return f"{fence}\n{text}\n{fence}"


def samples_markdown(samples: Sequence[dict]) -> str:
    """Markdown for TensorBoard's text tab: one section per sample, texts in code blocks."""
    parts = []
    for i, s in enumerate(samples):
        head = (f"**{i + 1}. {s['env']}** problem `{s['problem_id']}` reward **{s['reward']:.4g}** "
                f"status {s['status']} tokens {s['response_tokens']}")
        if s.get("turns") not in (None, 1):
            head += f" turns {s['turns']}"
        if s.get("finish_reasons"):
            head += f" finish {','.join(s['finish_reasons'])}"
        if s.get("reward_components"):
            head += "  \ncomponents: " + ", ".join(f"{k} {v:.4g}" for k, v in s["reward_components"].items())
        if s.get("failure_reason"):
            head += f"  \nfailure: {s['failure_reason']}"
        parts.append(f"{head}\n\nprompt:\n\n{_fence(s['prompt'])}\n\ncompletion:\n\n{_fence(s['completion'])}")
    return "\n\n---\n\n".join(parts)
