"""A dense copy of a decode batch's keys and values, kept up to date step by step, so decode attention reads
K and V in place instead of gathering them from the paged cache in every layer of every step.

Layout ``[rows, kv_heads, slots, dim]`` per layer; a step copies only what is new. The paged cache stays the
source of truth and the mirror is rebuilt from it whenever in doubt; results equal the gathered batch's bit
for bit. CPU only, only while a layer's mirror is no larger than its paged cache, and only when the engine gives
the rows' request ids (:func:`decode_lengths.set_decode_lengths`); otherwise attention gathers.

Details: docs/runtime.md.
"""
from __future__ import annotations

import dataclasses
import threading
import weakref
from typing import Any

import torch

from megatron.rl.runtime.ranges import concat_ranges

# A layer's mirror may hold at most this many times its paged cache's elements (a batch too wide or too long for that
# gathers): memory stays within what the KV cache was given, once more.
CACHE_SHARE = 1.0
ROW_MULTIPLE = 32  # rows and slots are allocated in these multiples, so a mirror is not regrown every step
SLOT_MULTIPLE = 128

_LOCAL = threading.local()
# Mirror tensors of engines that stopped, for the next engine thread (each rollout phase steps a new one): fresh
# ones are page-faulted on first touch again. Keyed by (shape, dtype, device, made under inference mode); what
# they hold is finite (zeros or copied cache values), which is all a slot not written yet must hold.
_FREE: dict[tuple, list[tuple[torch.Tensor, torch.Tensor]]] = {}
_FREE_LOCK = threading.Lock()


@dataclasses.dataclass
class _Layer:
    """One layer's mirror: keys and values [rows, kv_heads, slots, dim], and what its rows hold."""

    keys: torch.Tensor
    values: torch.Tensor
    state: "_State"


@dataclasses.dataclass(frozen=True)
class _State:
    """Which request each mirror row holds (None: nothing) and how many of its tokens (slots 0 .. length - 1)."""

    ids: tuple
    lengths: tuple


_EMPTY = _State((), ())


@dataclasses.dataclass
class _Plan:
    """One step's copies from the paged cache into the mirror of every layer at state ``before``."""

    before: _State
    ids: list
    lengths: list
    table: torch.Tensor
    table_version: int
    width: int
    after: _State
    src: torch.Tensor | None
    dst: torch.Tensor | None


class DecodeMirror:
    """The mirrors of one engine (its context is the ``owner``), one per layer, on the thread that steps it."""

    def __init__(self, owner: Any):
        self.owner = weakref.ref(owner)
        self.layers: dict[int, _Layer] = {}  # keyed by the layer's key cache (its data pointer)
        self.plan: _Plan | None = None

    def forget(self, request_ids) -> None:
        """These requests' tokens are being computed again (readmitted after an eviction): no mirror row keeps
        its old copy of them."""
        gone = set(request_ids)
        cleaned: dict[int, _State] = {}
        for layer in self.layers.values():
            state = layer.state
            if gone.isdisjoint(state.ids):
                continue
            if id(state) not in cleaned:
                cleaned[id(state)] = _State(tuple(None if i in gone else i for i in state.ids),
                                            tuple(0 if i in gone else n for i, n in zip(state.ids, state.lengths)))
            layer.state = cleaned[id(state)]

    def key_values(self, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                   ids: list, lengths: list[int], slots: int):
        """K and V of the step's batch as views [batch, kv_heads, slots, dim] of this layer's mirror, after copying in
        what the paged caches ``k_cache``/``v_cache`` [blocks, block_size, kv_heads, dim] gained since; None when the
        mirror would be larger than the layer's paged cache.

        ``ids``: the request id of each batch row (rows past its end are padding); ``lengths``: each row's
        valid tokens (this step's included); ``slots``: key slots attended (>= every length). Every layer of a
        step gets the same ``ids`` and ``lengths`` lists.
        """
        batch = len(lengths)
        _, block_size, kv_heads, dim = k_cache.shape
        layer = self.layers.get(k_cache.data_ptr())
        if layer is not None and (layer.keys.shape[1] != kv_heads or layer.keys.shape[3] != dim
                                  or layer.keys.dtype != k_cache.dtype or layer.keys.device != k_cache.device):
            layer = None
        if layer is None or layer.keys.shape[0] < batch or layer.keys.shape[2] < slots:
            rows, width = (0, 0) if layer is None else (layer.keys.shape[0], layer.keys.shape[2])
            if slots > width:  # grow by half again at least, so a lengthening batch reallocates rarely
                width = max(slots, width + width // 2)
            rows = _round_up(max(rows, batch, 1), ROW_MULTIPLE)
            width = _round_up(width, SLOT_MULTIPLE)
            if rows * kv_heads * width * dim > CACHE_SHARE * k_cache.numel():
                return None
            layer = self.layers[k_cache.data_ptr()] = _Layer(*_tensors((rows, kv_heads, width, dim), k_cache),
                                                             _EMPTY)
        plan = self._plan(layer, block_table, ids, lengths, block_size, kv_heads)
        if plan.src is not None:
            for mirror, cache in ((layer.keys, k_cache), (layer.values, v_cache)):
                mirror.view(-1, dim).index_copy_(0, plan.dst, cache.reshape(-1, dim).index_select(0, plan.src))
        layer.state = plan.after
        return layer.keys[:batch, :, :slots], layer.values[:batch, :, :slots]

    def _plan(self, layer: _Layer, block_table: torch.Tensor, ids: list, lengths: list[int], block_size: int,
              kv_heads: int) -> _Plan:
        """What this step copies into ``layer``'s mirror: the first layer of a step works it out, the others (at
        the same state before it) reuse it."""
        width = layer.keys.shape[2]
        plan = self.plan
        if (plan is not None and plan.before is layer.state and plan.ids is ids and plan.lengths is lengths
                and plan.table is block_table and plan.table_version == block_table._version and plan.width == width):
            return plan
        before = layer.state
        rows, starts, ends, after_ids, after_lengths = [], [], [], [], []
        for r, length in enumerate(lengths):
            rid = ids[r] if r < len(ids) and length > 0 else None
            after_ids.append(rid)
            after_lengths.append(length if rid is not None else 0)
            if rid is None:
                continue
            start = 0
            if r < len(before.ids) and before.ids[r] == rid and before.lengths[r] <= length:
                start = before.lengths[r]  # the same request in the same row: only its new tokens
            if start < length:
                rows.append(r), starts.append(start), ends.append(length)
        src = dst = None
        if rows:
            src, dst = _copy_rows(block_table, rows, starts, ends, block_size, kv_heads, width)
        self.plan = _Plan(before, ids, lengths, block_table, block_table._version, width,
                          _State(tuple(after_ids), tuple(after_lengths)), src, dst)
        return self.plan


def _tensors(shape: tuple[int, ...], like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values tensors of ``shape``: a stopped engine's, or zeros (a slot never written must hold a finite
    value: a zero probability times it is zero)."""
    key = (shape, like.dtype, like.device, torch.is_inference_mode_enabled())
    with _FREE_LOCK:
        free = _FREE.get(key)
        if free:
            return free.pop()
    return (torch.zeros(shape, dtype=like.dtype, device=like.device),
            torch.zeros(shape, dtype=like.dtype, device=like.device))


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _copy_rows(block_table: torch.Tensor, rows: list[int], starts: list[int], ends: list[int], block_size: int,
               kv_heads: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a flattened paged cache [blocks * block_size * kv_heads, dim] holding tokens ``starts[i] ..
    ends[i] - 1`` of batch row ``rows[i]``, and the rows of a flattened mirror [rows * kv_heads * width, dim]
    they go to (pure)."""
    device = block_table.device
    segment, pos = concat_ranges(starts, ends, device)  # each token's position in its request
    row = torch.tensor(rows, device=device)[segment]
    slot = block_table[row, pos // block_size].long() * block_size + pos % block_size
    heads = torch.arange(kv_heads, device=device)
    src = (slot[:, None] * kv_heads + heads).reshape(-1)
    dst = ((row[:, None] * kv_heads + heads) * width + pos[:, None]).reshape(-1)
    return src, dst


def for_owner(owner: Any) -> DecodeMirror:
    """This thread's mirror for the engine whose context is ``owner`` (a new one when the engine changed)."""
    mirror = getattr(_LOCAL, "mirror", None)
    if mirror is None or mirror.owner() is not owner:
        mirror = _LOCAL.mirror = DecodeMirror(owner)
    return mirror


def current() -> DecodeMirror | None:
    return getattr(_LOCAL, "mirror", None)


def release() -> None:
    """Drop this thread's mirror (its engine stopped); CPU tensors go to the next engine thread's mirror."""
    mirror, _LOCAL.mirror = getattr(_LOCAL, "mirror", None), None
    if mirror is None:
        return
    with _FREE_LOCK:
        _FREE.clear()  # only the last engine's: the next one most likely has the same shapes
        for layer in mirror.layers.values():
            if layer.keys.device.type == "cpu":
                key = (tuple(layer.keys.shape), layer.keys.dtype, layer.keys.device, layer.keys.is_inference())
                _FREE.setdefault(key, []).append((layer.keys, layer.values))
