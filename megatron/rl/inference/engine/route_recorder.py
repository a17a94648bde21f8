"""Recording, per request, the MoE routes of every token the dynamic engine processes (``--rl-router-replay``).

After each step's forward, before megatron-core moves requests between slots, :meth:`RouteRecorder.harvest` maps
every row of the routers' records back to its request and position, so chunked prefills, decode steps and
requests resumed across an update all keep the routes of the step that computed them. Shared-prefill followers
take the leader's routes; with PP or sequence parallelism the pieces are combined over the model-parallel group.
A request's last token is never run: its routes stay ``-1``.

Details: docs/inference.md; replay itself: docs/routing.md.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from megatron.rl.base.routes import NO_ROUTE, Routes, route_dtype
from megatron.rl.routing.replay import RouterReplayError, RouterReplaySet

__all__ = ["RouteRecorder"]


class RouteRecorder:
    """Per-request route buffers filled from each engine step (see the module docstring).

    replay_set: the engine model's router replay slots; group: the model-parallel process group to combine pipeline
    stages' layers and sequence-parallel shares over (None: this rank routes every layer and every token); sp_rank /
    sp_size: this rank's share of a step's tokens under sequence parallelism (its TP rank and size; else 0 / 1).
    """

    def __init__(self, replay_set: RouterReplaySet, group: Any = None, sp_rank: int = 0, sp_size: int = 1):
        if not replay_set.replays:
            raise RouterReplayError("routing replay needs MoE layers on every pipeline stage; this rank has none")
        self.replay_set = replay_set
        self.group = group
        self.sp_rank, self.sp_size = sp_rank, sp_size
        self._dtype = np.int16 if route_dtype(replay_set.num_experts) == "int16" else np.int32
        self._buffers: dict[int, np.ndarray] = {}  # request id -> [positions, layers, k]

    # ------------------------------------------------------------------ requests

    def begin(self, request_id: int, length: int) -> None:
        self._buffers[request_id] = self._empty(max(length, 1))

    def _empty(self, length: int) -> np.ndarray:
        return np.full((length, self.replay_set.num_layers, self.replay_set.topk), NO_ROUTE, dtype=self._dtype)

    def _buffer(self, request_id: int, upto: int) -> np.ndarray | None:
        buf = self._buffers.get(request_id)
        if buf is not None and buf.shape[0] < upto:  # grown in doublings: most requests stop well short
            grown = self._empty(max(upto, 2 * buf.shape[0]))
            grown[:buf.shape[0]] = buf
            buf = self._buffers[request_id] = grown
        return buf

    def finish(self, request_id: int, num_tokens: int) -> Routes | None:
        """The routes of a finished request's first ``num_tokens`` tokens (prompt + generated), ``[layers, T, k]``."""
        buf = self._buffer(request_id, num_tokens)
        self._buffers.pop(request_id, None)
        if buf is None:
            return None
        return Routes.from_tensor(buf[:num_tokens].transpose(1, 0, 2), self.replay_set.num_experts)

    def drop(self, request_id: int) -> None:
        self._buffers.pop(request_id, None)

    # ------------------------------------------------------------------ engine steps (engine thread)

    def before_forward(self) -> None:
        self.replay_set.record()

    def harvest(self, context: Any) -> None:
        """After a step's forward, before ``update_requests``: each of the step's rows into its request's buffer."""
        recorded = self.replay_set.recorded()
        self.replay_set.stop()
        n = int(context.active_token_count)
        if n == 0 or any(r is None for r in recorded):
            return
        rows = self._whole_rows(recorded, n)  # [n, layers, k]
        slots = context.token_to_request_idx[:n]
        request_ids = context.request_ids[slots.long()].tolist()
        positions = context.token_to_position_in_request[:n].tolist()
        rows = rows.to("cpu").numpy()
        start = 0
        while start < n:  # a request's rows are contiguous and in position order
            rid, first = request_ids[start], positions[start]
            stop = start + 1
            while stop < n and request_ids[stop] == rid and positions[stop] == first + stop - start:
                stop += 1
            buf = self._buffer(rid, first + stop - start)
            if buf is not None:
                buf[first:first + stop - start] = rows[start:stop]
            start = stop
        for follower, leader, count in _shared_prefill_pairs(context):
            src = self._buffers.get(int(context.request_ids[leader]))
            dst = self._buffer(int(context.request_ids[follower]), count)
            if src is not None and dst is not None:
                dst[:count] = src[:count]

    def _whole_rows(self, recorded: list[torch.Tensor], n: int) -> torch.Tensor:
        """The step's first ``n`` rows at every MoE layer, combined over the model-parallel group if needed."""
        k = self.replay_set.topk
        local = torch.stack([r.reshape(-1, k) for r in recorded], dim=1)  # [rows (this rank's share), layers here, k]
        if self.group is None:
            return local[:n]
        share = local.shape[0]
        full = torch.full((share * self.sp_size, self.replay_set.num_layers, k), NO_ROUTE, dtype=torch.int32,
                          device=local.device)
        full[self.sp_rank * share:(self.sp_rank + 1) * share, self.replay_set.layers] = local.to(torch.int32)
        dist.all_reduce(full, op=dist.ReduceOp.MAX, group=self.group)  # every rank of the group, every step
        return full[:n]


def _shared_prefill_pairs(context: Any) -> list[tuple[int, int, int]]:
    """(follower slot, leader slot, prompt positions taken from the leader) of this step's shared prefills."""
    pairs = getattr(context, "shared_prefill_pairs", None)
    return list(pairs()) if callable(pairs) else []
