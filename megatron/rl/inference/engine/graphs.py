"""CUDA graphs of the engine's decode forward, one per decode bucket, with an eager fallback.

A decode step of a small model on a GPU is bound by the host: hundreds of kernel launches from megatron-core's
Python, each a few microseconds of work. Replaying a captured graph launches them all at once. The decode step is
graph-safe (:mod:`megatron.rl.inference.engine.build`): with ``EngineSettings.decode_buckets`` its shapes come from a
few row counts, its inputs are views of the context's persistent buffers, and nothing in it reads a tensor's
value back on the host (tested on CPU: ``test_graph_safe_decode.py``).

:class:`DecodeGraphs` captures the forward the first time a bucket is seen (after warm-up runs on a side stream,
as ``torch.cuda.graphs`` asks) and replays it afterwards while the inputs are the same buffers. A capture that
fails (a collective of a model-parallel layout, an op that synchronises) leaves that bucket eager for the rest of
the engine's life, with one warning. Running the forward more than once in a step is harmless: it appends the same
keys and values at the same cache slots.

A graph replays the kernels of its captured run on the same memory, and no Python runs. Everything the forward works
out on the host therefore has to be the same for every step that replays it: the engine keys the graphs by row
count *and* the decode attention's key slots, plans the attention as one padded batch of all rows, and passes
``reset``, which drops the per-step memos (RoPE cos/sin, KV-append slots, attention plan) before every run handed to
the capture, so the captured run computes them inside the graph instead of reading values memoised by a warm-up run.

Status: not validated. The capture itself runs only on a GPU and has not been run there yet. On CPU,
``test_decode_graph_replay.py`` replays recorded operators the way a GPU replays a graph (the same operators on the
same tensors, no Python); the replayed steps do not give the eager tokens yet (an expected failure there), so
``train_rl.py`` refuses ``--cuda-graph-impl local`` unless asked explicitly
(:mod:`megatron.rl.inference.engine.engine_flags`).
"""
from __future__ import annotations

import logging
from typing import Callable, Hashable

import torch

log = logging.getLogger(__name__)

__all__ = ["DecodeGraphs", "cuda_graph_capture"]

Forward = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
Replay = Callable[[], None]


def cuda_graph_capture(run: Callable[[], torch.Tensor], warmup: int = 2) -> tuple[Replay, torch.Tensor]:
    """Capture ``run`` in a ``torch.cuda.CUDAGraph``: (replay, the graph's output tensor)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    return graph.replay, out


class DecodeGraphs:
    """Decode forwards by shape: captured on first use, replayed after, eager where capture failed.

    forward: the step's forward ``(input_ids, position_ids) -> logits``. capture: how to capture (default
    :func:`cuda_graph_capture`; tests pass a stand-in). reset: called before every run handed to the capture (the
    warm-up runs and the captured one), so nothing the forward memoises per step is read from outside the graph.
    """

    def __init__(self, forward: Forward, capture: Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]
                 = cuda_graph_capture, reset: Callable[[], None] = lambda: None):
        self._forward = forward
        self._capture = capture
        self._reset = reset
        # shape key -> (replay, output, input addresses), or None: eager for good
        self._graphs: dict[Hashable, tuple[Replay, torch.Tensor, tuple[int, int]] | None] = {}

    @property
    def captured(self) -> list:
        return sorted(key for key, g in self._graphs.items() if g is not None)

    def __call__(self, key: Hashable, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The logits of this step; ``key``: everything that fixes the step's shapes and host-side plan (rows, key
        slots)."""
        addresses = (input_ids.data_ptr(), position_ids.data_ptr())
        if key not in self._graphs:
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
        entry[0]()
        return entry[1]
