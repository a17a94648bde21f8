"""megatron-core's local attention replaced for one forward call (a registered per-call patch).

The local layer spec has no packed (THD) path: its ``DotProductAttention`` asserts ``packed_seq_params is None``,
so rows holding several sequences would attend as one masked ``S x S`` product. For one forward call of packed
rows, :func:`attention_forward_per_call` gives every local ``DotProductAttention`` of a model another forward
(built from its own: :mod:`megatron.rl.packing.packed_forward` calls it once per sequence, or per group of
similar lengths), and restores it afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from megatron.rl.runtime.patches import register

__all__ = ["ATTENTION_PER_CALL", "attention_forward_per_call"]

ATTENTION_PER_CALL = "local attention per sequence, for one packed forward"


@register(ATTENTION_PER_CALL, when="per call",
          changes="megatron.core.transformer.dot_product_attention:DotProductAttention.forward (an instance "
                  "attribute on each local attention module, for one forward call)",
          why="the local layer spec has no THD path, so packed rows would attend over whole rows (a masked S x S "
              "product per row): per-sequence calls give each sequence the product it has alone")
@contextlib.contextmanager
def attention_forward_per_call(model: torch.nn.Module,
                               make_forward: Callable[[Callable], Callable]) -> Iterator[list[torch.nn.Module]]:
    """While active, every local ``DotProductAttention`` of ``model`` (not TransformerEngine's) runs
    ``make_forward(its own forward)``; yields those modules (empty: the model has none, nothing changed)."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention  # heavy: megatron-core

    modules = [m for m in model.modules() if type(m) is DotProductAttention]
    for m in modules:
        m.forward = make_forward(m.forward)  # an instance attribute: shadows the class's forward
    try:
        yield modules
    finally:
        for m in modules:
            del m.forward
