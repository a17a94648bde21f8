"""The graph-safe decode step: fixed shapes (decode buckets) and no device-to-host read in the forward or sampler.

A GPU can capture a decode step in a graph (or torch.compile it without graph breaks) only if its shapes come from
a small set and nothing inside reads a tensor's value back on the host. On CPU these tests pin both properties:

- the engine with ``decode_buckets`` (rows padded to powers of two, key slots to multiples of 16) gives bit for
  bit the tokens and log-probs of the engine without them, on a mix of requests whose batch shrinks step by step;
- every decode step's forward and sampling, run under a mode that raises on any read of a tensor's value
  (``item``, ``tolist``, ``bool``/``int``/``float`` of a tensor, ``nonzero``, ...), passes; and the same mode does
  catch the reads the code had before (the attention reading its cache lengths, the sampler its temperatures).
"""
from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, peaked_tiny_gpt
from tests.conftest import needs_entry

# The engine tests run decode buckets, written for megatron-core 0.16.1; the helpers', the guard's and the graph
# cache's tests run on every release.
needs_buckets = needs_entry("dynamic context: decode buckets")


class DeviceToHostRead(AssertionError):
    pass


_READ_METHODS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
                 torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.nonzero, torch.nonzero,
                 torch.Tensor.numpy, torch.Tensor.any, torch.Tensor.all}
_READ_OPS = ("_local_scalar_dense", "nonzero", "is_nonzero", "equal", "masked_select", "unique")


class _NoReadFunctions(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READ_METHODS and not (func in (torch.Tensor.any, torch.Tensor.all) and (kwargs or len(args) > 1)):
            # any()/all() without a dim return a 0-d tensor that callers turn into a bool: flagged at the bool
            if func not in (torch.Tensor.any, torch.Tensor.all):
                raise DeviceToHostRead(f"{getattr(func, '__name__', func)} reads a tensor's value on the host")
        return func(*args, **(kwargs or {}))


class _NoReadOps(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.__name__.split(".")[0] in _READ_OPS:
            raise DeviceToHostRead(f"{func} reads a tensor's value on the host")
        return func(*args, **(kwargs or {}))


class no_device_to_host_reads:
    """Raise :class:`DeviceToHostRead` on any read of a tensor's value inside the block (both dispatch levels)."""

    def __enter__(self):
        self._modes = [_NoReadFunctions(), _NoReadOps()]
        for m in self._modes:
            m.__enter__()

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


@pytest.fixture(scope="module")
def model():
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=128)


def _requests(seed: int = 0, greedy_every: int = 5, top_k_every: int = 7) -> list:
    """40 requests of 1-30 prompt letters and 2-20 new tokens, most sampled at T = 1 with their own seed, some
    greedy and some with top-k / top-p: the batch shrinks step by step through many bucket sizes."""
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    g = torch.Generator().manual_seed(seed)
    requests = []
    for i in range(40):
        n = int(torch.randint(1, 31, (1,), generator=g))
        prompt = "".join(chr(int(c)) for c in torch.randint(97, 123, (n,), generator=g))
        args = dict(temperature=1.0, max_tokens=int(torch.randint(2, 21, (1,), generator=g)), seed=100 + i)
        if i % greedy_every == 0:
            args["temperature"] = 0.0
        elif i % top_k_every == 0:
            args.update(top_k=5, top_p=0.9)
        requests.append(InferenceRequest(prompt=prompt, generation_args=GenerationArgs(**args)))
    return requests


def _backend(model, **settings):
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    return MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(block_size_tokens=16, **settings))


def _generate(backend, requests):
    try:
        return backend.generate(requests)
    finally:
        backend.exit_inference_mode()


def test_bucket_helpers():
    from megatron.rl.inference.engine.build import bucket_size, power_of_two_buckets

    assert power_of_two_buckets(8, 256) == (8, 16, 32, 64, 128, 256)
    assert power_of_two_buckets(8, 100) == (8, 16, 32, 64, 128)
    assert [bucket_size(n, (8, 16, 32)) for n in (1, 8, 9, 32, 33)] == [8, 8, 16, 32, None]


@needs_buckets
def test_bucketed_decode_gives_the_unbucketed_tokens_and_log_probs_bit_for_bit(model):
    from megatron.rl.inference.engine.build import SamplingController

    rows_seen: list[int] = []
    forward = SamplingController._dynamic_step_forward_logits

    def recording(self, input_ids, position_ids):
        context = self.inference_wrapped_model.inference_context
        if context.is_decode_only():
            rows_seen.append(context.padded_active_request_count)
        return forward(self, input_ids, position_ids)

    plain = _generate(_backend(model), _requests())
    SamplingController._dynamic_step_forward_logits = recording
    try:
        bucketed = _generate(_backend(model, decode_buckets=(8, 16, 32, 64)), _requests())
    finally:
        SamplingController._dynamic_step_forward_logits = forward
    assert set(rows_seen) <= {8, 16, 32, 64} and len(set(rows_seen)) >= 3, rows_seen  # the buckets were used
    for a, b in zip(plain, bucketed):
        assert a.finish_reason in ("stop", "length"), a.error
        assert a.generated_token_ids == b.generated_token_ids
        assert a.logprobs == b.logprobs  # bit for bit


@needs_buckets
def test_decode_forward_and_sampling_read_nothing_back_from_the_device(model):
    from megatron.rl.inference.engine.build import SamplingController

    checked = {"forward": 0, "sample": 0}
    forward, sample = SamplingController._dynamic_step_forward_logits, SamplingController._dynamic_step_sample_logits

    def guarded_forward(self, input_ids, position_ids):
        if not self.inference_wrapped_model.inference_context.is_decode_only():
            return forward(self, input_ids, position_ids)
        checked["forward"] += 1
        with no_device_to_host_reads():
            return forward(self, input_ids, position_ids)

    def guarded_sample(self, logits):
        if not self.inference_wrapped_model.inference_context.is_decode_only():
            return sample(self, logits)
        checked["sample"] += 1
        with no_device_to_host_reads():
            return sample(self, logits)

    SamplingController._dynamic_step_forward_logits = guarded_forward
    SamplingController._dynamic_step_sample_logits = guarded_sample
    try:
        responses = _generate(_backend(model, decode_buckets=(8, 16, 32, 64)), _requests(seed=1))
    finally:
        SamplingController._dynamic_step_forward_logits = forward
        SamplingController._dynamic_step_sample_logits = sample
    assert all(r.finish_reason in ("stop", "length") for r in responses), [r.error for r in responses][:3]
    assert checked["forward"] >= 10 and checked["sample"] == checked["forward"], checked


def test_the_guard_catches_the_reads_of_the_attention_and_sampler_without_host_knowledge():
    """The mode is not vacuous: the attention without the step's host lengths, and the sampler without its
    host-side rows, read tensors back (as both did before), and are stopped."""
    from megatron.rl.inference.sampling import sample_tokens, tempered_log_probs
    from megatron.rl.runtime import decode_lengths, torch_attention
    from megatron.rl.runtime.decode_lengths import set_decode_lengths

    q = torch.randn(3, 1, 4, 8)
    cache = torch.randn(8, 16, 2, 8)
    table = torch.tensor([[0, 1], [2, 3], [4, 5]], dtype=torch.int32)
    lens = torch.tensor([5, 20, 9], dtype=torch.int32)
    torch_attention._STEP_PLAN.__dict__.clear()
    decode_lengths._HOST.__dict__.clear()
    with pytest.raises(DeviceToHostRead):
        with no_device_to_host_reads():
            torch_attention.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table)
    torch_attention._STEP_PLAN.__dict__.clear()
    set_decode_lengths(lens)
    with no_device_to_host_reads():
        with_host = torch_attention.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens, block_table=table)
    torch_attention._STEP_PLAN.__dict__.clear()
    decode_lengths._HOST.__dict__.clear()
    assert torch.equal(with_host, torch_attention.flash_attn_with_kvcache(q, cache, cache, cache_seqlens=lens,
                                                                          block_table=table))

    logits = torch.randn(4, 16)
    t, k, p = torch.tensor([1.0, 0.0, 1.0, 0.5]), torch.tensor([0, 0, 3, 0]), torch.tensor([1.0, 1.0, 1.0, 0.8])
    lp = tempered_log_probs(logits, t)
    with pytest.raises(DeviceToHostRead):
        with no_device_to_host_reads():
            sample_tokens(lp, t, k, p, [None] * 4, torch.Generator().manual_seed(0))
    with no_device_to_host_reads():
        got = sample_tokens(lp, t, k, p, [None] * 4, torch.Generator().manual_seed(0), [0, 2, 3], True)
    assert torch.equal(got, sample_tokens(lp, t, k, p, [None] * 4, torch.Generator().manual_seed(0)))


def _emulated_capture(calls: list):
    """A CPU stand-in for CUDA graph capture: the 'graph' reruns the function into the captured output tensor."""
    def capture(run):
        calls.append("capture")
        out = run()

        def replay():
            calls.append("replay")
            with torch.inference_mode(out.is_inference()):
                out.copy_(run())
        return replay, out
    return capture


def test_decode_graphs_capture_once_replay_after_and_fall_back_to_eager():
    from megatron.rl.inference.engine.graphs import DecodeGraphs

    ids, pos = torch.zeros(8, dtype=torch.long), torch.arange(8)
    eager: list = []

    def forward(i, p):
        eager.append(1)
        return (i + p).float()

    calls: list = []
    graphs = DecodeGraphs(forward, capture=_emulated_capture(calls))
    first = graphs(8, ids, pos)
    second = graphs(8, ids, pos)
    assert calls == ["capture", "replay", "replay"] and graphs.captured == [8]  # capture records, replay runs
    assert second is first and torch.equal(second, pos.float())  # the graph's own output tensor
    assert torch.equal(graphs(8, ids.clone(), pos), pos.float()) and calls[-1] == "replay"  # moved inputs: eager

    def failing(run):
        raise RuntimeError("operation not permitted when stream is capturing")

    eager.clear()
    broken = DecodeGraphs(forward, capture=failing)
    assert torch.equal(broken(8, ids, pos), pos.float()) and torch.equal(broken(8, ids, pos), pos.float())
    assert broken.captured == [] and len(eager) == 2  # eager both times, capture not retried


@needs_buckets
def test_engine_routes_decode_steps_through_the_graphs_and_keeps_every_token(model, monkeypatch):
    from megatron.rl.inference.engine import build
    from megatron.rl.inference.engine.graphs import DecodeGraphs

    calls: list = []
    # on CPU the flag keeps its fixed shapes (buckets, logits of every padded row) but captures nothing: eager
    eager = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=2))
    monkeypatch.setattr(build, "GRAPH_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(build, "DecodeGraphs",
                        lambda forward, **kw: DecodeGraphs(forward, capture=_emulated_capture(calls), **kw))
    _generate(_backend(model, decode_buckets=(8, 16, 32, 64)), _requests(seed=2)[:8])
    assert calls == []  # where graphs could be captured, nothing is without the flag (buckets alone do not)
    graphed = _generate(_backend(model, decode_cuda_graphs=True), _requests(seed=2))
    assert calls.count("capture") >= 3 and calls.count("replay") > 10, calls  # several buckets, replayed after
    for a, b in zip(eager, graphed):
        assert a.finish_reason in ("stop", "length"), a.error
        assert a.generated_token_ids == b.generated_token_ids and a.logprobs == b.logprobs


def test_only_the_engine_build_reaches_the_graph_capture():
    """The capture is reached from ``build_engine`` behind ``EngineSettings.decode_cuda_graphs`` (previous test), and
    from nowhere else in the package."""
    import ast

    from tests.conftest import REPO_ROOT

    users = set()
    for path in (REPO_ROOT / "megatron" / "rl").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "megatron.rl.inference.engine.graphs" or (
                    isinstance(node, ast.Import) and any(a.name.endswith("engine.graphs") for a in node.names)):
                users.add(path.relative_to(REPO_ROOT).as_posix())
    assert users == {"megatron/rl/inference/engine/build.py"}, users
