"""Which requests of a batch to attend together: groups of similar lengths, each one padded batch (pure).

A padded batch costs every request the longest request's length, and every group costs a fixed overhead (its
torch ops); the decode attention (:mod:`megatron.rl.runtime.torch_attention`) and the packed trainer's attention
(:mod:`megatron.rl.packing.packed_forward`) split where padding would cost more than another group.
"""
from __future__ import annotations

from typing import Sequence

__all__ = ["length_groups", "length_class_groups"]


def length_groups(lens: list[int], overhead: int) -> list[list[int]]:
    """Split requests (their key lengths ``lens``) into groups, each attended as one padded batch (pure).

    Minimises the sum over groups of ``overhead + size x longest length`` (padded slots plus a group's fixed
    cost in slots): :func:`length_class_groups`. One group (all of ``range(len(lens))``) when splitting does
    not pay.
    """
    # Not even a perfect split would pay: the common case, so it is checked before the per-request loop (this
    # runs once per layer and step).
    if not lens or len(lens) * max(lens) - sum(lens) <= overhead:
        return [list(range(len(lens)))]
    return length_class_groups(lens, overhead)


def length_class_groups(lens: Sequence[int], overhead: int, power: int = 1) -> list[list[int]]:
    """Groups of indices of ``lens`` minimising the sum over groups of ``overhead + size x longest^power`` (pure).

    Groups are made of whole power-of-two length classes (``(2^(c-1), 2^c]``): within a class padding at most
    doubles a request's length, and the few classes make an exact search cheap (a group spans adjacent
    classes). Groups come out from the shortest lengths to the longest, each in index order. ``power`` 1 is
    the cost of attending one query per request (decode), 2 of a whole sequence's queries (training).
    """
    classes: dict[int, list[int]] = {}
    for i, n in enumerate(lens):
        classes.setdefault((max(int(n), 1) - 1).bit_length(), []).append(i)  # n in (2^(c-1), 2^c]
    keys = sorted(classes)
    sizes = [len(classes[c]) for c in keys]
    longest = [max(lens[i] for i in classes[c]) ** power for c in keys]
    # best[j]: the cheapest split of classes[:j]; a group spans classes i..j-1 and pads to longest[j - 1]
    best, cut = [0] * (len(keys) + 1), [0] * (len(keys) + 1)
    for j in range(1, len(keys) + 1):
        best[j], count = None, 0
        for i in range(j - 1, -1, -1):
            count += sizes[i]
            cost = best[i] + overhead + count * longest[j - 1]
            if best[j] is None or cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], len(keys)
    while j > 0:
        groups.append(sorted(r for c in keys[cut[j]:j] for r in classes[c]))
        j = cut[j]
    return groups[::-1]
