"""The RL flags the rollout modules read, as a structural type: an ``RLConfig`` is one.

``rl_config`` builds ``RLConfig`` with the asynchronous section of this folder (:mod:`.async_config`), so the
rollout modules name the fields they read here instead of importing the config module above them.
"""
from __future__ import annotations

from typing import Protocol

from megatron.rl.observe.config import ObserveConfig
from megatron.rl.rollout.async_config import AsyncRolloutConfig

__all__ = ["RolloutFlags"]


class RolloutFlags(Protocol):
    """What collecting and gathering rollouts read of the run's RL flags (an ``RLConfig``)."""

    prompts_per_step: int  # --grpo-prompts-per-step
    group_size: int  # --grpo-group-size
    temperature: float  # --rl-default-temperature
    top_p: float
    top_k: int
    max_new_tokens: int  # --rl-max-new-tokens
    advantage_estimator: str  # --grpo-advantage-estimator
    filter_same_reward: bool  # --grpo-filter-groups-with-same-reward
    observe: ObserveConfig  # --rl-log-samples
    async_rollouts: AsyncRolloutConfig  # --rl-generation-lag and the rest of the asynchronous section
