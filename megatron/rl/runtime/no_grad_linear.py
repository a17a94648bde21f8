"""megatron-core's local linear layers without an autograd Function when no gradient is being recorded.

megatron-core 0.16.1's ``ColumnParallelLinear`` / ``RowParallelLinear`` (the local layer spec) run every forward
through ``LinearWithGradAccumulationAndAsyncCommunication.apply`` and route the input through
``_CopyToModelParallelRegion.apply`` / ``_ReduceFromModelParallelRegion.apply``. An autograd Function call costs
its Python bookkeeping (argument unwrapping, context object, the tensor-parallel group lookup) even under
``torch.inference_mode``, where no graph is recorded: at a decode step of a small model on CPU that is a few
percent of the step, and the engine runs a decode step per generated token.

:func:`install` puts a thin wrapper in front of each of the three module-level functions the layers call. While
gradients are recorded (training, scoring with ``torch.enable_grad``), or with sequence parallelism (whose
forward gathers the input across ranks), the wrapper calls megatron-core's function unchanged. Otherwise it
computes what that function's forward computes, with the same torch calls in the same order, so the outputs
are the same bits (``test_no_grad_linear.py`` compares them):

- the linear: ``torch.matmul(input, weight.t())``, plus ``bias`` when there is one;
- copy to the tensor-parallel region: the input itself (its forward is the identity);
- reduce from the tensor-parallel region: megatron-core's ``_reduce`` (an all-reduce over the group, nothing
  when the group has one rank), what its forward calls.
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
