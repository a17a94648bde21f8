"""An iteration's rollouts over all data-parallel ranks, in one all-gather: the training sequences, the counts
the trainer logs and the per-environment observations.

Each rank sends its sequences and its :func:`~megatron.rl.observe.metrics.local_observations`; every rank then
holds the same sequences (in rank order), the same per-environment summaries and the same samples.
:class:`~megatron.rl.rollout.sequences.CollectionStats` is derived from those summaries, so the rollouts are
counted once. This module only gathers and merges; the counting and the advantages live in the pure modules.
"""
from __future__ import annotations

from typing import Sequence

from megatron.rl import parallel_utils
from megatron.rl.base.types import RolloutGroup
from megatron.rl.observe.metrics import RolloutObservations, local_observations, merge_observations
from megatron.rl.rollout.collection import data_parallel
from megatron.rl.rollout.flags import RolloutFlags
from megatron.rl.rollout.sequences import CollectionStats, TrainingSequence, groups_to_sequences

__all__ = ["gather_rollouts", "gather_sequences"]


def gather_rollouts(groups: Sequence[RolloutGroup], rl: RolloutFlags, dp_group=None
                    ) -> tuple[list[TrainingSequence], CollectionStats, RolloutObservations]:
    """Local groups -> (global training sequences, global counts, observations), identical on every rank of
    ``dp_group``. Collective: one ``all_gather_object``."""
    local = (groups_to_sequences(groups, rl.advantage_estimator, rl.filter_same_reward),
             local_observations(groups, rl.max_new_tokens, rl.observe.log_samples))
    gathered = parallel_utils.all_gather_object(local, dp_group)
    sequences = [s for seqs, _ in gathered for s in seqs]
    observations = merge_observations([part for _, part in gathered], rl.observe.log_samples)
    return sequences, CollectionStats.of(observations.summaries, rl.filter_same_reward), observations


def gather_sequences(groups: Sequence[RolloutGroup], rl: RolloutFlags
                     ) -> tuple[list[TrainingSequence], CollectionStats, RolloutObservations]:
    """:func:`gather_rollouts` over this rank's data-parallel group (the trainer's call)."""
    return gather_rollouts(groups, rl, data_parallel()[0])
