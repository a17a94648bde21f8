"""CUDA graphs of the decode step, replayed the way a GPU replays them, on CPU.

A CUDA graph records the kernels one run launched, on the tensors that run used, and a replay launches the same
kernels on the same memory: no Python runs, so whatever the captured run took from the host or from a cache filled
before the capture is frozen into the graph. :class:`RecordedGraph` does the same on CPU: during the capture it
records every aten operator with its arguments and outputs (and fails on any read of a tensor's value, as a
capturing stream does); a replay re-runs those operators on the same tensors, in order, writing each result into the
tensor the capture produced. A decode step whose graph is replayed must then give the tokens and log-probs of the
eager step, bit for bit: any plan, position or slot worked out on the host, or memoised before the capture, would be
replayed stale. Each of the three things the engine does for that (graphs keyed by rows and key slots, one attention
batch per graph, the per-step memos dropped before each captured run) fails these tests when it is taken out.
"""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit_tests.rl.inference.engine.test_graph_safe_decode import (_backend, _generate, _requests,
                                                                        no_device_to_host_reads)
from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, peaked_tiny_gpt
from tests.conftest import needs_entry

pytestmark = needs_entry("dynamic context: decode buckets")


class _Record(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.ops.append((func, args, kwargs, out, _aliases_input(func, args, out)))
        return out


def _aliases_input(func, args, out) -> bool:
    """Whether ``out`` shares its memory with the operator's first tensor argument: a view, which a graph does not
    launch anything for. ``reshape`` is declared a view but copies a tensor it cannot view (a kernel a graph does
    record)."""
    if not func.is_view:
        return False
    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
    results = out if isinstance(out, (tuple, list)) else (out,)
    return first is not None and all(isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr()
                                     == first.untyped_storage().data_ptr() for r in results)


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
                for func, args, kwargs, result, alias in ops:
                    if alias:  # a view of its input's memory: nothing to launch
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


@pytest.mark.parametrize("key_slots,split", [(16, False), (64, False), (16, True)])
def test_replayed_decode_graphs_give_the_eager_tokens_and_log_probs(model, monkeypatch, key_slots, split):
    """40 requests whose batch shrinks through the buckets while their lengths grow; with key slots in multiples of
    16 a bucket is captured again for each new key length (the graph's attention has that many slots). ``split``:
    the eager attention splits rows of far-apart lengths into groups (here at any difference), a plan a graph
    cannot follow from step to step: graphed steps attend one padded batch, with the same bits."""
    from megatron.rl.inference.engine import build
    from megatron.rl.inference.engine.graphs import DecodeGraphs
    from megatron.rl.runtime import torch_attention

    if split:
        monkeypatch.setitem(torch_attention._SPLIT_OVERHEAD_ELEMENTS, "cpu", 1)

    requests = _requests(seed=3)
    eager = _generate(_backend(model, decode_cuda_graphs=True), requests)
    log: list = []
    made: list = []

    def recorded(forward, **kw):
        made.append(DecodeGraphs(forward, capture=RecordedGraph(log), **kw))
        return made[-1]

    monkeypatch.setattr(build, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(build, "GRAPH_KEY_SLOTS", key_slots)
    monkeypatch.setattr(build, "DecodeGraphs", recorded)
    graphed = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=3))
    keys = made[0].captured  # none dropped by the first-replay check
    assert log.count("capture") == len(keys) >= 3 and log.count("replay") > 10, log
    assert all(slots % key_slots == 0 for _, slots in keys)
    if key_slots == 16:  # a row count captured again at a longer key length
        assert any(len({s for r, s in keys if r == rows}) >= 2 for rows, _ in keys), keys
    for a, b in zip(eager, graphed):
        assert a.finish_reason in ("stop", "length"), a.error
        assert (a.generated_token_ids, a.logprobs) == (b.generated_token_ids, b.logprobs)


def _without_memo_reset(log: list, verify: bool):
    from megatron.rl.inference.engine.graphs import DecodeGraphs

    return lambda forward, **kw: DecodeGraphs(forward, capture=RecordedGraph(log), verify=verify)  # no reset=


def test_the_replay_catches_a_graph_that_reads_a_value_memoised_before_its_capture(model, monkeypatch):
    """The replay is not vacuous: without dropping the per-step memos before the capture (the warm-up runs fill
    them), the replayed steps read the capture step's positions and slots, and the tokens differ."""
    from megatron.rl.inference.engine import build

    eager = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=3))
    log: list = []
    monkeypatch.setattr(build, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(build, "DecodeGraphs", _without_memo_reset(log, verify=False))
    graphed = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=3))
    assert log.count("replay") > 10
    assert [a.generated_token_ids for a in eager] != [b.generated_token_ids for b in graphed]


def test_a_graph_that_replays_stale_values_fails_its_requests_at_its_first_checked_replay(model, monkeypatch):
    """The same fault with the first-replay check on (the default): at the first replay after its capture step, the
    graph's logits are compared with an eager forward's, found to differ, and the requests in flight fail with an
    error that says so (the stale replay has written the cache where the captured step did); requests that had
    finished before keep the eager tokens."""
    from megatron.rl.inference.engine import build

    eager = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=3))
    log: list = []
    monkeypatch.setattr(build, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(build, "DecodeGraphs", _without_memo_reset(log, verify=True))
    graphed = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=3))
    failed = [b for b in graphed if b.finish_reason == "error"]
    assert failed and all("replayed CUDA graph's logits differ from an eager forward's" in b.error for b in failed)
    assert log.count("replay") == 2 and log.count("capture") == 1, log  # the capture step's replay, the checked one
    for a, b in zip(eager, graphed):
        if b.finish_reason != "error":
            assert (a.generated_token_ids, a.logprobs) == (b.generated_token_ids, b.logprobs)


def test_a_graph_holds_the_tensors_its_captured_run_touched():
    """On a GPU a graph replays on raw memory: a buffer made outside the capture and later dropped by its owner
    (the attention's gather buffers are regrown) must stay allocated while the graph lives."""
    import gc
    import weakref

    from megatron.rl.inference.engine.graphs import KeepOperands

    owner = {"buffer": torch.zeros(8)}
    kept = KeepOperands()
    with kept:
        out = torch.arange(8.0).add_(1.0)
        torch.index_select(out, 0, torch.arange(8), out=owner["buffer"])
    alive = weakref.ref(owner["buffer"])
    owner["buffer"] = torch.zeros(16)  # the owner regrows its buffer
    gc.collect()
    assert alive() is not None and torch.equal(alive(), torch.arange(1.0, 9.0))
    del kept
    gc.collect()
    assert alive() is None  # released with the graph


def test_graphs_and_route_recording_are_refused_together(model):
    """MoE routes are recorded by Python hooks during the forward, which a replayed graph does not run."""
    from megatron.rl.inference.api import InferenceError

    with pytest.raises(InferenceError, match="decode_cuda_graphs with record_routes"):
        _generate(_backend(model, decode_cuda_graphs=True, record_routes=True), _requests()[:2])
