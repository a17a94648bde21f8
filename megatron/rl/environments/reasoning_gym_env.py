"""``type: reasoning_gym``: any reasoning-gym task (procedural generators with their own answer scoring).

:class:`ReasoningGymAgent` builds a task's problems locally from a seed (nothing is downloaded), renders the
prompt (``{question}`` and the instruction, or ``prompt_template``) and rewards with the task's own
``score_answer`` on the answer the completion committed to (:mod:`megatron.rl.agent.answers`). Problems
come from a :class:`PromptStream` like every built-in agent; validation problems from a second seed.
``reasoning_gym`` loads through ``import_optional`` (``pip install 'megatron-rl[envs]'``). Configuration and
answer formats: docs/environments.md.
"""
from __future__ import annotations

import hashlib
import re
import string
from typing import Any

from pydantic import Field, PrivateAttr, field_validator, model_validator

from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent
from megatron.rl.base.optional import import_optional
from megatron.rl.agent.answers import AnswerFormat, extract_answer

__all__ = ["ReasoningGymAgent", "extract_answer", "render_prompt"]

_FIELD = re.compile(r"question|instruction|metadata\[[A-Za-z0-9_]+\]")


def render_prompt(template: str, entry: dict[str, Any], instruction: str,
                  replacements: dict[str, str] | None = None) -> str:
    """``template`` with ``{question}``, ``{instruction}`` and ``{metadata[KEY]}`` filled from ``entry``; the
    task's texts (question, metadata strings) first get ``replacements`` (literal, in order)."""
    def fix(text: Any) -> Any:
        if isinstance(text, str):
            for old, new in (replacements or {}).items():
                text = text.replace(old, new)
        return text

    metadata = {k: fix(v) for k, v in (entry.get("metadata") or {}).items()}
    return template.format_map({"question": fix(entry["question"]), "instruction": instruction, "metadata": metadata})


def _check_template(template: str) -> str:
    for _, name, spec, conv in string.Formatter().parse(template):
        if name is None:
            continue
        if not _FIELD.fullmatch(name) or spec or conv:
            raise ValueError(f"prompt_template field {{{name}}} is not allowed: use {{question}}, {{instruction}} "
                             "or {metadata[KEY]}")
    return template


@Agent.register_subclass("reasoning_gym")
class ReasoningGymAgent(PassAtEvaluationAgent):
    """A reasoning-gym task as an environment (see the module docstring).

    task: the reasoning-gym dataset name. config: its config fields (not ``seed`` / ``size``: see below).
    size / validation_size: problems in the training epoch / validation split. instruction: appended to the
    question on its own line (None: none). prompt_template: the whole prompt (None: question + instruction).
    prompt_replacements: literal ``{old: new}`` replacements applied to the task's texts before they fill the
    prompt, in order (e.g. ``{" ": ""}`` writes ``3 + 5`` as ``3+5``, the format a small model was pretrained on).
    answer_format: what the committed text (up to the first ``stop`` string) must be: ``text`` (any, stripped),
    ``number`` (one number), ``tag`` (the last ``<answer>...</answer>``). answer_regex: instead, a pattern that
    must match the whole stripped committed text (group 1, else the match, is the answer). chat: send the prompt
    as one user message (rendered with the model's chat template) instead of plain text.
    """

    task: str
    config: dict[str, Any] = Field(default_factory=dict)
    size: int = Field(default=10_000, ge=1)
    validation_size: int = Field(default=200, ge=1)
    instruction: str | None = None
    prompt_template: str | None = None
    prompt_replacements: dict[str, str] = Field(default_factory=dict)
    answer_format: AnswerFormat = "text"
    answer_regex: str | None = None
    chat: bool = False

    _datasets: dict[tuple[int, bool], Any] = PrivateAttr(default_factory=dict)
    _pattern: re.Pattern | None = PrivateAttr(default=None)

    @field_validator("config")
    @classmethod
    def _no_seed_or_size(cls, v: dict[str, Any]) -> dict[str, Any]:
        taken = sorted({"seed", "size"} & set(v))
        if taken:
            raise ValueError(f"config must not set {taken}: use the agent's seed / size / validation_size fields")
        return v

    @field_validator("prompt_template")
    @classmethod
    def _template_fields(cls, v: str | None) -> str | None:
        return None if v is None else _check_template(v)

    @field_validator("answer_regex")
    @classmethod
    def _compiles(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"answer_regex {v!r} does not compile: {e}") from None
        return v

    @model_validator(mode="after")
    def _one_answer_rule(self) -> "ReasoningGymAgent":
        if self.answer_regex is not None and self.answer_format != "text":
            raise ValueError(f"answer_format {self.answer_format!r} and answer_regex {self.answer_regex!r}: give "
                             f"one (the regex already says what the committed text must be)")
        return self

    def model_post_init(self, context: Any) -> None:
        # Fail at configuration time: the package is missing, the task unknown or its config invalid.
        rg = import_optional("reasoning_gym", "envs", "type: reasoning_gym")
        names = sorted(getattr(getattr(rg, "factory", None), "DATASETS", {}) or [])
        if names and self.task not in names:
            close = [n for n in names if self.task.lower() in n or n in self.task.lower()][:8]
            raise ValueError(f"reasoning-gym has no task {self.task!r}" + (f" (close: {close})" if close else "")
                             + f"; {len(names)} tasks, e.g. {names[:6]}")
        self._pattern = re.compile(self.answer_regex) if self.answer_regex else None
        sample = self._build(self.seed, size=1)[0]
        if self.prompt_template is not None:
            try:
                render_prompt(self.prompt_template, sample, self.instruction or "")
            except (KeyError, IndexError, TypeError) as e:
                raise ValueError(f"prompt_template {self.prompt_template!r} does not fit task {self.task!r}: no "
                                 f"{e} (its metadata keys: {sorted(sample.get('metadata') or {})})") from None

    def _build(self, seed: int, size: int) -> Any:
        rg = import_optional("reasoning_gym", "envs", "type: reasoning_gym")
        try:
            return rg.create_dataset(self.task, seed=seed, size=size, **self.config)
        except (TypeError, ValueError, AssertionError, KeyError) as e:
            raise ValueError(f"reasoning-gym task {self.task!r} rejected config {self.config}: "
                             f"{type(e).__name__}: {e}") from None

    def _dataset(self, validation: bool) -> Any:
        # Built on first use for the current seed: the env config may set the seed after construction.
        key = (self.seed, validation)
        if key not in self._datasets:
            seed = self.seed
            if validation:
                seed = int(hashlib.sha256(f"{self.seed}:validation".encode()).hexdigest()[:8], 16)
            self._datasets[key] = self._build(seed, self.validation_size if validation else self.size)
        return self._datasets[key]

    def dataset_size(self, validation: bool) -> int | None:
        return self.validation_size if validation else self.size

    def get_problem(self, index: int, validation: bool) -> dict:
        entry = self._dataset(validation)[index]
        split = "val" if validation else "train"
        template = self.prompt_template or ("{question}\n{instruction}" if self.instruction else "{question}")
        prompt = render_prompt(template, entry, self.instruction or "", self.prompt_replacements)
        return {"prompt": prompt, "id": f"{split}-{index}", "entry": entry}

    def make_prompt(self, problem: dict) -> str | list[dict[str, str]]:
        return [{"role": "user", "content": problem["prompt"]}] if self.chat else problem["prompt"]

    def compute_reward(self, problem: dict, completion: str) -> float:
        answer = extract_answer(completion, self.answer_format, self._pattern, self.stop)
        return float(self._dataset(problem["id"].startswith("val"))
                     .score_answer(answer=answer, entry=problem["entry"]))
