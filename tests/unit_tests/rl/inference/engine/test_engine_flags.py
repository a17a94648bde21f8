"""Megatron-LM's engine flags on train_rl.py: --cuda-graph-impl, --inference-dynamic-batching-{num-cuda-graphs,
max-requests,buffer-size-gb} parsed, checked with errors that name the flag, and turned into EngineSettings."""
from __future__ import annotations

import logging
import types

import pytest

from megatron.rl.inference.engine.build import EngineSettings, bucket_size, power_of_two_buckets
from megatron.rl.inference.engine.engine_flags import EngineFlags, apply_engine_flags, even_buckets
from megatron.rl.routing.config import ENGINE_ROUTE_RECORDING
from megatron.rl.runtime import patches
from megatron.rl.training.config import ConfigError
from tests.unit_tests.rl.test_rl_config import _rl, env_yaml  # noqa: F401 - env_yaml is a fixture

# where the engine cannot record routes (a release its entry was not written for) --rl-router-replay rollout is
# refused first
_RECORDS_ROUTES = patches.covers_installed(ENGINE_ROUTE_RECORDING)

# a GPU's defaults (EngineSettings.for_device("cuda") would see "cpu" where the CPU layer's device mode is active)
GPU = EngineSettings(buffer_size_gb=4.0, block_size_tokens=256, max_requests=512, max_tokens=16384, token_rounder=None)


def test_defaults_leave_the_engine_settings_unchanged(env_yaml):
    rl = _rl(env_yaml)
    assert rl.engine == EngineFlags() and not rl.engine.cuda_graphs
    for device, base in (("cpu", EngineSettings()), ("cuda", GPU)):
        assert apply_engine_flags(base, rl.engine, device) == base


def test_megatron_lm_flags_reach_the_engine_settings(env_yaml):
    rl = _rl(env_yaml, "--cuda-graph-impl", "local", "--inference-dynamic-batching-num-cuda-graphs", 4,
             "--inference-dynamic-batching-max-requests", 64, "--inference-dynamic-batching-buffer-size-gb", 1.5)
    assert rl.engine == EngineFlags(cuda_graph_impl="local", num_cuda_graphs=4, max_requests=64, buffer_size_gb=1.5)
    s = apply_engine_flags(GPU, rl.engine, "cuda")
    assert (s.decode_cuda_graphs, s.decode_buckets, s.max_requests, s.buffer_size_gb) == (True, (16, 32, 48, 64),
                                                                                            64, 1.5)
    # the rest of the GPU defaults stay
    assert s.block_size_tokens == 256 and s.token_rounder is None
    # without a bucket count the engine picks powers of two (build_engine), as before
    s = apply_engine_flags(GPU, _rl(env_yaml, "--cuda-graph-impl", "local").engine,
                           "cuda")
    assert s.decode_cuda_graphs and s.decode_buckets is None


def test_graphs_on_cpu_keep_the_buckets_and_say_so_once(env_yaml, caplog):
    flags = _rl(env_yaml, "--cuda-graph-impl", "local", "--inference-dynamic-batching-num-cuda-graphs", 2).engine
    with caplog.at_level(logging.WARNING, logger="megatron.rl.inference.engine.engine_flags"):
        s = apply_engine_flags(EngineSettings(), flags, "cpu")
    assert s.decode_cuda_graphs and s.decode_buckets == (128, 256)
    assert [r.getMessage() for r in caplog.records if "no CUDA graphs" in r.getMessage()] != []


@pytest.mark.parametrize("flags,message", [
    (("--cuda-graph-impl", "transformer_engine"), "--cuda-graph-impl transformer_engine: not supported"),
    (("--cuda-graph-impl", "local", "--inference-backend", "huggingface"),
     "--cuda-graph-impl local captures the in-process engine's decode step, but --inference-backend=huggingface"),
    (("--cuda-graph-impl", "local", "--inference-dynamic-batching-num-cuda-graphs", 0),
     "--inference-dynamic-batching-num-cuda-graphs=0: must be >= 1"),
    (("--inference-dynamic-batching-max-requests", 0), "--inference-dynamic-batching-max-requests=0: must be >= 1"),
    (("--inference-dynamic-batching-buffer-size-gb", "nan"), "--inference-dynamic-batching-buffer-size-gb=nan"),
    (("--inference-dynamic-batching-buffer-size-gb", -1), "--inference-dynamic-batching-buffer-size-gb=-1.0"),
    (("--rl-training-cuda-graphs",), "--rl-training-cuda-graphs is not a flag of this version: use "
                                     "--cuda-graph-impl local"),
    (("--cuda-graph-impl", "local", "--rl-router-replay", "rollout", "--num-experts", 4, "--moe-router-topk", 2),
     "--cuda-graph-impl local with --rl-router-replay rollout" if _RECORDS_ROUTES
     else "--rl-router-replay rollout needs the in-process engine to record routes"),
])
def test_bad_values_name_the_flag(env_yaml, flags, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        _rl(env_yaml, *flags)


def test_ignored_flags_are_reported(env_yaml, caplog):
    with caplog.at_level(logging.WARNING, logger="megatron.rl.inference.engine.engine_flags"):
        _rl(env_yaml, "--inference-dynamic-batching-num-cuda-graphs", 4)
        _rl(env_yaml, "--inference-backend", "huggingface", "--inference-dynamic-batching-max-requests", 8)
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "--inference-dynamic-batching-num-cuda-graphs=4 is ignored without --cuda-graph-impl local" in text
    assert "--inference-dynamic-batching-max-requests: ignored with --inference-backend=huggingface" in text


@pytest.mark.parametrize("count,largest,multiple,expected", [
    (1, 256, 8, (256,)),
    (4, 64, 8, (16, 32, 48, 64)),
    (3, 100, 8, (40, 80, 96)),       # step ceil(33 / 8) * 8 = 40; the top rounded down to a multiple of 8
    (16, 64, 8, (8, 16, 24, 32, 40, 48, 56, 64)),  # a step below the multiple is the multiple: fewer buckets
    (4, 1000, 24, (264, 528, 792, 984)),  # TP 3: multiples of lcm(8, 3)
    (2, 4, 8, (8,)),                 # a limit below one multiple: one bucket of the multiple
])
def test_even_buckets(count, largest, multiple, expected):
    got = even_buckets(count, largest, multiple)
    assert got == expected
    assert len(got) <= count and list(got) == sorted(set(got)) and all(b % multiple == 0 for b in got)


def test_even_buckets_hold_every_count_the_engine_pads_to():
    """Every decode step of up to the request limit finds a bucket (a step above the largest would fall back
    to plain padding), for the flags' spacing as for the default powers of two."""
    for count in (1, 3, 7, 16):
        buckets = even_buckets(count, 256)
        assert all(bucket_size(rows, buckets) is not None for rows in range(1, 257))
    assert bucket_size(256, power_of_two_buckets(8, 256)) == 256
    with pytest.raises(ValueError):
        even_buckets(0, 256)


def test_tp_size_sets_the_bucket_multiple(env_yaml):
    flags = _rl(env_yaml, "--cuda-graph-impl", "local", "--inference-dynamic-batching-num-cuda-graphs", 4).engine
    s = apply_engine_flags(GPU, flags, "cuda", tp_size=3)
    assert s.decode_buckets == even_buckets(4, 512, 24) and all(b % 3 == 0 for b in s.decode_buckets)


def test_the_run_backends_are_built_with_the_flags(env_yaml, monkeypatch):
    """build_for_training (the training model's engine) passes the flags' settings to MegatronInference."""
    import torch

    from megatron.rl.inference.control import build_training_inference
    from megatron.rl.inference.megatron import MegatronInference

    seen = {}
    monkeypatch.setattr(MegatronInference, "__init__", lambda self, model, tok, **kw: seen.update(kw))
    model = torch.nn.Linear(1, 1)
    model.max_sequence_length = 64
    rl = _rl(env_yaml, "--cuda-graph-impl", "local", "--inference-dynamic-batching-max-requests", 32)
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(seq_length=64),
                                parallel=types.SimpleNamespace(tensor_model_parallel_size=1))
    build_training_inference(cfg, rl, [model], None)
    assert seen["settings"].decode_cuda_graphs and seen["settings"].max_requests == 32
