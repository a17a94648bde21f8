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

Status: the capture itself runs only on a GPU and has not been measured there yet; on CPU the logic is tested with a
stand-in for the capture (``capture=``).
"""
from __future__ import annotations

import logging
from typing import Callable

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
    """Decode forwards by bucket: captured on first use, replayed after, eager where capture failed.

    forward: the step's forward ``(input_ids, position_ids) -> logits``. capture: how to capture (default
    :func:`cuda_graph_capture`; tests pass a stand-in).
    """

    def __init__(self, forward: Forward, capture: Callable[[Callable[[], torch.Tensor]], tuple[Replay, torch.Tensor]]
                 = cuda_graph_capture):
        self._forward = forward
        self._capture = capture
        # rows -> (replay, output, input addresses), or None: eager for good
        self._graphs: dict[int, tuple[Replay, torch.Tensor, tuple[int, int]] | None] = {}

    @property
    def captured(self) -> list[int]:
        return sorted(rows for rows, g in self._graphs.items() if g is not None)

    def __call__(self, rows: int, input_ids: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        addresses = (input_ids.data_ptr(), position_ids.data_ptr())
        if rows not in self._graphs:
            try:
                replay, out = self._capture(lambda: self._forward(input_ids, position_ids))
            except Exception as e:  # noqa: BLE001 - any failure to capture means: run this bucket eagerly
                log.warning("decode step of %d rows: CUDA graph capture failed (%r); it runs eagerly", rows, e)
                self._graphs[rows] = None
                return self._forward(input_ids, position_ids)
            self._graphs[rows] = (replay, out, addresses)
        entry = self._graphs[rows]
        if entry is None or entry[2] != addresses:  # not captured, or inputs moved: the graph would read stale memory
            return self._forward(input_ids, position_ids)
        entry[0]()
        return entry[1]
