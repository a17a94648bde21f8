"""A separate inference layout: its typed config, its checks, and its process groups over the same ranks.

``--rl-inference-{tensor,pipeline,expert}-model-parallel-size`` give the inference copy of the policy its own
layout, built with a ``ProcessGroupCollection`` made here over the same ranks (megatron-core's
``RankGenerator``, order ``tp-cp-ep-dp-pp``). Must not: touch megatron-core's global ``parallel_state``, which
keeps describing the training layout. All checks run in :func:`validate_inference_layout`, before any model is
built.

Why a separate layout: docs/inference.md.
"""
from __future__ import annotations

import dataclasses
import logging
import torch.distributed as dist
from typing import Any

from megatron.rl import runtime
from megatron.rl.base.errors import ConfigError
from megatron.rl.base.flags import flag
from megatron.rl.inference.api import backend_class
from megatron.rl.inference.engine.lockstep import lockstep_rank_groups
from megatron.rl.training.config import TrainingConfig

log = logging.getLogger(__name__)

REFIT_METHODS = ("gloo", "nccl")


@dataclasses.dataclass(frozen=True)
class InferenceLayoutConfig:
    """Flags of the separate inference layout. ``None`` sizes inherit the training layout.

    ``enabled`` is False when no ``--rl-inference-*-model-parallel-size`` flag was given: the training
    model then generates itself (no copy, no refit), exactly as before this feature.
    """

    tensor_model_parallel_size: int | None = flag(
        None, name="--rl-inference-tensor-model-parallel-size",
        help="Generate with a copy of the policy at this TP (default: generate with the training model itself, at "
             "the training layout). The copy is refit after every update.")
    pipeline_model_parallel_size: int | None = flag(
        None, name="--rl-inference-pipeline-model-parallel-size",
        help="PP of the inference copy (default: the training PP when a copy is built).")
    expert_model_parallel_size: int | None = flag(
        None, name="--rl-inference-expert-model-parallel-size",
        help="EP of the inference copy (default: the training EP when a copy is built).")
    refit_method: str | None = flag(  # None: nccl on CUDA, gloo on CPU
        None, choices=REFIT_METHODS,
        help="How the trainer's weights reach the inference copy: megatron-core's gloo or NCCL copy service "
             "(default nccl on CUDA, gloo on CPU).")
    verify_model_weights_swap: bool = flag(
        False, name="--rl-verify-model-weights-swap",
        help="After the first refit, compare the inference copy's logits with the trainer's on a probe batch and "
             "stop if they differ.")

    @property
    def enabled(self) -> bool:
        return any(v is not None for v in (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                                            self.expert_model_parallel_size))

    def sizes(self, cfg: TrainingConfig) -> "LayoutSizes":
        """The inference (TP, PP, EP) with unset flags taken from the training layout."""
        p = cfg.parallel
        tp = self.tensor_model_parallel_size or p.tensor_model_parallel_size
        pp = self.pipeline_model_parallel_size or p.pipeline_model_parallel_size
        ep = self.expert_model_parallel_size or p.expert_model_parallel_size
        return LayoutSizes(world=p.world_size, tp=tp, pp=pp, ep=ep)

    def resolved_refit_method(self, cuda: bool) -> str:
        return self.refit_method or ("nccl" if cuda else "gloo")


@dataclasses.dataclass(frozen=True)
class LayoutSizes:
    """World size and (TP, PP, EP) of one layout; DP and the expert grid follow."""

    world: int
    tp: int
    pp: int
    ep: int = 1

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp)

    @property
    def expert_tp(self) -> int:
        return self.tp  # megatron-core's default --expert-tensor-parallel-size

    @property
    def expert_dp(self) -> int:
        return self.world // (self.expert_tp * self.ep * self.pp)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def validate_inference_layout(layout: InferenceLayoutConfig, cfg: TrainingConfig, inference_backend: str,
                              cuda: bool | None = None) -> None:
    """Reject layouts that cannot work, naming the flag, before any model is built.

    ``cuda``: whether the run uses CUDA (default: the runtime's choice).
    """
    if cuda is None:
        cuda = runtime.cuda_usable()
    if layout.refit_method == "nccl" and not cuda:
        raise ConfigError("--refit-method nccl needs CUDA (NCCL moves GPU tensors); this run has no usable GPU: "
                          "use --refit-method gloo (the default on CPU).")
    if not layout.enabled:
        if layout.refit_method is not None or layout.verify_model_weights_swap:
            log.warning("--refit-method / --rl-verify-model-weights-swap have no effect without a separate "
                        "inference layout (--rl-inference-tensor-model-parallel-size etc.)")
        return
    _need(backend_class(inference_backend).in_process_engine,
          f"--inference-backend {inference_backend} does not generate with this run's megatron-core policy, so a "
          f"separate inference layout (--rl-inference-*-model-parallel-size) has nothing to build: drop those "
          f"flags, or use --inference-backend megatron.")
    for flag, value in (("--rl-inference-tensor-model-parallel-size", layout.tensor_model_parallel_size),
                        ("--rl-inference-pipeline-model-parallel-size", layout.pipeline_model_parallel_size),
                        ("--rl-inference-expert-model-parallel-size", layout.expert_model_parallel_size)):
        _need(value is None or value >= 1, f"{flag}={value}: must be >= 1.")
    s = _validate_sizes(layout, cfg)
    p = cfg.parallel
    same = (s.tp, s.pp, s.ep) == (p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                   p.expert_model_parallel_size)
    if same:
        log.warning("the inference layout equals the training layout (TP=%d PP=%d EP=%d): the copy costs memory "
                    "and a refit per update for no speed-up; drop --rl-inference-*-model-parallel-size to "
                    "generate with the training model itself", s.tp, s.pp, s.ep)


def _validate_sizes(layout: InferenceLayoutConfig, cfg: TrainingConfig) -> LayoutSizes:
    """The inference layout's sizes, once they divide the world, the heads, the layers and the experts."""
    s = layout.sizes(cfg)
    m = cfg.model
    world = s.world
    _need(world % (s.tp * s.pp) == 0,
          f"--rl-inference-tensor-model-parallel-size={s.tp} x --rl-inference-pipeline-model-parallel-size={s.pp} "
          f"= {s.tp * s.pp} does not divide the world size {world}: the inference copy needs whole replicas "
          f"over the same ranks.")
    _need(m.num_attention_heads % s.tp == 0,
          f"--rl-inference-tensor-model-parallel-size={s.tp} does not divide --num-attention-heads="
          f"{m.num_attention_heads}.")
    groups = m.num_query_groups or m.num_attention_heads
    _need(groups % s.tp == 0,
          f"--rl-inference-tensor-model-parallel-size={s.tp} does not divide --num-query-groups={groups}.")
    _need(m.num_layers % s.pp == 0,
          f"--rl-inference-pipeline-model-parallel-size={s.pp} does not divide --num-layers={m.num_layers}.")
    if m.num_experts is None:
        _need(s.ep == 1, f"--rl-inference-expert-model-parallel-size={s.ep} needs a MoE model (--num-experts).")
    else:
        _need(world % (s.expert_tp * s.ep * s.pp) == 0,
              f"--rl-inference-expert-model-parallel-size={s.ep} x inference TP {s.expert_tp} x inference PP "
              f"{s.pp} does not divide the world size {world}.")
        _need(m.num_experts % s.ep == 0,
              f"--rl-inference-expert-model-parallel-size={s.ep} does not divide --num-experts={m.num_experts}.")
    p = cfg.parallel
    if s.pp > 1 and p.pipeline_model_parallel_size == 1:
        # With tied embeddings a pipelined GPTModel keeps its own copy of the output weight on the last
        # stage ("output_layer.weight"); an unpipelined trainer has no parameter of that name, and
        # megatron-core's reshard planner matches parameters by name, so the refit could not fill it.
        _need(m.untie_embeddings_and_output_weights,
              f"--rl-inference-pipeline-model-parallel-size={s.pp} with tied embeddings and an unpipelined trainer: "
              f"megatron-core's refit (resharding planner) has no source for the last stage's output-layer copy; "
              f"use --rl-inference-pipeline-model-parallel-size 1, or --untie-embeddings-and-output-weights.")
    return s


# ---------------------------------------------------------------------------------------------- groups


def layout_rank_lists(s: LayoutSizes) -> dict[str, list[list[int]]]:
    """Every process group of a layout as lists of global ranks, named like ``ProcessGroupCollection``'s fields.

    Pure (no process group needed): megatron-core's ``RankGenerator`` in its default order.
    """
    from megatron.core.parallel_state import RankGenerator

    order = "tp-cp-ep-dp-pp"
    dec = RankGenerator(tp=s.tp, ep=1, dp=s.dp, pp=s.pp, cp=1, order=order)
    exp = RankGenerator(tp=s.expert_tp, ep=s.ep, dp=s.expert_dp, pp=s.pp, cp=1, order=order)
    pp = dec.get_ranks("pp")
    out = {
        "tp": dec.get_ranks("tp"), "pp": pp, "dp": dec.get_ranks("dp"), "cp": dec.get_ranks("cp"),
        "mp": dec.get_ranks("tp-pp"), "tp_cp": dec.get_ranks("tp-cp"), "dp_cp": dec.get_ranks("dp-cp"),
        "tp_dp_cp": dec.get_ranks("tp-dp-cp"),
        "embd": [[r[0], r[-1]] if len(r) > 1 else [r[0]] for r in pp], "pos_embd": [[r[0]] for r in pp],
        "ep": exp.get_ranks("ep"), "expt_tp": exp.get_ranks("tp"), "tp_ep": exp.get_ranks("tp-ep"),
        "tp_ep_pp": exp.get_ranks("tp-ep-pp"), "expt_dp": exp.get_ranks("dp"),
    }
    out["intra_dp_cp"] = out["dp_cp"]
    out["intra_expt_dp"] = out["expt_dp"]
    return out


def lockstep_ranks(s: LayoutSizes) -> list[list[int]]:
    """Ranks whose forwards communicate (union of TP, PP, EP groups): one lockstep group each."""
    return lockstep_rank_groups(s.world, s.tp, s.pp, s.ep, s.expert_tp)


@dataclasses.dataclass
class InferenceGroups:
    """This rank's process groups of the inference layout, and where it sits in it."""

    sizes: LayoutSizes
    pg_collection: Any  # megatron.core.process_groups_config.ProcessGroupCollection
    lockstep_group: Any  # gloo group of this rank's replica (None when the replica is one rank)
    lockstep_source: int  # the replica's lowest global rank
    replica_rank: int  # which inference replica (data-parallel rank of the inference layout)
    num_replicas: int
    pp_rank: int


def build_inference_groups(s: LayoutSizes, backend: str | None = None) -> InferenceGroups:
    """Create the inference layout's process groups (collective over the world: every rank creates every
    group in the same order, as ``torch.distributed.new_group`` requires)."""
    from megatron.core.process_groups_config import ProcessGroupCollection

    rank = dist.get_rank()
    if dist.get_world_size() != s.world:
        raise ConfigError(f"the inference layout was validated for world size {s.world}, "
                          f"but {dist.get_world_size()} processes are running")
    created: dict[tuple[int, ...], Any] = {}
    mine: dict[str, Any] = {}
    for kind, lists in layout_rank_lists(s).items():
        for ranks in lists:
            key = tuple(ranks)
            if key not in created:
                created[key] = dist.new_group(list(ranks), backend=backend)
            if rank in ranks:
                mine[kind] = created[key]
    pgc = ProcessGroupCollection(**mine)
    lock_group, source = None, rank
    for members in lockstep_ranks(s):
        group = dist.new_group(members, backend="gloo") if len(members) > 1 else None
        if rank in members:
            lock_group, source = group, members[0]
    dp_ranks = next(r for r in layout_rank_lists(s)["dp"] if rank in r)
    pp_ranks = next(r for r in layout_rank_lists(s)["pp"] if rank in r)
    return InferenceGroups(sizes=s, pg_collection=pgc, lockstep_group=lock_group, lockstep_source=source,
                           replica_rank=dp_ranks.index(rank), num_replicas=s.dp, pp_rank=pp_ranks.index(rank))
