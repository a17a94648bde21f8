"""The packing API under its public name: the plan (:mod:`megatron.rl.packing.plan`) and the packed tensors built
from it (:mod:`megatron.rl.packing.batch`).

megatron-core's trainer and the reference design import these names from here; the code lives in
:mod:`megatron.rl.packing`, so nothing is defined in this module.
"""
from __future__ import annotations

from megatron.rl.packing.batch import (PackedBatch, align_generated_values, build_packed_batch, build_rank_batch,
                                       pack_per_token, unpack_per_token)
from megatron.rl.packing.plan import (MAX_SEQS_FLAG, PACKING_ALGOS, SEQ_LENGTH_FLAG, BinDistribution, PackingInfo,
                                      check_plan_inputs, distribute_bins, first_fit_decreasing, layout_bins,
                                      plan_packing)

__all__ = ["PackingInfo", "plan_packing", "check_plan_inputs", "layout_bins", "first_fit_decreasing",
           "BinDistribution", "PACKING_ALGOS", "distribute_bins", "SEQ_LENGTH_FLAG", "MAX_SEQS_FLAG", "PackedBatch",
           "align_generated_values", "build_packed_batch", "build_rank_batch", "pack_per_token", "unpack_per_token"]
