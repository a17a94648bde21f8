"""What every rollout source shares: seeds, the prompt split over generating ranks, the agents' request.

Every data-parallel rank asks its agents for ``P / DP`` groups of ``G`` rollouts (all model-parallel ranks of a
DP rank make the same agent calls, so a model-parallel engine serves them in lockstep). When the backend's
lockstep groups are not one per DP rank (a separate inference layout's replicas, or expert parallelism at the
training layout), prompts are split by lockstep group instead (the backend's
:class:`~megatron.rl.inference.control.RolloutShard`) and the groups are regrouped by DP rank afterwards.
Seeds derive from (``--seed``, batch, generating rank), so a resumed run draws what the uninterrupted run would.
"""
from __future__ import annotations

import hashlib
from typing import Any, Sequence

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.base.types import RolloutGroup
from megatron.rl.inference.api import GenerationArgs, InferenceInterface
from megatron.rl.inference.control import RolloutShard, control_of
from megatron.rl.inference.validation import SEED_MAX
from megatron.rl.rollout.flags import RolloutFlags

__all__ = ["derive_seed", "data_parallel", "generation_split", "rollout_request", "for_training"]


def derive_seed(*parts: Any) -> int:
    """A stable seed from any parts (the same on every machine and Python version), within the requests' seed
    range (``SEED_MAX``, exact in a JSON number, so a remote environment server takes it as sent). The low bits,
    from which agents derive their per-sample seeds, are those of the hash's first 60 bits."""
    digest = hashlib.sha256(":".join(map(str, parts)).encode()).hexdigest()
    return int(digest[:15], 16) & SEED_MAX


def data_parallel() -> tuple[Any, int, int]:
    """The training data-parallel (group, rank, size) of this rank (megatron-core's ``parallel_state``)."""
    from megatron.core import parallel_state as ps  # heavy: megatron-core loads only in a run

    return ps.get_data_parallel_group(), ps.get_data_parallel_rank(), ps.get_data_parallel_world_size()


def generation_split(inference: Any) -> tuple[RolloutShard | None, int, int]:
    """How prompts are split for generation: (the backend's ``rollout_shard`` or None, this rank's share, shares).

    By training DP rank, unless the backend's lockstep groups are not one per DP rank: then by its
    :class:`~megatron.rl.inference.control.RolloutShard`, whose results are regrouped by DP rank afterwards.
    """
    shard = control_of(inference).rollout_shard
    if shard is not None:
        return shard, shard.rank, shard.size
    _, dp_rank, dp_size = data_parallel()
    return None, dp_rank, dp_size


def rollout_request(rl: RolloutFlags, seed: int, batch: int, gen_rank: int, num_groups: int,
                    inference: InferenceInterface) -> GroupedRolloutRequest:
    """The agents' request for ``num_groups`` groups of batch ``batch`` (an iteration, synchronously) on generating
    rank ``gen_rank``: the run's sampling flags and a seed of (seed, batch, rank)."""
    args = GenerationArgs(temperature=rl.temperature, top_p=rl.top_p, top_k=rl.top_k, max_tokens=rl.max_new_tokens,
                          seed=derive_seed(seed, "rollouts", batch, gen_rank))
    return GroupedRolloutRequest(num_groups=num_groups, rollouts_per_group=rl.group_size, generation_args=args,
                                 inference_interface=inference)


def for_training(shard: RolloutShard | None, groups: Sequence[RolloutGroup]) -> list[RolloutGroup]:
    """This training DP rank's groups from what its generating rank produced (collective with a shard)."""
    if shard is None:
        return list(groups)
    _, dp_rank, dp_size = data_parallel()
    return shard.regroup_for_training(list(groups), dp_rank, dp_size)
