"""A plain layer's decode step without megatron-core's per-layer glue (runtime/decode_layer.py) generates the tokens
and log-probs of megatron-core's own forward bit for bit: requests finishing at different steps, shared-prompt groups,
chunked prefill, decode steps padded to buckets, and a cache too small for all requests (pauses and evictions)."""
from __future__ import annotations

import pytest

from tests.conftest import needs_entry
from tests.unit_tests.rl.inference.scripts.megatron_common import (ENGINE_CASES, engine_case, init_distributed,
                                                                   peaked_tiny_gpt)

pytestmark = needs_entry("dynamic inference decode step: a plain layer's calls only")


# gated GELU with biases: the whole first product; SwiGLU without biases (the quickstart's): computed in halves
@pytest.fixture(scope="module", params=["geglu, biases", "swiglu"])
def model(request):
    init_distributed(tp=1)
    return peaked_tiny_gpt(hidden=64, layers=2, seq=256, swiglu=request.param == "swiglu")


def _generate(model, requests, monkeypatch, lean: bool, **settings):
    """The responses, and how many layer forwards took the plain decode path and megatron-core's."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.runtime import decode_layer
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    calls = {"plain": 0, "megatron": 0}
    plain, megatron = decode_layer.decode_forward, decode_layer.original()

    def counting_plain(*args, **kwargs):
        calls["plain"] += 1
        return plain(*args, **kwargs)

    def counting_megatron(*args, **kwargs):
        calls["megatron"] += 1
        return megatron(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(decode_layer, "decode_forward", counting_plain)
        m.setattr(decode_layer, "_ORIGINAL", {"forward": counting_megatron})
        if not lean:  # megatron-core's forward for every call, as before the patch
            m.setattr(TransformerLayer, "forward", counting_megatron)
        backend = MegatronInference(model, ByteLevelTokenizer(), settings=EngineSettings(
            block_size_tokens=16, max_requests=64, **settings))
        try:
            out = backend.generate(requests)
        finally:
            backend.exit_inference_mode()
    return [(r.finish_reason, r.generated_token_ids, r.logprobs) for r in out], calls


@pytest.mark.parametrize("case", ENGINE_CASES)
def test_decode_steps_of_plain_layers_equal_megatron_cores_forward_bit_for_bit(model, case, monkeypatch):
    requests, settings = engine_case(case)
    want, before = _generate(model, requests, monkeypatch, lean=False, **settings)
    got, after = _generate(model, requests, monkeypatch, lean=True, **settings)
    assert before["plain"] == 0 and before["megatron"] > 0
    # decode steps took the plain path; prefill and mixed steps still megatron-core's
    assert after["plain"] > after["megatron"] > 0
    assert all(reason != "error" for reason, _, _ in got), got
    assert got == want


def test_a_split_glu_equals_megatron_cores_mlp_bit_for_bit(model):
    import torch

    from megatron.rl.runtime import decode_layer, packed_linear

    mlp = model.decoder.layers[0].mlp
    assert decode_layer.split_glu(mlp) == (mlp.linear_fc1.bias is None)
    with torch.inference_mode():
        for rows in (1, 2, 7, 16, 33, 64, 129):
            hidden = torch.randn(rows, 1, 64) * 3
            want = mlp(hidden)
            got = decode_layer._mlp(mlp, hidden)
            assert torch.equal(got[0], want[0]) and (got[1] is None) == (want[1] is None), rows
        # a forward hook on the first layer or the MLP (megatron-core's DDP waits for a parameter gather in one): the
        # module is called, so the hook runs
        for module in (mlp, mlp.linear_fc1):
            seen = []
            handle = module.register_forward_pre_hook(lambda *_: seen.append(1))
            try:
                decode_layer._mlp(mlp, torch.randn(4, 1, 64))
            finally:
                handle.remove()
            assert seen
        if not packed_linear.available():
            return
        with packed_linear.packing():  # packed weights: megatron-core's MLP, whose first layer packs the whole weight
            calls = []
            with pytest.MonkeyPatch.context() as m:
                m.setattr(torch, "mm", lambda *a, **k: calls.append(a) or torch.matmul(*a[:2]))
                decode_layer._mlp(mlp, torch.randn(4, 1, 64))
            assert not calls


def test_layers_and_steps_that_megatron_core_computes_otherwise_keep_its_forward(model, monkeypatch):
    from megatron.rl.runtime import decode_layer

    layer = model.decoder.layers[0]
    assert decode_layer._is_plain(layer)
    for owner, name in ((layer, "recompute_mlp"), (layer, "is_moe_layer"), (layer.self_attention, "offload_qkv_linear"),
                        (layer.config, "flash_decode"), (layer.config, "attention_output_gate"),
                        (layer.config, "fp32_residual_connection")):
        with monkeypatch.context() as m:
            m.setattr(owner, name, True, raising=False)
            assert not decode_layer._is_plain(layer), name

    class Context:  # a decode step of the dynamic engine, as far as _applies reads it
        use_flashinfer_fused_rope = False

        def __init__(self, decode_only=True):
            self.decode_only = decode_only

        def is_static_batching(self):
            return False

        def is_decode_only(self):
            return self.decode_only

    import torch

    monkeypatch.setattr(layer, "training", False)  # an engine's model is in eval mode
    with torch.inference_mode():
        assert decode_layer._applies(layer, {"inference_context": Context()})
        assert not decode_layer._applies(layer, {"inference_context": Context(decode_only=False)})  # prefill
        assert not decode_layer._applies(layer, {"inference_context": None})  # training's and scoring's forwards
        assert not decode_layer._applies(layer, {"inference_context": Context(), "packed_seq_params": object()})
    assert not decode_layer._applies(layer, {"inference_context": Context()})  # outside inference mode
    monkeypatch.setattr(layer, "training", True)
    with torch.inference_mode():
        assert not decode_layer._applies(layer, {"inference_context": Context()})
