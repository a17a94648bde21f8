"""megatron-core's reshard planner, taught the expert names of the local layer spec (a registered patch).

The refit of an inference copy at its own layout (:mod:`megatron.rl.layout.refit`) moves weights with
megatron-core's ``swap_model_weights``, whose planner matches parameters across layouts by a "resolved name" in
which per-rank expert indices become global ones, but only for TEGroupedMLP names
(``...experts.linear_fc1.weightK``). The local layer spec's SequentialMLP names its experts
``...experts.local_experts.K...`` with K local to the expert-parallel rank, so with EP > 1 two ranks'
``local_experts.0`` are different experts under one name (the refit fails with "not found in source model", or
copies the wrong expert). Its replicated expert tensors (a RowParallelLinear bias) are also planned over the
dense data-parallel group, which holds different experts, instead of the expert data-parallel group.
"""
from __future__ import annotations

import re

import torch.distributed as dist

from megatron.rl.runtime.patches import register

__all__ = ["PLANNER_PATCH", "patch_planner_for_sequential_experts"]

PLANNER_PATCH = "reshard planner: SequentialMLP expert names"
_EXPERT_INDEX = re.compile(r"(?<=\.local_experts\.)(\d+)(?=\.)")


@register(PLANNER_PATCH, when="on use",
          changes="megatron.core.resharding.planner:extract_param_metadata (wrapped)",
          why="the planner resolves global expert indices only for TEGroupedMLP names: with the local spec's "
              "SequentialMLP and EP > 1, two ranks' local_experts.0 are different experts under one name, and "
              "replicated expert tensors are planned over the dense data-parallel group; the wrapper gives "
              "expert-parallel parameters their global index and the expert data-parallel group, nothing else")
def patch_planner_for_sequential_experts() -> None:
    """Wrap ``planner.extract_param_metadata`` (apply with ``patches.apply(PLANNER_PATCH)``: once)."""
    from megatron.core.resharding import planner  # heavy: megatron-core

    original = planner.extract_param_metadata

    def extract_param_metadata(param, param_name, owner_rank, pg_collection, num_experts=None,
                               layer_module_prefix_map=None, **later_args):
        # later_args: what newer releases add (0.19: rank_offset, _rank_list_cache), passed on unchanged
        meta = original(param, param_name, owner_rank, pg_collection, num_experts=num_experts,
                        layer_module_prefix_map=layer_module_prefix_map, **later_args)
        match = _EXPERT_INDEX.search(meta.resolved_name or "")
        if meta.is_ep and match is not None and meta.global_expert_index is None and num_experts:
            ep_ranks = meta.expert_parallel_group_ranks
            index = ep_ranks.index(owner_rank) * (num_experts // len(ep_ranks)) + int(match.group(1))
            meta.resolved_name = meta.resolved_name[:match.start()] + str(index) + meta.resolved_name[match.end():]
            meta.global_expert_index = index
            meta.data_parallel_group_ranks = dist.get_process_group_ranks(pg_collection.expt_dp)
        return meta

    planner.extract_param_metadata = extract_param_metadata
