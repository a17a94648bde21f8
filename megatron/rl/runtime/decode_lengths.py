"""What a decode step's attention knows on the host before the forward: its cache lengths, read once.

megatron-core hands every layer of a decode step the same lengths tensor. The engine's controller reads it back
once per step, before the forward (:func:`set_decode_lengths`), so the attention stand-in
(:mod:`megatron.rl.runtime.torch_attention`) plans the step without a device-to-host read in any layer, and, on a
CPU, with the rows' request ids, reads the :mod:`megatron.rl.runtime.decode_mirror`.
"""
from __future__ import annotations

import threading
from typing import Any, NamedTuple

import torch

__all__ = ["HostLengths", "padded_key_slots", "set_decode_lengths", "step_host"]

_HOST = threading.local()  # per engine thread


class HostLengths(NamedTuple):
    """What :func:`set_decode_lengths` knows on the host about the step whose lengths tensor is ``tensor``."""

    tensor: torch.Tensor
    version: int  # the tensor's version counter when read: megatron-core rewrites it in place for the next step
    lengths: list[int]
    key_multiple: int
    owner: Any  # the engine's context (for the decode mirror), or None
    request_ids: list | None  # each row's request (the decode mirror), or None: gather
    padded_slots: int  # rows x the longest length
    split_groups: bool = True  # False: one padded batch of all rows (a captured graph has one fixed plan)

    def key_slots(self, min_slots: int) -> int:
        """The key slots a single padded batch of all rows attends (:func:`padded_key_slots` of the longest)."""
        return padded_key_slots(max(self.lengths, default=1), min_slots, self.key_multiple)


def padded_key_slots(longest: int, min_slots: int, key_multiple: int) -> int:
    """The key slots a padded batch whose longest length is ``longest`` attends: at least ``min_slots`` (and 1),
    rounded up to a multiple of ``key_multiple``. Pure."""
    longest = max(longest, 1, min_slots)
    return -(-longest // key_multiple) * key_multiple


def step_host(cache_seqlens: torch.Tensor) -> HostLengths | None:
    """The host facts given for ``cache_seqlens`` as it is now, or None (not given, or the tensor changed since)."""
    host = getattr(_HOST, "lengths", None)
    if host is None or host.tensor is not cache_seqlens or host.version != cache_seqlens._version:
        return None
    return host


def set_decode_lengths(cache_seqlens: torch.Tensor, key_multiple: int = 1, request_ids: list | None = None,
                       owner: object = None, split_groups: bool = True) -> HostLengths:
    """Give this thread's next decode attention the host-side values of ``cache_seqlens`` (the tensor every layer of
    the step will receive), read once before the forward, so the forward reads nothing back from the device.

    ``key_multiple``: key slots attended are rounded up to a multiple of it (fixed shapes for few lengths; the extra
    slots are masked). The values are taken for as long as the tensor is unchanged (its version counter).
    ``request_ids`` (each row's request) and ``owner`` (the engine's context), on a CPU: attend over the engine's
    :mod:`decode_mirror` instead of gathering the paged cache in every layer. ``split_groups=False``: the rows are
    attended as one padded batch even when their lengths lie far apart (what a captured graph of the step needs: its
    plan then depends on the row count and :meth:`HostLengths.key_slots` alone). Returns what it gave.
    """
    lengths = cache_seqlens.tolist()
    _HOST.lengths = HostLengths(cache_seqlens, cache_seqlens._version, lengths, max(1, key_multiple), owner,
                                request_ids, len(lengths) * max(lengths, default=0), split_groups)
    return _HOST.lengths
