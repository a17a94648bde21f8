"""What agents hand to the trainer: rollouts, token-level rollouts and groups of them.

Pydantic models rooted at :class:`Rollout`, so they cross process boundaries as JSON and come back as the same
classes. Token-level arrays (``token_ids``, ``generation_mask``, ``logprobs``) are aligned, length ``L``, over
all turns; the mask is 1 only on policy-generated tokens. Failed episodes have ``status="failed"`` and a
``failure_reason``; the trainer must drop them, never train on them as zero rewards.

Token-level conventions in full: docs/base.md.
"""
from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, SerializeAsAny, field_validator, model_validator

from megatron.rl.base.chat import ChatMessage  # re-exported: part of the agents' vocabulary
from megatron.rl.base.routes import Routes
from megatron.rl.base.type_lookupable import TypeLookupable

__all__ = ["Rollout", "TokenRollout", "RolloutGroup", "ChatMessage", "RolloutStatus"]

RolloutStatus = Literal["ok", "failed"]


class Rollout(TypeLookupable):
    """One text-level episode: prompt, completion, reward and status.

    prompt: the prompt text, or chat messages. completion: everything after the prompt (for multi-turn
    episodes the generated turns and the observations between them, concatenated). env_id: which
    environment produced it. problem_id: identifies the prompt within the environment (for grouping and
    evaluation). metadata: free-form JSON-able details (finish reasons, parsed answers, ...).
    """

    _type_registry: ClassVar[dict[str, type]] = {}

    prompt: str | list[ChatMessage]
    completion: str
    reward: float
    status: RolloutStatus = "ok"
    failure_reason: str | None = None
    env_id: str = ""
    problem_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward")
    @classmethod
    def _finite_reward(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError(f"reward must be a finite float, got {v!r}; return 0.0 with status='failed' for an "
                             "episode that could not be scored")
        return float(v)

    @model_validator(mode="after")
    def _failed_has_reason(self) -> "Rollout":
        if self.status == "failed" and not self.failure_reason:
            raise ValueError("a rollout with status='failed' needs a failure_reason")
        return self

    @property
    def ok(self) -> bool:
        return self.status == "ok"


Rollout.register_subclass("Rollout")(Rollout)  # the root is a concrete type too


@Rollout.register_subclass("TokenRollout")
class TokenRollout(Rollout):
    """A :class:`Rollout` plus the token-level view the trainer needs (see the module docstring).

    token_ids [L], generation_mask [L] of 0/1, logprobs [L] or None, prompt_length: number of leading
    prompt tokens (first turn), routes: MoE routing ``[layers, L, k]`` or None.
    """

    token_ids: list[int]
    generation_mask: list[int]
    logprobs: list[float] | None = None
    prompt_length: int = Field(ge=0)
    routes: Routes | None = None

    @model_validator(mode="after")
    def _check_alignment(self) -> "TokenRollout":
        n = len(self.token_ids)
        if len(self.generation_mask) != n:
            raise ValueError(f"generation_mask has {len(self.generation_mask)} entries but token_ids has {n}")
        if any(m not in (0, 1) for m in self.generation_mask):
            raise ValueError("generation_mask entries must be 0 or 1")
        if self.prompt_length > n:
            raise ValueError(f"prompt_length={self.prompt_length} exceeds len(token_ids)={n}")
        if any(self.generation_mask[: self.prompt_length]):
            raise ValueError("generation_mask must be 0 over the prompt (first prompt_length tokens)")
        if self.logprobs is not None:
            if len(self.logprobs) != n:
                raise ValueError(f"logprobs has {len(self.logprobs)} entries but token_ids has {n}; store one per "
                                 "token (0.0 where generation_mask is 0)")
            bad = [i for i, (lp, m) in enumerate(zip(self.logprobs, self.generation_mask))
                   if m and not (math.isfinite(lp) and lp <= 1e-6)]
            if bad:
                raise ValueError(f"logprobs must be finite and <= 0 at generated positions; bad at {bad[:5]}")
        if self.routes is not None and self.routes.num_tokens != n:
            raise ValueError(f"routes cover {self.routes.num_tokens} tokens but token_ids has {n}")
        return self

    @property
    def num_generated_tokens(self) -> int:
        return sum(self.generation_mask)

    @property
    def generated_logprobs(self) -> list[float] | None:
        """Log-probs at the generated positions only, in order (None when the backend gave none)."""
        if self.logprobs is None:
            return None
        return [lp for lp, m in zip(self.logprobs, self.generation_mask) if m]


class RolloutGroup(BaseModel):
    """The rollouts sampled for one prompt: the unit GRPO normalises advantages over.

    ``rollouts`` keep their concrete classes through JSON (each carries its ``type_name``).
    """

    model_config = ConfigDict(extra="forbid")

    rollouts: list[SerializeAsAny[Rollout]]
    env_id: str = ""
    problem_id: str | None = None

    @property
    def rewards(self) -> list[float]:
        return [r.reward for r in self.rollouts]

    @property
    def num_failed(self) -> int:
        return sum(not r.ok for r in self.rollouts)

    @property
    def mean_reward(self) -> float:
        """Mean reward over the ``ok`` rollouts (0.0 when every rollout failed)."""
        ok = [r.reward for r in self.rollouts if r.ok]
        return sum(ok) / len(ok) if ok else 0.0
