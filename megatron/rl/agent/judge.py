"""A generative judge: a model asked to grade each completion, its answer parsed into a score.

``JudgeConfig`` is the ``judge:`` section of a ``type: model_reward`` entry. The judge is any
:class:`~megatron.rl.inference.api.InferenceInterface`. Every completion gets a :class:`JudgeVerdict`: a score in
[0, 1], or the reason there is none. Must not: turn a failed or unparsable verdict into a reward; such a rollout
fails (a judge outage never reads as a reward of 0).

YAML section and fields: docs/agents.md.
"""
from __future__ import annotations

import asyncio
import re
import string
from typing import Sequence

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from megatron.rl.agent.api import InferenceSpec
from megatron.rl.inference.api import ChatMessage, GenerationArgs, InferenceInterface, InferenceRequest

__all__ = ["JudgeConfig", "JudgeVerdict", "judge_completions", "parse_score", "check_template", "prompt_as_text"]

DEFAULT_TEMPLATE = ("Rate how good the answer is, from 0 (wrong or useless) to 10 (correct and complete).\n"
                    "Question: {prompt}\nAnswer: {completion}\nReply with \"SCORE: <0-10>\" only.")


def check_template(template: str, allowed: Sequence[str], where: str) -> str:
    """``template`` if its ``{fields}`` are all in ``allowed`` (no attribute access, no format specs)."""
    try:
        parsed = list(string.Formatter().parse(template))
    except ValueError as e:
        raise ValueError(f"{where} is not a valid template: {e}") from None
    for _, name, spec, conv in parsed:
        if name is not None and (name not in allowed or spec or conv):
            raise ValueError(f"{where} field {{{name}}} is not allowed: use {', '.join('{%s}' % a for a in allowed)} "
                             "(write {{ and }} for literal braces)")
    return template


class JudgeConfig(BaseModel):
    """A judge's YAML section (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")

    inference: InferenceSpec | None = None
    weight: float = Field(default=1.0, allow_inf_nan=False)
    template: str = DEFAULT_TEMPLATE
    score_regex: str = r"SCORE:\s*(-?\d+(?:\.\d+)?)"
    score_range: tuple[float, float] = (0.0, 10.0)
    chat: bool = False
    max_tokens: int = Field(default=32, ge=1)
    temperature: float = Field(default=0.0, ge=0.0)
    batch_size: int = Field(default=32, ge=1)
    timeout_s: float | None = Field(default=120.0, gt=0, allow_inf_nan=False)

    @field_validator("template")
    @classmethod
    def _fields(cls, v: str) -> str:
        return check_template(v, ("prompt", "completion"), "judge.template")

    @field_validator("score_regex")
    @classmethod
    def _one_group(cls, v: str) -> str:
        try:
            pattern = re.compile(v)
        except re.error as e:
            raise ValueError(f"judge.score_regex {v!r} does not compile: {e}") from None
        if pattern.groups < 1:
            raise ValueError(f"judge.score_regex {v!r} needs a group around the score, e.g. 'SCORE: (\\d+)'")
        return v

    @model_validator(mode="after")
    def _range(self) -> "JudgeConfig":
        lo, hi = self.score_range
        if not lo < hi:
            raise ValueError(f"judge.score_range must be [low, high] with low < high, got {list(self.score_range)}")
        return self


class JudgeVerdict(BaseModel):
    """One completion's verdict: ``score`` in [0, 1], or ``error`` (why there is none) and its ``kind``
    (``judge_error``: the request failed; ``judge_timeout``; ``judge_unparsable``: no score in the answer)."""

    score: float | None = None
    error: str | None = None
    kind: str | None = None
    answer: str = ""


def parse_score(answer: str, pattern: re.Pattern, score_range: tuple[float, float]) -> float:
    """The last match of ``pattern`` in ``answer`` mapped from ``score_range`` to [0, 1]; ValueError if none."""
    matches = list(pattern.finditer(answer))
    if not matches:
        raise ValueError("no score in the judge's answer")
    raw = matches[-1].group(1)
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"the judge's score {raw[:40]!r} is not a number") from None
    lo, hi = score_range
    if not lo <= value <= hi:  # also rejects nan
        raise ValueError(f"the judge's score {value:g} is outside score_range [{lo:g}, {hi:g}]")
    return (value - lo) / (hi - lo)


def prompt_as_text(prompt: str | list) -> str:
    """A rollout's prompt as text: itself, or chat messages as ``role: content`` lines."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.role if hasattr(m, 'role') else m['role']}: "
                     f"{m.content if hasattr(m, 'content') else m['content']}" for m in prompt)


def _clip(text: str, limit: int = 120) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


async def judge_completions(config: JudgeConfig, iface: InferenceInterface,
                            pairs: Sequence[tuple[str | list, str]]) -> list[JudgeVerdict]:
    """A verdict for each ``(prompt, completion)`` pair, in order; batches of ``batch_size`` run concurrently."""
    pattern = re.compile(config.score_regex)
    ga = GenerationArgs(temperature=config.temperature, max_tokens=config.max_tokens, seed=0)

    def request(prompt: str | list, completion: str) -> InferenceRequest:
        text = config.template.format_map({"prompt": prompt_as_text(prompt), "completion": completion})
        if config.chat:
            return InferenceRequest(messages=[ChatMessage(role="user", content=text)], generation_args=ga)
        return InferenceRequest(prompt=text, generation_args=ga)

    async def batch(items: Sequence[tuple[str | list, str]]) -> list[JudgeVerdict]:
        try:
            responses = await asyncio.wait_for(iface.agenerate([request(p, c) for p, c in items]),
                                               timeout=config.timeout_s)
        except asyncio.TimeoutError:
            return [JudgeVerdict(error=f"judge: no answer within timeout_s={config.timeout_s}", kind="judge_timeout")
                    for _ in items]
        except Exception as e:  # noqa: BLE001 - an unreachable judge fails these rollouts, not the run
            return [JudgeVerdict(error=f"judge: {type(e).__name__}: {_clip(str(e), 300)}", kind="judge_error")
                    for _ in items]
        if len(responses) != len(items):
            return [JudgeVerdict(error=f"judge: the backend returned {len(responses)} answers for {len(items)} "
                                       "requests", kind="judge_error") for _ in items]
        out = []
        for resp in responses:
            if resp.finish_reason == "error":
                out.append(JudgeVerdict(error=f"judge: inference error: {_clip(str(resp.error), 300)}",
                                        kind="judge_error"))
                continue
            try:
                out.append(JudgeVerdict(score=parse_score(resp.text, pattern, config.score_range), answer=resp.text))
            except ValueError as e:
                out.append(JudgeVerdict(error=f"judge: {e}: {_clip(resp.text)!r}", kind="judge_unparsable",
                                        answer=resp.text))
        return out

    size = config.batch_size
    chunks = await asyncio.gather(*[batch(pairs[i:i + size]) for i in range(0, len(pairs), size)])
    return [v for chunk in chunks for v in chunk]
