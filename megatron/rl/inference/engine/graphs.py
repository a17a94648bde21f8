"""CUDA graphs of the engine's decode forward, one per decode bucket, with an eager fallback.

:class:`DecodeGraphs` captures the (graph-safe) decode forward the first time a bucket (row count and decode key
slots) is seen and replays it afterwards while its inputs are the same buffers; ``reset`` drops the per-step memos
before a capture so the graph computes them itself, and :class:`KeepOperands` keeps every tensor the capture
touched alive. A failed capture leaves that bucket eager, with one warning; a graph's first replay in a later step
is checked against an eager forward (``verify``), and a stale replay fails the requests in flight with
:class:`GraphReplayError`. The capture runs only on a GPU (not yet run there). Why each rule: docs/inference.md.
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from megatron.rl.base.errors import RLError

log = logging.getLogger(__name__)

__all__ = ["DecodeGraphs", "GraphReplayError", "KeepOperands", "cuda_graph_capture"]

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Replay = Callable[[], None]


class KeepOperands(TorchDispatchMode):
    """Holds every tensor that the operators run under it read or write.

    A graph replays on the memory it was captured with. A tensor made outside the capture (a reused gather buffer
    that the eager code later regrows, a cache entry it later replaces) would otherwise be freed, and its memory
    handed to another tensor, while the graph still writes and reads it. Holding them for the graph's lifetime
    keeps the replay on its own memory.
    """

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.tensors.extend(t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
        return out


def cuda_graph_capture(run: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[Replay, torch.Tensor]:
    """Capture ``run`` in a ``torch.cuda.CUDAGraph``: (replay, the graph's output tensor). The replay holds every
    tensor the captured run touched (:class:`KeepOperands`)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    kept = KeepOperands()
    with torch.cuda.graph(graph), kept:
        out = run()

    def replay(graph: torch.cuda.CUDAGraph = graph, operands: list = kept.tensors) -> None:  # holds both
        graph.replay()

    return replay, out


class GraphReplayError(RLError, RuntimeError):
    """A replayed decode graph did not give the eager forward's logits."""


VERIFY_TOLERANCE = 1e-3  # relative to the largest |logit|: kernels may differ in rounding; a stale value does not


class DecodeGraphs:
    """Decode forwards by shape: captured on first use, replayed after, eager where capture failed.

    forward: the step's forward ``(input_ids, position_ids) -> logits``. capture: how to capture (default
    :func:`cuda_graph_capture`; tests pass a stand-in). reset: called before every run handed to the capture (the
    warm-up runs and the captured one), so nothing the forward memoises per step is read from outside the graph.
    verify: each graph's first replay in a step after its capture is checked against an eager forward of the same
    step (one forward more per graph; running the forward twice in a step is harmless); a graph whose logits differ
    raises :class:`GraphReplayError` (the requests in flight fail) and is dropped.
    """

    def __init__(self, forward: Forward, capture: Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]
                 = cuda_graph_capture, reset: Callable[[], None] = lambda: None, verify: bool = True):
        self._forward = forward
        self._capture = capture
        self._reset = reset
        self._verify = verify
        self._verified: set = set()
        # shape key -> (replay, output, input addresses), or None: eager for good
        self._graphs: dict[Hashable, tuple[Replay, torch.Tensor, tuple[int, int]] | None] = {}

    @property
    def captured(self) -> list:
        return sorted(key for key, g in self._graphs.items() if g is not None)

    def __call__(self, key: Hashable, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The logits of this step; ``key``: everything that fixes the step's shapes and host-side plan (rows, key
        slots)."""
        addresses = (input_ids.data_ptr(), position_ids.data_ptr())
        captured_now = key not in self._graphs
        if captured_now:
            def run() -> torch.Tensor:
                self._reset()
                return self._forward(input_ids, position_ids)

            try:
                replay, out = self._capture(run)
            except Exception as e:  # noqa: BLE001 - any failure to capture means: run this shape eagerly
                log.warning("decode step %s: CUDA graph capture failed (%r); it runs eagerly", key, e)
                self._graphs[key] = None
                self._reset()
                return self._forward(input_ids, position_ids)
            self._graphs[key] = (replay, out, addresses)
        entry = self._graphs[key]
        if entry is None or entry[2] != addresses:  # not captured, or inputs moved: the graph would read stale memory
            return self._forward(input_ids, position_ids)
        entry[0]()  # also right after the capture: a captured run records its kernels without running them
        if self._verify and not captured_now and key not in self._verified:  # the first replay of a later step
            self._verified.add(key)
            return self._checked(key, entry[1], input_ids, position_ids)
        return entry[1]

    def _checked(self, key: Hashable, replayed: torch.Tensor, input_ids: torch.Tensor,
                 position_ids: torch.Tensor) -> torch.Tensor:
        """``replayed`` if an eager forward of the same step gives the same logits; else :class:`GraphReplayError`, and
        the graph of ``key`` dropped."""
        self._reset()
        eager = self._forward(input_ids, position_ids)  # its own memory: the graph's output stays as replayed
        gap = float((replayed.float() - eager.float()).abs().max()) if replayed.shape == eager.shape else float("inf")
        if gap <= VERIFY_TOLERANCE * max(float(eager.float().abs().max()), 1.0):
            return replayed
        self._graphs[key] = None
        # The replay has also appended its keys and values where the captured step did, over cache entries of the
        # requests in flight: they cannot go on. Fail them, loudly, rather than sample from a corrupted cache.
        raise GraphReplayError(f"decode step {key}: the replayed CUDA graph's logits differ from an eager forward's "
                               f"(max |diff| {gap:.3g}): the captured step read a value that changes from step to "
                               f"step. The requests in flight fail; run without --cuda-graph-impl local.")
