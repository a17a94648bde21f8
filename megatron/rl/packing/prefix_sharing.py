"""Packing a GRPO group's rollouts so that their common prompt is computed once per row, not once per rollout.

:func:`plan_shared_packing` packs clusters: a group's *holder* stored whole, then *members* stored without their
first ``k - 1`` tokens (``k``: the first trained position), attending to the holder's prompt positions, so each
token meets the keys, values and positions of the rollout stored whole. A cluster fills at most one bin; larger
groups split into several clusters. Pure functions of the token ids: every rank plans alike. Not with THD
packing nor pipeline parallelism: :func:`sharing_applies` / :func:`sharing_blocker` say when.

Details: docs/packing.md.
"""
from __future__ import annotations

from typing import Sequence

from megatron.rl.packing.plan import PackingInfo, check_plan_inputs, first_fit_decreasing, layout_bins, plan_packing

__all__ = ["shareable_prefix", "plan_shared_packing", "sharing_applies", "sharing_blocker"]


def shareable_prefix(loss_mask: Sequence[int]) -> int:
    """Tokens a rollout could read from a holder with the same leading tokens: those before its first trained
    token, but the last of them (which predicts it). 0 when nothing is trained."""
    for j, m in enumerate(loss_mask):
        if m:
            return max(j - 1, 0)
    return 0


def sharing_blocker(mode: str, use_thd: bool, pipeline_parallel: int) -> str | None:
    """Why packed rows of this run cannot compute a group's prompt once (None: they can), naming the flag."""
    if mode != "auto":
        return f"--rl-share-prompt-prefix {mode}"
    if use_thd:
        return "TransformerEngine's THD packing (--transformer-impl transformer_engine) cannot express a shared prompt"
    if pipeline_parallel > 1:
        return (f"prompt sharing is not wired for pipeline parallelism (--pipeline-model-parallel-size "
                f"{pipeline_parallel})")
    return None


def sharing_applies(mode: str, packing: bool, use_thd: bool, pipeline_parallel: int) -> bool:
    """Whether ``--rl-share-prompt-prefix`` (``auto`` / ``off``) shares prefixes in this run's layout."""
    return packing and sharing_blocker(mode, use_thd, pipeline_parallel) is None


def plan_shared_packing(token_ids: Sequence[Sequence[int]], loss_masks: Sequence[Sequence[int]],
                        bin_capacity: int, max_sequences_per_bin: int | None = None) -> PackingInfo:
    """Clusters of rollouts sharing their prompt, packed into bins (see the module docstring).

    Rollouts share when their first ``k`` tokens are equal (``k`` = the holder's first trained position, the
    same for both); the member skips ``k - 1`` of them. Without any shareable pair the plan is
    :func:`~megatron.rl.packing.plan.plan_packing`'s. Raises its errors for a rollout longer than a bin.
    """
    lengths = [len(t) for t in token_ids]
    check_plan_inputs(lengths, bin_capacity, max_sequences_per_bin)
    max_count = max_sequences_per_bin or len(lengths) or 1
    skip = [shareable_prefix(m) for m in loss_masks]
    groups: dict[tuple[int, ...], list[int]] = {}
    for s, tokens in enumerate(token_ids):
        key = tuple(tokens[:skip[s] + 1]) if skip[s] > 0 else (-1 - s,)  # unshareable: a group of its own
        groups.setdefault(key, []).append(s)
    if all(len(g) == 1 for g in groups.values()):
        return plan_packing(lengths, bin_capacity, max_sequences_per_bin)

    n = len(lengths)
    shared, holder = [0] * n, [-1] * n
    clusters: list[list[int]] = []  # holder first, then members, each in sequence order
    cluster_lengths: list[int] = []  # positions each cluster takes
    for members in sorted(groups.values(), key=lambda g: g[0]):
        current: list[int] = []
        used = 0
        for s in members:
            stored = lengths[s] - skip[s] if current else lengths[s]
            if current and (used + stored > bin_capacity or len(current) >= max_count):
                clusters.append(current)
                cluster_lengths.append(used)
                current, used, stored = [], 0, lengths[s]
            if current:
                shared[s], holder[s] = skip[s], current[0]
            current.append(s)
            used += stored
        clusters.append(current)
        cluster_lengths.append(used)

    stored_lengths = [length - k for length, k in zip(lengths, shared)]
    placed = first_fit_decreasing(cluster_lengths, [len(c) for c in clusters], bin_capacity, max_count)
    ordered = [[s for c in sorted(items, key=lambda i: clusters[i][0]) for s in clusters[c]] for items in placed]
    seq_to_bin, starts, bins = layout_bins(ordered, stored_lengths)
    return PackingInfo(bin_capacity, tuple(stored_lengths), seq_to_bin, starts, bins, tuple(shared), tuple(holder))
