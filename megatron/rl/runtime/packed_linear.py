"""Inference linear layers on MKL's packed-weight GEMM (CPU, fp32), inside a scope that owns the packs.

MKL's ``sgemm`` re-packs its weight operand on every call. A decode step calls every weight once, with the same
row count as the step before, so :class:`PackedWeights` packs a weight for a row count
(``torch.ops.mkl._mkl_reorder_linear_weight``) when two calls in a row have it, and later calls with it reuse
the pack (``torch.ops.mkl._mkl_linear``). A pack is a copy of the weights it was made from: its owner drops the
packs (:meth:`PackedWeights.clear`) before the weights change, and outside a scope nothing is packed. Results can
differ from ``torch.matmul`` in the last bits (another summation order). Packs pay on some CPUs and cost on others:
:func:`pays_off` is the engine's default. Design notes: docs/inference.md.
"""
from __future__ import annotations

import contextlib
import functools
import threading
from typing import Iterator

import torch

from megatron.rl.runtime import machine

__all__ = ["PackedWeights", "available", "current", "packing", "packs_pay", "pays_off"]

MIN_WEIGHT_ELEMENTS = 512 * 512  # smaller weights: the pack saved nothing measurable (docs/inference.md)
MAX_ROW_COUNTS = 1  # packs kept per weight, each as large as the weight: a generation holds one more copy

_LOCAL = threading.local()


def available() -> bool:
    """Whether this torch build has MKL's packed GEMM."""
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


@functools.lru_cache(maxsize=None)
def pays_off() -> bool:
    """Whether packs are the faster default on this machine (:func:`packs_pay`)."""
    return available() and packs_pay(torch.backends.cpu.get_cpu_capability(), machine.read_cpuinfo() or "")


def packs_pay(capability: str, cpuinfo: str) -> bool:
    """Packs pay on an Intel CPU whose torch kernels use AVX-512 (``capability`` as
    ``torch.backends.cpu.get_cpu_capability()``, ``cpuinfo`` a ``/proc/cpuinfo`` text).

    On the large benchmark model's decode steps the packed GEMM made a step faster on an Intel Xeon with AVX-512 and
    slower on an AMD EPYC with AVX2 (docs/benchmarks.md). CPUs not measured keep the plain matmul."""
    return capability == "AVX512" and machine.cpuinfo_field(cpuinfo, "vendor_id") == "GenuineIntel"


class PackedWeights:
    """The packs of one scope, keyed by weight; a weight is packed for a row count when two calls in a row have it."""

    def __init__(self) -> None:
        self._packs: dict[int, tuple[torch.Tensor, dict[int, torch.Tensor]]] = {}
        self._last_rows: dict[int, int] = {}
        self.packed = 0  # packs made (a diagnostic)

    def linear(self, input: torch.Tensor, weight: torch.Tensor) -> torch.Tensor | None:
        """``input @ weight.T`` from a pack, or None where the plain matmul applies (not fp32 CPU, a small weight,
        a row count not yet repeated)."""
        if (input.dtype != torch.float32 or weight.dtype != torch.float32 or input.device.type != "cpu"
                or weight.device.type != "cpu" or weight.dim() != 2 or weight.numel() < MIN_WEIGHT_ELEMENTS):
            return None
        rows = input.numel() // input.shape[-1]
        key = id(weight)
        entry = self._packs.get(key)
        if entry is None or entry[0] is not weight:
            entry = self._packs[key] = (weight, {})
        packs = entry[1]
        pack = packs.get(rows)
        repeated, self._last_rows[key] = self._last_rows.get(key) == rows, rows
        if pack is None:
            if not repeated:
                return None
            if len(packs) >= MAX_ROW_COUNTS:
                packs.pop(next(iter(packs)))
            pack = packs[rows] = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
            self.packed += 1
        flat = input.reshape(rows, input.shape[-1])
        out = torch.ops.mkl._mkl_linear(flat, pack, weight, None, rows)
        return out.view(*input.shape[:-1], weight.shape[0])

    def clear(self) -> None:
        """Drop every pack: the weights are about to change (or did)."""
        self._packs.clear()
        self._last_rows.clear()


def current() -> PackedWeights | None:
    """The packs of this thread's open scope, if any."""
    return getattr(_LOCAL, "packs", None)


@contextlib.contextmanager
def packing(enabled: bool = True) -> Iterator[PackedWeights | None]:
    """Open a scope on this thread in which inference linear layers use packed weights (when ``enabled`` and
    :func:`available`); the packs are dropped on the way out."""
    if not (enabled and available()):
        yield None
        return
    packs = _LOCAL.packs = PackedWeights()
    try:
        yield packs
    finally:
        _LOCAL.packs = None
        packs.clear()
