"""From agents' rollout groups to training sequences: drop failures, compute advantages, filter, split.

Pure functions (no process groups): each data-parallel rank turns its own groups into sequences, and the
iteration's one all-gather (:mod:`megatron.rl.rollout.gather`) gives every rank the same global list, the same
counts (:class:`CollectionStats`, derived from the per-environment summaries) and so the same packing plan.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Mapping, Sequence

import torch

from megatron.rl.algorithms import compute_advantages
from megatron.rl.base.types import RolloutGroup, TokenRollout
from megatron.rl.observe.metrics import EnvSummary
from megatron.rl.rollout.pipeline import VERSIONS_KEY

log = logging.getLogger(__name__)


@dataclasses.dataclass
class TrainingSequence:
    """One rollout as the trainer sees it. All lists are token-aligned (``len == len(token_ids)``).

    loss_mask: 1 at tokens the policy generated (trained), 0 at prompt/observation tokens.
    inference_logprobs: the backend's log-prob at generated tokens (0.0 elsewhere), or None.
    routes: the engine's MoE routes, token-major ``[L, layers, k]`` (``-1`` = none), or None (``--rl-router-replay``).
    """

    token_ids: list[int]
    loss_mask: list[int]
    inference_logprobs: list[float] | None
    advantage: float
    reward: float
    group_index: int
    env_id: str
    policy_versions: list[int] | None = None  # per token (-1 where not generated); asynchronous rollouts only
    routes: torch.Tensor | None = None

    @property
    def num_generated(self) -> int:
        return sum(self.loss_mask)


@dataclasses.dataclass
class CollectionStats:
    """What happened to the collected rollouts, as the trainer logs it: derived from the per-environment
    summaries (:meth:`of`), the one count of an iteration's rollouts."""

    groups: int = 0
    rollouts: int = 0
    ok_rollouts: int = 0
    failed_rollouts: int = 0
    dropped_groups_too_few_ok: int = 0
    filtered_same_reward_groups: int = 0
    failure_reasons: dict[str, int] = dataclasses.field(default_factory=dict)
    rewards: list[float] = dataclasses.field(default_factory=list)  # of every ok rollout
    generated_tokens: int = 0  # over ok rollouts

    @classmethod
    def of(cls, summaries: Mapping[str, EnvSummary], filter_same_reward: bool) -> "CollectionStats":
        """The run-wide counts of ``summaries`` (environments in sorted order), for groups turned into sequences
        with ``min_group_size=2`` (the trainer's): a group is dropped when it has fewer than two ok rollouts,
        and filtered (``filter_same_reward``) when its ok rollouts' rewards are all equal."""
        total = EnvSummary()
        for env in sorted(summaries):
            total.add(summaries[env])
        return cls(groups=total.groups, rollouts=total.rollouts, ok_rollouts=total.ok, failed_rollouts=total.failed,
                   dropped_groups_too_few_ok=total.groups - total.scored_groups,
                   filtered_same_reward_groups=total.same_reward_groups if filter_same_reward else 0,
                   failure_reasons=total.failure_reasons, rewards=total.rewards, generated_tokens=total.length_sum)


def _as_token_rollout(rollout) -> TokenRollout:
    if not isinstance(rollout, TokenRollout):
        raise TypeError(f"the trainer needs token-level rollouts (TokenRollout), but the agent returned "
                        f"{type(rollout).__name__}; agents used for training must report token ids and log-probs")
    return rollout


def groups_to_sequences(groups: Sequence[RolloutGroup], estimator: str = "grpo", filter_same_reward: bool = False,
                        min_group_size: int = 2) -> list[TrainingSequence]:
    """Advantages per group over its successful rollouts; failed rollouts never enter training.

    A group keeps its ``ok`` rollouts; with fewer than ``min_group_size`` of them it is dropped (its
    advantages would be meaningless). With ``filter_same_reward`` groups whose ok rewards are all equal are
    dropped too (they have zero advantage everywhere). Advantages are computed per group in float64, so
    groups of different sizes are fine. What was dropped is counted once, by :class:`CollectionStats`.
    """
    sequences: list[TrainingSequence] = []
    for gi, group in enumerate(groups):
        ok = [_as_token_rollout(r) for r in group.rollouts if r.ok]
        if len(ok) < min_group_size:
            continue
        rewards = torch.tensor([[r.reward for r in ok]], dtype=torch.float64)
        if filter_same_reward and bool((rewards == rewards[0, 0]).all()):
            continue
        advantages = compute_advantages(rewards, estimator)[0].tolist()
        for r, adv in zip(ok, advantages):
            sequences.append(TrainingSequence(token_ids=list(r.token_ids), loss_mask=list(r.generation_mask),
                                              inference_logprobs=None if r.logprobs is None else list(r.logprobs),
                                              advantage=float(adv), reward=float(r.reward), group_index=gi,
                                              env_id=r.env_id, policy_versions=r.metadata.get(VERSIONS_KEY),
                                              routes=None if r.routes is None else r.routes.tensor().permute(1, 0, 2)))
    return sequences


def staleness_metrics(versions: Sequence[Sequence[int] | None], iteration: int) -> dict[str, float]:
    """Token staleness of the sequences trained at ``iteration`` (= the policy version being updated).

    ``versions``: per sequence, the policy version of each token (-1 where not generated: prompt, observations),
    or None when unknown (a synchronous source labels none: no metrics). Staleness of a generated token =
    ``|iteration - version|``: ``iteration - version``, except for a group the durable rollout bank restored into
    an older checkpoint, whose tokens can come from a later version whose weights were lost (just as far from
    the trained policy). Returns ``staleness_mean``, ``staleness_max`` and ``off_policy_token_share``
    (staleness > 0) over generated tokens with known versions.
    """
    total = count = worst = off = 0
    for vs in versions:
        for v in vs or ():
            if v < 0:
                continue
            s = abs(iteration - v)
            total += s
            count += 1
            worst = max(worst, s)
            off += s > 0
    if not count:
        return {}
    return {"staleness_mean": total / count, "staleness_max": float(worst), "off_policy_token_share": off / count}
