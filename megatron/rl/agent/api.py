"""The agent (environment) API: requests, responses and the :class:`Agent` base class.

An agent owns a task: it picks prompts, asks an :class:`~megatron.rl.inference.api.InferenceInterface` to
generate, scores the results and returns :class:`~megatron.rl.base.types.Rollout` objects. It never sees the
trainer, tokenizers or process groups. Agents are pydantic models registered by decorator, so a YAML
entry (``type: arithmetic`` plus ``args``) or a JSON request body selects and configures one::

    @Agent.register_subclass("my_env")
    class MyEnv(RewardOnlyAgent): ...

Requests and responses are :class:`TypeLookupable` too (registries rooted at :class:`AgentRequest` and
:class:`AgentResponse`), which is what lets :mod:`megatron.rl.server.agent` serve any agent over HTTP.
"""
from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, SerializeAsAny, model_validator

from megatron.rl.agent.prompt_stream import PromptStream
from megatron.rl.base.registry import DuplicateNameError, Registry
from megatron.rl.base.type_lookupable import TypeLookupable, TypeLookupError
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, build_inference_interface
from megatron.rl.base.types import Rollout, RolloutGroup
from megatron.rl.base.errors import RLError

logger = logging.getLogger(__name__)

__all__ = [
    "TypeLookupable", "TypeLookupError", "InferenceSpec",
    "AgentRequest", "RolloutRequest", "GroupedRolloutRequest", "EvaluationRequest",
    "AgentResponse", "RolloutResponse", "GroupedRolloutResponse", "EvaluationResult", "EvaluationResponse",
    "Agent", "AgentError",
]


class AgentError(RLError, RuntimeError):
    """An agent could not serve a request (bad configuration, unreachable remote environment, ...)."""


class InferenceSpec(BaseModel):
    """A JSON-able description of an inference backend: ``build_inference_interface(backend, **kwargs)``.

    Used when the backend object cannot travel with the request, e.g. to tell a remote environment server
    which OpenAI-compatible endpoint to generate with.
    """

    model_config = ConfigDict(extra="forbid")

    backend: str
    kwargs: dict[str, Any] = Field(default_factory=dict)

    def build(self) -> InferenceInterface:
        return build_inference_interface(self.backend, **self.kwargs)


# -- requests ------------------------------------------------------------------------------------------------
class AgentRequest(TypeLookupable):
    """Common fields of all agent requests.

    generation_args: sampling parameters (an agent may add its own stop strings / cap ``max_tokens``).
    inference_interface: the backend object to generate with (in-process; never serialised).
    inference: a serialisable backend description, used when ``inference_interface`` is not given (remote
      agents). If neither is given the agent's bound default backend is used (see :meth:`Agent.bind_inference`).
    """

    _type_registry: ClassVar[dict[str, type]] = {}

    generation_args: GenerationArgs = Field(default_factory=GenerationArgs)
    inference_interface: InferenceInterface | None = Field(default=None, exclude=True, repr=False)
    inference: InferenceSpec | None = None


@AgentRequest.register_subclass("RolloutRequest")
class RolloutRequest(AgentRequest):
    """``num_rollouts`` independent rollouts (each on its own next prompt)."""

    num_rollouts: int = Field(ge=1)


@AgentRequest.register_subclass("GroupedRolloutRequest")
class GroupedRolloutRequest(AgentRequest):
    """``num_groups`` prompts, each sampled ``rollouts_per_group`` times (GRPO groups)."""

    num_groups: int = Field(ge=0)
    rollouts_per_group: int = Field(ge=1)


@AgentRequest.register_subclass("EvaluationRequest")
class EvaluationRequest(AgentRequest):
    """Evaluate on the validation split.

    num_prompts: how many validation prompts (None: all, for finite datasets; generated tasks need a number).
    num_samples: samples per prompt for pass@k (``ks`` defaults to ``[1, num_samples]``).
    greedy: also decode each prompt greedily (temperature 0) and report its accuracy.
    """

    num_prompts: int | None = Field(default=None, ge=1)
    num_samples: int = Field(default=1, ge=1)
    ks: list[int] | None = None
    greedy: bool = True

    @model_validator(mode="after")
    def _check_ks(self) -> "EvaluationRequest":
        for k in self.ks or []:
            if not 1 <= k <= self.num_samples:
                raise ValueError(f"pass@k needs 1 <= k <= num_samples={self.num_samples}, got k={k}")
        return self

    @property
    def resolved_ks(self) -> list[int]:
        return sorted(set(self.ks or [1, self.num_samples]))


# -- responses -----------------------------------------------------------------------------------------------
class AgentResponse(TypeLookupable):
    """Common base of agent responses (a registry root, for polymorphic JSON)."""

    _type_registry: ClassVar[dict[str, type]] = {}


@AgentResponse.register_subclass("RolloutResponse")
class RolloutResponse(AgentResponse):
    rollouts: list[SerializeAsAny[Rollout]]


@AgentResponse.register_subclass("GroupedRolloutResponse")
class GroupedRolloutResponse(AgentResponse):
    groups: list[RolloutGroup]


class EvaluationResult(BaseModel):
    """Per-prompt evaluation outcome: sampled rewards, pass@k, the greedy reward."""

    problem_id: str
    rewards: list[float]
    num_correct: int
    pass_at_k: dict[int, float]
    greedy_reward: float | None = None
    greedy_completion: str | None = None
    num_failed: int = 0


@AgentResponse.register_subclass("EvaluationResponse")
class EvaluationResponse(AgentResponse):
    """``metrics`` are means over prompts: ``pass@K``, ``greedy_accuracy``, ``mean_reward``, ``num_prompts``."""

    env_id: str
    results: list[EvaluationResult] = Field(default_factory=list)
    metrics: dict[str, float] = Field(default_factory=dict)


# -- agents --------------------------------------------------------------------------------------------------
ENVIRONMENTS_PACKAGE = "megatron.rl.environments"
# A module's own registration line, at the start of a line: the name the YAML ``type:`` selects.
_REGISTERS_AGENT = re.compile(r"""^@Agent\.register_subclass\(\s*["']([^"']+)["']""", re.MULTILINE)


def discover_agent_modules(package: str) -> dict[str, str]:
    """``{type name: module}`` for every top-level module of ``package`` with an ``@Agent.register_subclass("name")``
    line. The source is read as text, so neither ``package`` nor its modules (and their heavy or optional
    dependencies) are imported; it works the same from a checkout and from an installed wheel."""
    spec = importlib.util.find_spec(package)
    out: dict[str, str] = {}
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for path in sorted(Path(folder).glob("*.py")):
            for name in _REGISTERS_AGENT.findall(path.read_text(encoding="utf-8")):
                module = f"{package}.{path.stem}"
                if out.setdefault(name, module) != module:
                    raise DuplicateNameError(f"agent type {name!r} is registered by both {out[name]} and {module}")
    return out


# Built-in agent types, imported on first use of their name (so sympy, datasets, ... load only when needed): the
# framework's own agents, and every environment module in megatron/rl/environments/ (found there, no entry here).
BUILTIN_AGENT_MODULES = {
    "huggingface_dataset": "megatron.rl.agent.huggingface_dataset_agent",
    "weighted_multi_task": "megatron.rl.agent.weighted_multi_task",
    "remote": "megatron.rl.agent.remote_agent",
    "model_reward": "megatron.rl.agent.model_reward",
    **discover_agent_modules(ENVIRONMENTS_PACKAGE),
}


class Agent(TypeLookupable):
    """Base class of all agents (environments).

    Fields are the agent's configuration (the ``args`` of its YAML entry). Subclasses implement
    :meth:`generate_grouped_rollouts` (and usually :meth:`evaluate`); most users subclass
    :class:`~megatron.rl.agent.reward_only_agent.RewardOnlyAgent` instead, which only asks for a dataset
    and a reward function.

    env_id: the name rollouts are tagged with (defaults to the registered type name).
    seed: seeds the prompt order (and generated problems); the same seed gives the same prompts.
    """

    _type_registry: ClassVar[Registry[type]] = Registry("Agent type", builtins=BUILTIN_AGENT_MODULES,
                                                        error=TypeLookupError)

    env_id: str | None = None
    seed: int = 1234

    _dp_rank: int = PrivateAttr(default=0)
    _dp_world_size: int = PrivateAttr(default=1)
    _default_inference: InferenceInterface | None = PrivateAttr(default=None)
    _built_inference: dict[str, InferenceInterface] = PrivateAttr(default_factory=dict)

    @property
    def name(self) -> str:
        return self.env_id or self.type_name or type(self).__name__

    # -- wiring by the trainer / server ---------------------------------------------------------------------
    def set_data_parallel(self, rank: int, world_size: int) -> None:
        """Draw prompts as data-parallel rank ``rank`` of ``world_size`` (disjoint per rank)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"data-parallel rank {rank} is outside world size {world_size}")
        self._dp_rank, self._dp_world_size = rank, world_size
        self._on_data_parallel_change()

    def _on_data_parallel_change(self) -> None:
        """Hook for subclasses holding prompt streams."""

    def bind_inference(self, interface: InferenceInterface | None) -> None:
        """Default backend for requests that carry neither ``inference_interface`` nor ``inference``."""
        self._default_inference = interface

    def resolve_inference(self, request: AgentRequest) -> InferenceInterface:
        if request.inference_interface is not None:
            return request.inference_interface
        if request.inference is not None:
            # Built once per distinct spec: a backend may hold connection pools or a loaded model.
            key = request.inference.model_dump_json()
            if key not in self._built_inference:
                self._built_inference[key] = request.inference.build()
            return self._built_inference[key]
        if self._default_inference is not None:
            return self._default_inference
        raise AgentError(f"agent {self.name!r} got a request with no inference backend: set "
                         "request.inference_interface (in-process), request.inference (a backend spec) or call "
                         "agent.bind_inference(...)")

    def make_prompt_stream(self, size: int | None, salt: str = "") -> PromptStream:
        """A :class:`PromptStream` for this agent's seed and DP coordinates (``salt`` separates splits)."""
        seed = self.seed if not salt else int(hashlib.sha256(f"{self.seed}:{salt}".encode()).hexdigest()[:12], 16)
        if size is not None and size <= 0:
            split = salt or "prompts"
            raise AgentError(f"agent {self.name!r} ({type(self).__name__}) has no {split} problems "
                             f"(dataset_size returned {size}); check its data file / arguments in the env config")
        return PromptStream(size, seed, self._dp_rank, self._dp_world_size)

    # -- the API -----------------------------------------------------------------------------------------------
    async def generate_grouped_rollouts(self, request: GroupedRolloutRequest) -> GroupedRolloutResponse:
        """Sample ``request.num_groups`` prompts, ``request.rollouts_per_group`` rollouts each."""
        raise NotImplementedError(f"{type(self).__name__} does not implement generate_grouped_rollouts()")

    async def generate_rollouts(self, request: RolloutRequest) -> RolloutResponse:
        """``request.num_rollouts`` rollouts on distinct prompts (default: groups of one)."""
        grouped = await self.generate_grouped_rollouts(GroupedRolloutRequest(
            num_groups=request.num_rollouts, rollouts_per_group=1, generation_args=request.generation_args,
            inference_interface=request.inference_interface, inference=request.inference))
        return RolloutResponse(rollouts=[r for g in grouped.groups for r in g.rollouts])

    async def evaluate(self, request: EvaluationRequest) -> EvaluationResponse:
        raise NotImplementedError(f"{type(self).__name__} does not implement evaluate()")

    async def handle(self, request: AgentRequest) -> AgentResponse:
        """Dispatch any request type to its method (used by the environment server)."""
        if isinstance(request, GroupedRolloutRequest):
            return await self.generate_grouped_rollouts(request)
        if isinstance(request, RolloutRequest):
            return await self.generate_rollouts(request)
        if isinstance(request, EvaluationRequest):
            return await self.evaluate(request)
        raise AgentError(f"agent {self.name!r} cannot handle request type {type(request).__name__}")

    # -- checkpointed state ------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """JSON-able state the trainer checkpoints (dataset position); empty for stateless agents."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"agent {self.name!r} is stateless but got state keys {sorted(state)}")

    @classmethod
    def from_config(cls, type_name: str, args: dict[str, Any] | None = None) -> "Agent":
        """Build the agent registered as ``type_name`` with ``args`` (its fields)."""
        return cls.lookup(type_name)(**(args or {}))
