"""megatron-core's local linear layers without an autograd Function when no gradient is being recorded.

:func:`install` wraps the three module-level functions ``ColumnParallelLinear`` / ``RowParallelLinear`` call.
While gradients are recorded, or with sequence parallelism, megatron-core's function runs unchanged; otherwise
the wrapper computes its forward with the same torch calls in the same order (the same bits; tested), skipping
the autograd Function's Python bookkeeping; inside an engine's packed-weight scope large fp32 weights use
MKL's packed GEMM instead (:mod:`megatron.rl.runtime.packed_linear`).

Why, and what each wrapper computes: docs/runtime.md.
"""
from __future__ import annotations

import functools
from typing import Any, Callable

import torch

from megatron.rl.runtime import packed_linear

__all__ = ["install", "original", "installed"]

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_NAMES = ("linear_with_grad_accumulation_and_async_allreduce", "copy_to_tensor_model_parallel_region",
          "reduce_from_tensor_model_parallel_region")


def installed() -> bool:
    return bool(_ORIGINALS)


def original(name: str) -> Callable[..., Any]:
    """megatron-core's function ``name`` (one of the three this module wraps): for tests and fallbacks."""
    return _ORIGINALS[name]


def install() -> None:
    """Wrap the three functions in ``megatron.core.tensor_parallel.layers`` (idempotent)."""
    from megatron.core.tensor_parallel import layers, mappings

    if _ORIGINALS:
        return
    for name in _NAMES:
        _ORIGINALS[name] = getattr(layers, name)
    linear, copy, reduce = (_ORIGINALS[n] for n in _NAMES)

    @functools.wraps(linear)
    def linear_without_autograd(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                                sequence_parallel, *args, **kwargs):
        if sequence_parallel or torch.is_grad_enabled():
            return linear(input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad, sequence_parallel,
                          *args, **kwargs)
        packs = packed_linear.current()
        output = packs.linear(input, weight) if packs is not None else None
        if output is None:
            output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @functools.wraps(copy)
    def copy_without_autograd(input_, group=None):
        if torch.is_grad_enabled():
            return copy(input_, group=group)
        return input_

    @functools.wraps(reduce)
    def reduce_without_autograd(input_, group=None):
        if torch.is_grad_enabled():
            return reduce(input_, group=group)
        return mappings._reduce(input_, mappings.get_tensor_model_parallel_group_if_none(group))

    layers.linear_with_grad_accumulation_and_async_allreduce = linear_without_autograd
    layers.copy_to_tensor_model_parallel_region = copy_without_autograd
    layers.reduce_from_tensor_model_parallel_region = reduce_without_autograd
