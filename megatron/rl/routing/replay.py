"""MoE routing replay (``--rl-router-replay rollout``): the trainer routes each rollout token to the experts the
inference engine chose for it.

The engine records each token's top-k (:mod:`megatron.rl.inference.engine.route_recorder`), the rollout carries
it (:class:`~megatron.rl.base.routes.Routes`), and this module sets a
:class:`~megatron.rl.routing.replay_slot.RolloutRouterReplay` on each router of the models that need it, through
megatron-core's ``router_replay`` hook, lays the routes out in the router's token order
(:func:`router_token_order`) and counts how often the router would have chosen otherwise. It adds no router of
its own. Full activation recomputation and sinkhorn routing are refused (:mod:`megatron.rl.routing.config`).
Why replay, and why not megatron-core's own replay objects: docs/routing.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import torch

from megatron.rl.routing.config import RouterReplayError

if TYPE_CHECKING:
    from megatron.rl.routing.replay_slot import RolloutRouterReplay

__all__ = ["RouterReplaySet", "RouterReplayError", "install_router_replay", "router_replay_of", "moe_layer_numbers",
           "router_token_order", "replaying", "disagreement_share"]

_ATTR = "_rl_router_replay"


def moe_layer_numbers(config: Any) -> list[int]:
    """The (1-based) layer numbers of a model's MoE layers, from ``num_layers`` and ``moe_layer_freq``
    (an int: every n-th layer from the first; a list: 1 = MoE per layer), as megatron-core's layer specs read it."""
    if config.num_moe_experts is None:
        return []
    freq = getattr(config, "moe_layer_freq", 1)
    pattern = [int(i % freq == 0) for i in range(config.num_layers)] if isinstance(freq, int) else list(freq)
    return [i + 1 for i, moe in enumerate(pattern) if moe]


@dataclasses.dataclass
class RouterReplaySet:
    """The replay slots of one model's MoE routers on this rank, in layer order.

    layers[i]: the index (into a route's layer dimension, over the whole model's MoE layers) of ``replays[i]``;
    num_layers: MoE layers in the whole model (every pipeline stage); topk, num_experts: the routers'.
    """

    replays: list[RolloutRouterReplay]
    layers: list[int]
    num_layers: int
    topk: int
    num_experts: int

    def record(self) -> None:
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        for r in self.replays:
            r.recorded_topk_idx = None
            r.set_router_replay_action(RouterReplayAction.RECORD)

    def recorded(self) -> list[torch.Tensor | None]:
        """Each local router's top-k of its last forward ([tokens, k]), in layer order."""
        return [r.get_recorded_indices() for r in self.replays]

    def replay(self, targets: torch.Tensor) -> None:
        """Route the next forward by ``targets`` [tokens, num_layers, k] (router token order, ``-1`` rows: none)."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        if targets.shape[1:] != (self.num_layers, self.topk):
            raise RouterReplayError(f"routes of {targets.shape[1]} MoE layers x top-{targets.shape[2]} for a model "
                                    f"with {self.num_layers} MoE layers x top-{self.topk}: they were recorded on "
                                    f"another model")
        for r, layer in zip(self.replays, self.layers):
            r.set_target_indices(targets[:, layer])
            r.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def stop(self) -> None:
        """Back to the router's own choice; drop targets and records."""
        for r in self.replays:
            r.clear_router_replay_action()
            r.clear_indices()

    def take_disagreement(self) -> tuple[float, float]:
        """(rows whose own top-k differed from the replayed one, rows replayed) summed over this rank's routers
        since the last call; resets the counts."""
        differ = sum(float(r.differ) for r in self.replays)
        compared = sum(float(r.compared) for r in self.replays)
        for r in self.replays:
            r.differ, r.compared = 0, 0
        return differ, compared


def _unwrap(model: Any) -> torch.nn.Module:
    if isinstance(model, (list, tuple)):
        if len(model) != 1:
            raise RouterReplayError(f"routing replay needs one model chunk per rank, got {len(model)}")
        model = model[0]
    while hasattr(model, "module") and not hasattr(model, "decoder"):
        model = model.module
    return model


def install_router_replay(model: Any) -> RouterReplaySet:
    """Set a :class:`RolloutRouterReplay` on every MoE router of ``model`` (idempotent: a second call returns the
    same set). Raises :class:`RouterReplayError` for a model without MoE routers."""
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.utils import get_model_config

    from megatron.rl.routing.replay_slot import RolloutRouterReplay  # a megatron-core class: loads megatron-core

    gpt = _unwrap(model)
    existing = getattr(gpt, _ATTR, None)
    if existing is not None:
        return existing
    config = get_model_config(gpt)
    numbers = moe_layer_numbers(config)
    routers = sorted((m for m in gpt.modules() if isinstance(m, TopKRouter)), key=lambda m: m.layer_number)
    if not numbers:
        raise RouterReplayError("routing replay needs a MoE model (--num-experts), this one is dense")
    if config.moe_router_load_balancing_type == "sinkhorn":
        raise RouterReplayError("routing replay cannot replay sinkhorn routing (not a top-k megatron-core hands to "
                                "its replay hook): use another --moe-router-load-balancing-type")
    layers = []
    for router in routers:
        if router.layer_number not in numbers:
            raise RouterReplayError(f"router of layer {router.layer_number} is not among the MoE layers {numbers}")
        layers.append(numbers.index(router.layer_number))
        router.router_replay = RolloutRouterReplay()
    replay_set = RouterReplaySet([r.router_replay for r in routers], layers, len(numbers), config.moe_router_topk,
                                 config.num_moe_experts)
    setattr(gpt, _ATTR, replay_set)
    return replay_set


def router_replay_of(model: Any) -> RouterReplaySet | None:
    """The replay set :func:`install_router_replay` put on ``model`` (None: not installed)."""
    try:
        return getattr(_unwrap(model), _ATTR, None)
    except RouterReplayError:
        return None


def router_token_order(routes: torch.Tensor, thd: bool, sp_rank: int = 0, sp_size: int = 1) -> torch.Tensor:
    """Per-position routes [rows, S, layers, k] -> [tokens, layers, k] in the order this rank's routers see them.

    ``thd``: the rows are flattened into one sequence (``[1, rows * S]``), else the model gets ``[rows, S]`` and its
    layers work on ``[S, rows]``. With sequence parallelism (``sp_size`` = the TP size) rank ``sp_rank`` routes the
    ``sp_rank``-th contiguous share of that order.
    """
    rows, s = routes.shape[:2]
    flat = routes.reshape(rows * s, *routes.shape[2:]) if thd else routes.transpose(0, 1).reshape(
        rows * s, *routes.shape[2:])
    if sp_size == 1:
        return flat
    if flat.shape[0] % sp_size:
        raise RouterReplayError(f"{flat.shape[0]} tokens cannot be split over {sp_size} sequence-parallel ranks")
    share = flat.shape[0] // sp_size
    return flat[sp_rank * share:(sp_rank + 1) * share]


@contextlib.contextmanager
def replaying(model: Any, routes: torch.Tensor | None, thd: bool) -> Iterator[None]:
    """Route ``model``'s next forward by ``routes`` ([rows, S, layers, k] at the micro-batch's positions, ``-1`` =
    the router's own choice); nothing to do when ``routes`` is None or replay is not installed on ``model``."""
    replay_set = router_replay_of(model) if routes is not None else None
    if replay_set is None:
        yield
        return
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    sp = bool(getattr(get_model_config(_unwrap(model)), "sequence_parallel", False))
    tp = ps.get_tensor_model_parallel_world_size() if ps.model_parallel_is_initialized() else 1
    rank = ps.get_tensor_model_parallel_rank() if tp > 1 else 0
    device = next(_unwrap(model).parameters()).device
    replay_set.replay(router_token_order(routes, thd, rank, tp if sp else 1).to(device, torch.long))
    try:
        yield
    finally:
        replay_set.stop()


def disagreement_share(counts: Sequence[float]) -> float:
    """Share of replayed (token, layer) routes the trainer's own router would have chosen differently."""
    differ, compared = counts
    return differ / compared if compared else 0.0
