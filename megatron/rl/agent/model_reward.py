"""``type: model_reward``: any environment's rollouts rescored by a judge model and/or a reward model.

``reward = rule_weight * rule + judge.weight * judge_score + reward_model.weight * rm_score``; the unweighted
parts are in ``metadata["reward_components"]``. A judge or reward-model failure makes the rollout failed (never a
silent reward of 0). Prompt order, sharding, checkpointed state and evaluation are the wrapped environment's.

YAML example and failure accounting: docs/agents.md.
"""
from __future__ import annotations

import asyncio
from typing import Any

from pydantic import Field, PrivateAttr, SerializeAsAny, field_validator, model_validator

from megatron.rl.agent.api import (Agent, AgentError, EvaluationRequest, EvaluationResponse, GroupedRolloutRequest,
                                   GroupedRolloutResponse)
from megatron.rl.agent.env_config import resolve_agent_type
from megatron.rl.agent.judge import JudgeConfig, judge_completions, prompt_as_text
from megatron.rl.agent.reward_model import RewardModel, RewardModelConfig, RewardModelError
from megatron.rl.base.optional import import_optional
from megatron.rl.base.types import Rollout, RolloutGroup
from megatron.rl.inference.api import InferenceInterface

__all__ = ["ModelRewardAgent"]


@Agent.register_subclass("model_reward")
class ModelRewardAgent(Agent):
    """An environment rescored by model-based rewards (see the module docstring).

    env: the wrapped agent (YAML: ``{type: NAME, args: {...}}``; registered types only). rule_weight: weight of
    its own reward. judge / reward_model: optional sections; at least one is required.
    """

    env: SerializeAsAny[Agent]
    rule_weight: float = Field(default=1.0, allow_inf_nan=False)
    judge: JudgeConfig | None = None
    reward_model: RewardModelConfig | None = None

    _judge_iface: InferenceInterface | None = PrivateAttr(default=None)
    _rm: RewardModel | None = PrivateAttr(default=None)

    @field_validator("env", mode="before")
    @classmethod
    def _build_env(cls, v: Any) -> Any:
        if isinstance(v, dict) and "type" in v:  # the YAML form; a dump carries type_name instead

            unknown = sorted(set(v) - {"type", "args"})
            if unknown:
                raise ValueError(f"env: unknown key(s) {unknown}; expected 'type' and 'args'")
            return resolve_agent_type(str(v["type"]), where="env: type")(**(v.get("args") or {}))
        return v

    @model_validator(mode="after")
    def _something_to_score(self) -> "ModelRewardAgent":
        if self.judge is None and self.reward_model is None:
            raise ValueError("model_reward needs a 'judge' or a 'reward_model' section (or both)")
        return self

    def model_post_init(self, context: Any) -> None:
        if self.reward_model is not None:
            import_optional("transformers", "hf", "model_reward's reward_model")  # fail at configuration time
            self._rm = RewardModel(config=self.reward_model)

    # -- wiring: the wrapped environment draws the prompts ---------------------------------------------------
    def set_data_parallel(self, rank: int, world_size: int) -> None:
        super().set_data_parallel(rank, world_size)
        self.env.set_data_parallel(rank, world_size)

    def bind_inference(self, interface: InferenceInterface | None) -> None:
        super().bind_inference(interface)
        self.env.bind_inference(interface)

    def bind_judge_inference(self, interface: InferenceInterface) -> None:
        """The judge's backend when the config names none (e.g. a second in-process model built in code)."""
        self._judge_iface = interface

    def _judge_backend(self) -> InferenceInterface:
        if self._judge_iface is None:
            if self.judge.inference is None:
                raise AgentError(f"agent {self.name!r}: the judge has no backend: set judge.inference in the env "
                                 "config or call bind_judge_inference(...)")
            self._judge_iface = self.judge.inference.build()
        return self._judge_iface

    def state_dict(self) -> dict[str, Any]:
        return self.env.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.env.load_state_dict(state)

    # -- rollouts ----------------------------------------------------------------------------------------------
    async def generate_grouped_rollouts(self, request: GroupedRolloutRequest) -> GroupedRolloutResponse:
        self.env.env_id = self.name  # rollouts carry this entry's name, not the wrapped type's
        inner = await self.env.generate_grouped_rollouts(request)
        return GroupedRolloutResponse(groups=await self.rescore(inner.groups))

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        self.env.env_id = self.name
        response = await self.env.evaluate(request)
        return response.model_copy(update={"env_id": self.name})

    async def rescore(self, groups: list[RolloutGroup]) -> list[RolloutGroup]:
        """``groups`` with every ok rollout's reward replaced by the weighted combination (or failed)."""
        todo = [r for g in groups for r in g.rollouts if r.ok]
        pairs = [(r.prompt, r.completion) for r in todo]
        judged, scored = await asyncio.gather(self._judge_all(pairs), self._score_all(pairs))
        updated: dict[int, Rollout] = {}
        for i, r in enumerate(todo):
            components = {"rule": r.reward}
            failure = None
            if judged is not None:
                v = judged[i]
                if v.score is None:
                    failure = (v.kind, v.error)
                else:
                    components["judge"] = v.score
            if scored is not None and failure is None:
                if isinstance(scored, RewardModelError):
                    failure = ("reward_model_error", f"reward model: {scored}")
                else:
                    components["reward_model"] = scored[i]
            updated[id(r)] = self._finish(r, components, failure)
        return [g.model_copy(update={"rollouts": [updated.get(id(r), r) for r in g.rollouts]}) for g in groups]

    async def _judge_all(self, pairs: list) -> list | None:
        if self.judge is None or not pairs:
            return None
        return await judge_completions(self.judge, self._judge_backend(), pairs)

    async def _score_all(self, pairs: list) -> list[float] | RewardModelError | None:
        if self._rm is None or not pairs:
            return None
        try:
            return await self._rm.score([(prompt_as_text(p), c) for p, c in pairs])
        except RewardModelError as e:
            return e

    def _finish(self, rollout: Rollout, components: dict[str, float], failure: tuple[str, str] | None) -> Rollout:
        metadata = {**rollout.metadata, "reward_components": components}
        if failure is not None:
            kind, reason = failure
            return rollout.model_copy(update={"status": "failed", "failure_reason": reason, "reward": 0.0,
                                              "metadata": {**metadata, "failure_kind": kind}})
        reward = self.rule_weight * components["rule"]
        if self.judge is not None:
            reward += self.judge.weight * components["judge"]
        if self.reward_model is not None:
            reward += self.reward_model.weight * components["reward_model"]
        return rollout.model_copy(update={"reward": float(reward), "metadata": metadata})
