"""CUDA graphs of the decode step, replayed the way a GPU replays them, on CPU.

A CUDA graph records the kernels one run launched, on the tensors that run used, and a replay launches the same
kernels on the same memory: no Python runs, so whatever the captured run took from the host or from a cache filled
before the capture is frozen into the graph. :class:`RecordedGraph` does the same on CPU: during the capture it
records every aten operator with its arguments and outputs (and fails on any read of a tensor's value, as a
capturing stream does); a replay re-runs those operators on the same tensors, in order, writing each result into the
tensor the capture produced. A decode step whose graph is replayed must then give the tokens and log-probs of the
eager step, bit for bit: any plan, position or slot worked out on the host, or memoised before the capture, would be
replayed stale.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit_tests.rl.inference.engine.test_graph_safe_decode import (_backend, _generate, _requests,
                                                                        no_device_to_host_reads)
from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, peaked_tiny_gpt


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out))
        return out


class RecordedGraph:
    """Capture ``run`` as a CUDA graph would (after ``warmup`` plain runs): ``(replay, output)``."""

    def __init__(self, log: list, warmup: int = 2):
        self.log, self.warmup = log, warmup

    def __call__(self, run):
        for _ in range(self.warmup):  # as torch.cuda.graphs asks: warm-up runs first (they fill any cache)
            run()
        recorder = _Record()
        with no_device_to_host_reads(), recorder:
            out = run()
        self.log.append("capture")
        ops = recorder.ops

        def replay():
            self.log.append("replay")
            with torch.inference_mode():
                for func, args, kwargs, result in ops:
                    if func.is_view:  # aliases its input's memory: nothing to launch
                        continue
                    fresh = func(*args, **kwargs)
                    if func._schema.is_mutable:  # wrote its operands in place
                        continue
                    for old, new in zip(*(r if isinstance(r, (tuple, list)) else (r,) for r in (result, fresh))):
                        if isinstance(old, torch.Tensor):
                            old.copy_(new)
        return replay, out


@pytest.fixture(scope="module")
def model():
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=128)


@pytest.mark.xfail(strict=True, reason="a replayed decode graph does not give the eager tokens yet (the first replayed "
                   "steps already differ); the cause is not found")
def test_replayed_decode_graphs_give_the_eager_tokens_and_log_probs(model, monkeypatch):
    from megatron.rl.inference.engine import build
    from megatron.rl.inference.engine.graphs import DecodeGraphs

    requests = _requests(seed=3)
    eager = _generate(_backend(model, decode_cuda_graphs=True, decode_mirror=False), requests)
    log: list = []
    monkeypatch.setattr(build, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(build, "DecodeGraphs", lambda forward, **kw: DecodeGraphs(forward, capture=RecordedGraph(log),
                                                                                   **kw))
    graphed = _generate(_backend(model, decode_cuda_graphs=True, decode_mirror=False), _requests(seed=3))
    assert log.count("capture") >= 3 and log.count("replay") > 10, log
    for a, b in zip(eager, graphed):
        assert a.finish_reason in ("stop", "length"), a.error
        assert (a.generated_token_ids, a.logprobs) == (b.generated_token_ids, b.logprobs)
