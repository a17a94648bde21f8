"""Group-relative advantage estimators: rewards [num_groups, group_size] -> advantages, same shape.

Each group holds the rollouts sampled for one prompt; the baseline of every estimator here is built
from the other rollouts of the same group, so no value network is needed.

* ``grpo``   (r - mean) / (std + eps), std with Bessel's correction (unbiased, as ``torch.std``).
             A group whose rewards are all equal gets exactly 0 (no signal), not noise / eps.
* ``drgrpo`` r - mean (Dr. GRPO: no std normalisation, which biases towards easy/hard prompts).
* ``rloo``   r_i - mean_{j != i} r_j (REINFORCE leave-one-out) = G / (G - 1) * (r_i - mean).

Every estimator needs at least two rollouts per group (one rollout has no baseline but itself, so
its advantage would be 0 or undefined): group size 1 is a ValueError naming ``--grpo-group-size``.
"""
from __future__ import annotations

from typing import Callable

import torch

from megatron.rl.base.registry import Registry

AdvantageFn = Callable[..., torch.Tensor]

ADVANTAGE_ESTIMATORS: Registry[AdvantageFn] = Registry("advantage estimator", "--grpo-advantage-estimator")


def validate_rewards(rewards: torch.Tensor, estimator: str = "grpo") -> None:
    """Check rewards [num_groups, group_size]: 2-D, floating, group size >= 2, all finite.

    Raises ValueError naming the first group that holds a NaN/inf reward so the bad rollout can be found.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor [num_groups, group_size], got {type(rewards).__name__}")
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got shape {tuple(rewards.shape)}")
    if not rewards.is_floating_point():
        raise ValueError(f"rewards must be a floating-point tensor, got dtype {rewards.dtype}")
    if rewards.shape[1] < 2:
        raise ValueError(f"advantage estimator {estimator!r} needs at least 2 rollouts per group "
                         f"(--grpo-group-size), got group size {rewards.shape[1]}: with one rollout the "
                         f"group baseline is the rollout itself and there is no learning signal")
    bad = ~torch.isfinite(rewards)
    if bool(bad.any()):
        group = int(bad.any(dim=1).nonzero()[0, 0])
        raise ValueError(f"non-finite reward in group {group}: {rewards[group].tolist()}; "
                         f"check the environment's reward function")


@ADVANTAGE_ESTIMATORS.register("grpo")
def grpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: (r - group mean) / (group std + eps). rewards [G_n, G] -> [G_n, G]."""
    mean = rewards.mean(dim=1, keepdim=True)
    std = rewards.std(dim=1, keepdim=True)  # unbiased (Bessel), as torch.std
    adv = (rewards - mean) / (std + eps)
    # All-equal groups: the centred rewards can be a rounding error away from 0 (mean of 0.1s),
    # which divided by eps would be noise with a large magnitude. They carry no signal: make them 0.
    same = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(same, torch.zeros_like(adv), adv)


@ADVANTAGE_ESTIMATORS.register("drgrpo")
def drgrpo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Dr. GRPO: r - group mean (``eps`` is accepted for a uniform signature and unused)."""
    del eps
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    same = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(same, torch.zeros_like(adv), adv)


@ADVANTAGE_ESTIMATORS.register("rloo")
def rloo_advantages(rewards: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RLOO: r_i minus the mean of the other G - 1 rewards of its group (``eps`` unused)."""
    del eps
    g = rewards.shape[1]
    others_mean = (rewards.sum(dim=1, keepdim=True) - rewards) / (g - 1)
    adv = rewards - others_mean
    same = (rewards == rewards[:, :1]).all(dim=1, keepdim=True)
    return torch.where(same, torch.zeros_like(adv), adv)


def compute_advantages(rewards: torch.Tensor, estimator: str = "grpo", eps: float = 1e-6) -> torch.Tensor:
    """Validate ``rewards`` [num_groups, group_size] and apply the registered ``estimator``.

    Returns advantages [num_groups, group_size] in the rewards' dtype. The computation is done in
    float64 so the result does not depend on how groups are batched.
    """
    fn = ADVANTAGE_ESTIMATORS.get(estimator)
    validate_rewards(rewards, estimator)
    return fn(rewards.double(), eps=eps).to(rewards.dtype)


def groups_with_same_reward(rewards: torch.Tensor, atol: float = 0.0) -> torch.Tensor:
    """Bool [num_groups]: True where every reward of the group is within ``atol`` of the group's first.

    Such groups have zero advantage for every estimator, so ``--grpo-filter-groups-with-same-reward``
    drops them (their tokens would only dilute the normaliser).
    """
    if rewards.dim() != 2:
        raise ValueError(f"rewards must have shape [num_groups, group_size], got shape {tuple(rewards.shape)}")
    return ((rewards - rewards[:, :1]).abs() <= atol).all(dim=1)
