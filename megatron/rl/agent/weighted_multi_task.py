"""WeightedMultiTaskAgent: several environments behind one agent, mixed by weight.

Each request's ``num_groups`` prompt groups are split across the weighted environments with
:func:`allocate_groups` (largest remainder, at least one group each when there are enough groups, the
rounding carried over to the next request so the mix follows the weights over time); evaluation-only
environments get no training groups but take part in :meth:`WeightedMultiTaskAgent.evaluate`. A request for
fewer groups than there are environments (asynchronous rollouts submitted group by group ask for one at a
time) goes to the environments furthest behind their share: over consecutive requests the groups follow the
weights as closely as whole groups can (1:3 over requests of one group: 1 of every 4 to the first). Usually built from a YAML file by
:func:`megatron.rl.agent.env_config.build_agent_from_config`.
"""
from __future__ import annotations

import asyncio
import math
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny, model_validator

from megatron.rl.agent.api import (Agent, EvaluationRequest, EvaluationResponse, GroupedRolloutRequest,
                                   GroupedRolloutResponse)
from megatron.rl.inference.api import InferenceInterface

__all__ = ["WeightedMultiTaskAgent", "TaskEntry", "allocate_groups", "next_carry"]


def allocate_groups(total: int, weights: list[float], carry: list[Fraction] | None = None) -> list[int]:
    """Split ``total`` groups by ``weights`` (largest remainder), giving each positive weight at least one when
    ``total`` allows it.

    Quotas are ``total * w_i / sum(w)`` plus ``carry[i]`` (what earlier requests owe entry i: see
    :func:`next_carry`); each entry gets its floor (never below 0), leftovers go to the largest fractional
    parts (ties: lower index). When ``total`` is at least the number of positive weights, an entry with positive
    weight left at 0 then takes one group from the entry that is furthest above its quota (among those with
    more than one). With fewer groups than positive weights the groups go by quota alone: the entries furthest
    behind their share get them, and the carry serves the others at later requests. Zero weights get 0.
    Raises ValueError on negative / non-finite weights or a zero sum.
    """
    if any(not math.isfinite(w) or w < 0 for w in weights):
        raise ValueError(f"weights must be finite and >= 0, got {weights}")
    wsum = sum(weights)
    if wsum <= 0:
        raise ValueError(f"weights sum to {wsum}: at least one environment needs a positive weight")
    if total < 0:
        raise ValueError(f"cannot allocate {total} groups")
    positive = [i for i, w in enumerate(weights) if w > 0]
    quotas = _quotas(total, weights, carry)
    alloc = [max(math.floor(q), 0) for q in quotas]
    while sum(alloc) > total:  # only with carry: negative quotas clamped to 0 left too little for the rest
        over = max((j for j in positive if alloc[j] > 0), key=lambda j: (alloc[j] - quotas[j], -j))
        alloc[over] -= 1
    order = sorted(positive, key=lambda i: (-(quotas[i] - alloc[i]), i))
    for k in range(total - sum(alloc)):
        alloc[order[k % len(order)]] += 1
    for i in positive if total >= len(positive) else ():
        if alloc[i] == 0:
            donor = max((j for j in range(len(alloc)) if alloc[j] > 1), key=lambda j: (alloc[j] - quotas[j], -j))
            alloc[donor] -= 1
            alloc[i] += 1
    return alloc


def next_carry(total: int, weights: list[float], carry: list[Fraction] | None, alloc: list[int]) -> list[Fraction]:
    """What each entry is owed after a request allocated ``alloc``: its quota minus what it got, kept within
    [-1, 1].

    Carrying the rounding over to the next request makes the groups each environment receives over many requests
    follow the weights (1:1:1 with 16 groups per step: 6/5/5, 5/6/5, 5/5/6, ... instead of 6/5/5 forever; 1:3
    with one group per request: 0/1, 1/0, 0/1, 0/1, ...). The bound forgets what the at-least-one rule gives a
    tiny weight, so that debt cannot grow without end.
    """
    quotas = _quotas(total, weights, carry)
    return [min(max(q - a, Fraction(-1)), Fraction(1)) if w > 0 else Fraction(0)
            for q, a, w in zip(quotas, alloc, weights)]


def _quotas(total: int, weights: list[float], carry: list[Fraction] | None) -> list[Fraction]:
    # Exact rationals: float rounding must not decide ties between equal remainders.
    exact = [Fraction(w) for w in weights]
    wsum = sum(exact)
    carry = carry or [Fraction(0)] * len(weights)
    return [total * w / wsum + c if w > 0 else Fraction(0) for w, c in zip(exact, carry)]


class TaskEntry(BaseModel):
    """One environment of a multi-task mix."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True)

    name: str
    agent: SerializeAsAny[Agent]
    weight: float = Field(default=1.0, ge=0.0)
    evaluation_only: bool = False


@Agent.register_subclass("weighted_multi_task")
class WeightedMultiTaskAgent(Agent):
    """Mix of environments; rollouts keep their environment's ``env_id`` (the entry name)."""

    entries: list[TaskEntry]
    _carry: dict[str, Fraction] = PrivateAttr(default_factory=dict)  # rounding owed per environment (next_carry)
    _lowered: dict[str, float] = PrivateAttr(default_factory=dict)  # weights changed during the run (scale_weight)

    @model_validator(mode="after")
    def _check_entries(self) -> "WeightedMultiTaskAgent":
        names = [e.name for e in self.entries]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"environment names must be unique, repeated: {dup}")
        train = [e for e in self.entries if not e.evaluation_only]
        if not train:
            raise ValueError("every environment is evaluation_only: at least one must provide training prompts")
        if sum(e.weight for e in train) <= 0:
            raise ValueError("the weights of the training (non evaluation_only) environments sum to 0")
        for e in self.entries:
            if e.agent.env_id is None:
                e.agent.env_id = e.name
        return self

    @property
    def training_entries(self) -> list[TaskEntry]:
        return [e for e in self.entries if not e.evaluation_only and e.weight > 0]

    def allocation(self, num_groups: int) -> dict[str, int]:
        """Groups per training environment for the next step of ``num_groups`` groups (does not advance it)."""
        train = self.training_entries
        alloc = allocate_groups(num_groups, [e.weight for e in train], self._carry_of(train))
        return dict(zip([e.name for e in train], alloc))

    def _carry_of(self, train: list[TaskEntry]) -> list[Fraction]:
        return [self._carry.get(e.name, Fraction(0)) for e in train]

    def _advance(self, num_groups: int, alloc: dict[str, int]) -> None:
        train = self.training_entries
        carry = next_carry(num_groups, [e.weight for e in train], self._carry_of(train),
                           [alloc[e.name] for e in train])
        self._carry = dict(zip([e.name for e in train], carry))

    def scale_weight(self, name: str, factor: float) -> tuple[float, float]:
        """Multiply the training environment ``name``'s weight by ``factor`` (0 < factor <= 1) from the next
        request on; returns (old, new). The new weight is checkpointed with the agent's state."""
        entry = next((e for e in self.training_entries if e.name == name), None)
        if entry is None:
            raise ValueError(f"no training environment {name!r} to reweight; training environments: "
                             f"{[e.name for e in self.training_entries]}")
        if not 0 < factor <= 1:
            raise ValueError(f"weight factor {factor}: must be in (0, 1]")
        old = entry.weight
        entry.weight = old * factor
        self._lowered[name] = entry.weight
        return old, entry.weight

    def set_data_parallel(self, rank: int, world_size: int) -> None:
        super().set_data_parallel(rank, world_size)
        for e in self.entries:
            e.agent.set_data_parallel(rank, world_size)

    def bind_inference(self, interface: InferenceInterface | None) -> None:
        super().bind_inference(interface)
        for e in self.entries:
            e.agent.bind_inference(interface)

    async def generate_grouped_rollouts(self, request: GroupedRolloutRequest) -> GroupedRolloutResponse:
        alloc = self.allocation(request.num_groups)
        self._advance(request.num_groups, alloc)
        jobs = [(e, alloc[e.name]) for e in self.training_entries if alloc[e.name] > 0]
        responses = await asyncio.gather(*[
            e.agent.generate_grouped_rollouts(request.model_copy(update={"num_groups": n})) for e, n in jobs])
        return GroupedRolloutResponse(groups=[g for r in responses for g in r.groups])

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        """Evaluate every environment (evaluation-only ones included); metrics are prefixed ``<name>/``."""
        responses = await asyncio.gather(*[e.agent.evaluate(request) for e in self.entries])
        metrics = {f"{e.name}/{k}": v for e, r in zip(self.entries, responses) for k, v in r.metrics.items()}
        return EvaluationResponse(env_id=self.name, results=[x for r in responses for x in r.results],
                                  metrics=metrics)

    def state_dict(self) -> dict[str, Any]:
        return {"agents": {e.name: e.agent.state_dict() for e in self.entries},
                "allocation_carry": {name: str(c) for name, c in self._carry.items()},
                "lowered_weights": dict(self._lowered)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("agents", {})
        missing = [e.name for e in self.entries if e.name not in saved]
        if missing:
            raise ValueError(f"agent state has no entry for environment(s) {missing}; saved: {sorted(saved)}")
        for e in self.entries:
            e.agent.load_state_dict(saved[e.name])
        # older checkpoints have no carry: start from none
        self._carry = {name: Fraction(c) for name, c in state.get("allocation_carry", {}).items()}
        # weights the collapse guard lowered stay lowered (the config's weights for the others)
        self._lowered = {name: float(w) for name, w in state.get("lowered_weights", {}).items()}
        for e in self.entries:
            if e.name in self._lowered:
                e.weight = self._lowered[e.name]
