"""RL algorithm math as pure tensor functions: advantages, policy losses, KL, entropy, IS corrections, aggregation.

No process groups and no globals: callers pass tensors (and global counts they all-reduced) in.
Variants are registered by name; the registries' ``names()`` serve as argparse choices.
"""
from megatron.rl.algorithms.advantages import (ADVANTAGE_ESTIMATORS, compute_advantages, drgrpo_advantages,
                                              groups_with_same_reward, grpo_advantages, rloo_advantages,
                                              validate_rewards)
from megatron.rl.algorithms.aggregation import AGGREGATIONS, LossNormalizers, aggregate_loss, local_normalizers
from megatron.rl.algorithms.entropy import (entropy_bonus, entropy_from_logits, entropy_from_partials,
                                           entropy_partials)
from megatron.rl.algorithms.importance_sampling import (IS_CORRECTIONS, CorrectionParams, logprob_gap_stats,
                                                       masked_is_weights, mismatch_sums, reject_sequences,
                                                       sequence_is_weights, truncated_is_weights,
                                                       trust_region_is_weights)
from megatron.rl.algorithms.logprobs import logprob_temperature, token_logprobs
from megatron.rl.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from megatron.rl.algorithms.policy_loss import (POLICY_LOSSES, PolicyLossConfig, PolicyLossConfigError, cispo_loss,
                                               compute_token_loss, gspo_loss, ppo_clip_loss, validate_policy_loss)
from megatron.rl.base.registry import Registry

__all__ = [
    "ADVANTAGE_ESTIMATORS", "AGGREGATIONS", "IS_CORRECTIONS", "KL_ESTIMATORS", "POLICY_LOSSES", "Registry",
    "compute_advantages", "grpo_advantages", "drgrpo_advantages", "rloo_advantages", "validate_rewards",
    "groups_with_same_reward",
    "LossNormalizers", "aggregate_loss", "local_normalizers",
    "entropy_from_logits", "entropy_partials", "entropy_from_partials", "entropy_bonus",
    "CorrectionParams", "logprob_gap_stats", "truncated_is_weights", "masked_is_weights", "sequence_is_weights",
    "trust_region_is_weights", "reject_sequences", "mismatch_sums",
    "logprob_temperature", "token_logprobs",
    "kl_k1", "kl_k2", "kl_k3", "kl_penalty",
    "PolicyLossConfig", "PolicyLossConfigError", "compute_token_loss", "ppo_clip_loss", "gspo_loss", "cispo_loss",
    "validate_policy_loss",
]
