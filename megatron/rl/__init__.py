"""megatron-rl: reinforcement-learning post-training (GRPO, PPO) for Megatron Core models.

The public API, imported lazily so ``import megatron.rl`` stays cheap (megatron-core and transformers load
only when a name that needs them is used)::

    from megatron.rl import Agent, RewardOnlyAgent, InferenceInterface, GenerationArgs, TokenRollout
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    # agents (environments)
    "Agent": "megatron.rl.agent.api",
    "AgentError": "megatron.rl.agent.api",
    "GroupedRolloutRequest": "megatron.rl.agent.api",
    "RolloutRequest": "megatron.rl.agent.api",
    "EvaluationRequest": "megatron.rl.agent.api",
    "RewardOnlyAgent": "megatron.rl.agent.reward_only_agent",
    "PassAtEvaluationAgent": "megatron.rl.agent.pass_at_evaluation_agent",
    "WeightedMultiTaskAgent": "megatron.rl.agent.weighted_multi_task",
    "TypeLookupable": "megatron.rl.base.type_lookupable",
    "build_agent_from_config": "megatron.rl.agent.env_config",
    # rollouts
    "Rollout": "megatron.rl.base.types",
    "TokenRollout": "megatron.rl.base.types",
    "RolloutGroup": "megatron.rl.base.types",
    # inference
    "InferenceInterface": "megatron.rl.inference.api",
    "InferenceRequest": "megatron.rl.inference.api",
    "InferenceResponse": "megatron.rl.inference.api",
    "GenerationArgs": "megatron.rl.inference.api",
    "ChatMessage": "megatron.rl.inference.api",
    "InferenceError": "megatron.rl.inference.api",
    "build_inference_interface": "megatron.rl.inference.api",
    # runtime
    "setup_runtime": "megatron.rl.runtime",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron.rl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
