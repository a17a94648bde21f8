"""Agents (environments): the registry-backed Agent API and the built-in agent types.

Names are resolved lazily, so ``import megatron.rl.agent`` loads an agent module (and its optional
dependencies) only when one of its names is used.
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "TypeLookupable": "megatron.rl.base.type_lookupable",
    "TypeLookupError": "megatron.rl.base.type_lookupable",
    "Agent": "megatron.rl.agent.api",
    "AgentError": "megatron.rl.agent.api",
    "AgentRequest": "megatron.rl.agent.api",
    "AgentResponse": "megatron.rl.agent.api",
    "RolloutRequest": "megatron.rl.agent.api",
    "GroupedRolloutRequest": "megatron.rl.agent.api",
    "EvaluationRequest": "megatron.rl.agent.api",
    "RolloutResponse": "megatron.rl.agent.api",
    "GroupedRolloutResponse": "megatron.rl.agent.api",
    "EvaluationResponse": "megatron.rl.agent.api",
    "EvaluationResult": "megatron.rl.agent.api",
    "InferenceSpec": "megatron.rl.agent.api",
    "PromptStream": "megatron.rl.agent.prompt_stream",
    "RewardOnlyAgent": "megatron.rl.agent.reward_only_agent",
    "Turn": "megatron.rl.agent.reward_only_agent",
    "PassAtEvaluationAgent": "megatron.rl.agent.pass_at_evaluation_agent",
    "pass_at_k": "megatron.rl.agent.pass_at_evaluation_agent",
    "WeightedMultiTaskAgent": "megatron.rl.agent.weighted_multi_task",
    "allocate_groups": "megatron.rl.agent.weighted_multi_task",
    "EnvConfig": "megatron.rl.agent.env_config",
    "EnvConfigError": "megatron.rl.agent.env_config",
    "load_env_config": "megatron.rl.agent.env_config",
    "build_agent_from_config": "megatron.rl.agent.env_config",
    "HuggingFaceDatasetAgent": "megatron.rl.agent.huggingface_dataset_agent",
    "RemoteAgent": "megatron.rl.agent.remote_agent",
    "ModelRewardAgent": "megatron.rl.agent.model_reward",
    "JudgeConfig": "megatron.rl.agent.judge",
    "RewardModelConfig": "megatron.rl.agent.reward_model",
    "TokenEpisode": "megatron.rl.agent.token_episode",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'megatron.rl.agent' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
