"""The engine's decode attention over the dense mirror (EngineSettings.decode_mirror) generates the tokens and
log-probs of the paged gather bit for bit, with requests finishing at different steps (rows move), shared-prompt
groups, chunked prefill, decode steps padded to buckets, and a cache too small for all requests (requests paused
and evicted, then prefilled again). A readmitted request that the mirror still holds in its old row is dropped from it
(``DecodeMirror.forget``); tests/unit_tests/rl/runtime/test_decode_mirror.py makes that case happen, which an
engine run rarely does."""
from __future__ import annotations

import pytest

from tests.unit_tests.rl.inference.scripts.megatron_common import (ENGINE_CASES, engine_case, init_distributed,
                                                                   peaked_tiny_gpt)


@pytest.fixture(scope="module")
def model():
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=256)


def _generate(model, mirror: bool, requests, **settings):
    from megatron.core.inference.engines import DynamicInferenceEngine

    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.runtime import decode_mirror
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    used, evicted, padded = [], [], []
    key_values, post_process = decode_mirror.DecodeMirror.key_values, DynamicInferenceEngine.post_process_requests

    def counting(self, *args, **kwargs):
        result = key_values(self, *args, **kwargs)
        used.append(result is not None)
        padded.append(len(args[4]) > len(args[3]))  # more rows (lengths) than requests (ids)
        return result

    def noting_evictions(self, *args, **kwargs):
        evicted.append(self.evicted_request_count)
        return post_process(self, *args, **kwargs)

    backend = MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(
        block_size_tokens=16, max_requests=64, decode_mirror=mirror, **settings))
    decode_mirror.DecodeMirror.key_values, DynamicInferenceEngine.post_process_requests = counting, noting_evictions
    try:
        out = backend.generate(requests)
    finally:
        decode_mirror.DecodeMirror.key_values, DynamicInferenceEngine.post_process_requests = key_values, post_process
        backend.exit_inference_mode()
    return out, used, evicted, padded


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_generation_over_the_mirror_is_bit_identical_to_the_gather(model, case, monkeypatch):
    from megatron.rl.runtime import torch_attention

    from megatron.rl.runtime import decode_mirror

    monkeypatch.setattr(torch_attention, "MIRROR_MIN_ELEMENTS", 0)  # a small model's steps: the mirror at any size
    monkeypatch.setattr(decode_mirror, "CACHE_SHARE", 1e6)  # and larger than the evictions case's tiny cache
    requests, settings = engine_case(case)
    out = {}
    for mirror in (False, True):
        out[mirror], used, evicted, padded = _generate(model, mirror, requests, **settings)
        assert any(used) == mirror and all(used)  # the mirror served every decode layer, when on
        if case == "evictions":
            assert evicted[-1] > 0, "the cache fit every request: nothing was evicted"
        if case == "decode buckets" and mirror:
            assert any(padded)
    for a, b in zip(out[True], out[False]):
        assert a.finish_reason == b.finish_reason != "error", (a.error, b.error)
        assert a.token_ids == b.token_ids
        assert a.logprobs == b.logprobs
