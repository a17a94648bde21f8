"""One MoE router's replay slot: a megatron-core ``RouterReplay`` subclass (importing this module loads
megatron-core, which is why :mod:`megatron.rl.routing.replay` imports it only where a slot is installed)."""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron.rl.routing.config import RouterReplayError

__all__ = ["RolloutRouterReplay"]


class RolloutRouterReplay(RouterReplay):
    """One router's replay slot: records its top-k (engine) or replays targets where given (trainer).

    ``target_topk_idx`` [tokens, k]: expert indices in the router's token order, rows of ``-1`` = no target (the
    router chooses itself). While replaying it counts, over rows with a target, how many the router's own top-k
    would have sent elsewhere (``differ`` of ``compared``), without a host synchronisation.
    """

    def __init__(self) -> None:
        # Not RouterReplay.__init__: it appends the instance to megatron-core's process-wide list.
        self.target_topk_idx: torch.Tensor | None = None
        self.recorded_topk_idx: torch.Tensor | None = None
        self.router_replay_action = None
        self.replay_backward_list: list[torch.Tensor] = []
        self.differ: torch.Tensor | int = 0
        self.compared: torch.Tensor | int = 0
        self.static_buffer: torch.Tensor | None = None  # megatron-core 0.19's CUDA-graph buffer: never set here
        self.layer_number: int | None = None  # 0.19 names the router's layer here; unused by the slot

    def set_target_indices(self, topk_indices: torch.Tensor) -> None:
        self.target_topk_idx = topk_indices  # no backward list: activation recomputation is refused

    def get_replay_topk(self, scores: torch.Tensor, topk: int, num_groups: int | None = None,
                        group_topk: int | None = None, default_compute_topk: Any = None):
        if self.router_replay_action != RouterReplayAction.REPLAY_FORWARD:
            return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)
        _, own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
        target = self.target_topk_idx
        if target is None or tuple(target.shape) != tuple(own.shape):
            raise RouterReplayError(f"replay targets of shape {None if target is None else tuple(target.shape)} for "
                                    f"a router that routes {tuple(own.shape)} (tokens, top-k): the routes do not "
                                    f"match this forward's tokens")
        target = target.to(device=own.device, dtype=own.dtype)
        given = target[:, :1] >= 0
        chosen = torch.where(given, target, own)
        moved = (own.sort(dim=-1).values != chosen.sort(dim=-1).values).any(dim=-1)
        self.differ = self.differ + moved.sum()
        self.compared = self.compared + given.sum()
        return scores.gather(1, chosen), chosen
