"""The in-process engine held across a weight update (asynchronous partial rollouts): requests in flight stop at
``pause_generation``, keep their KV cache while the weights change, continue after ``resume_generation`` with the
new weights, and report the policy version of every generated token."""
from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from tests.unit_tests.rl.inference.scripts.megatron_common import teacher_forced_logprobs
from tests.unit_tests.rl.inference.test_megatron_backend import setup  # noqa: F401  (the tiny GPT + backend)


def _generate_in_thread(backend, requests):
    box = {}

    def run():
        box["responses"] = asyncio.run(backend.agenerate(requests))

    t = threading.Thread(target=run)
    t.start()
    return t, box


@pytest.mark.parametrize("packed", [False, True], ids=["plain", "every-weight-packed"])
def test_pause_holds_requests_across_a_weight_update_and_versions_every_token(setup, packed, monkeypatch):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest
    from megatron.rl.runtime import packed_linear

    cleared = []  # the packs alive at each clear: the resume must drop those made from the old weights
    if packed and packed_linear.available():
        monkeypatch.setattr(packed_linear, "MIN_WEIGHT_ELEMENTS", 0)
        clear = packed_linear.PackedWeights.clear
        monkeypatch.setattr(packed_linear.PackedWeights, "clear",
                            lambda self: (cleared.append(self.packed), clear(self))[1])
    model, backend = setup
    if packed:  # packs are the engine's default only on some CPUs (packed_linear.pays_off)
        from megatron.rl.inference.engine.build import EngineSettings
        from megatron.rl.inference.megatron import MegatronInference
        from megatron.rl.training.tokenizer import ByteLevelTokenizer

        backend.exit_inference_mode()
        backend = MegatronInference(model, ByteLevelTokenizer(), EngineSettings(packed_weights=True))
    model.train()
    backend.enter_inference_mode()
    backend.set_policy_version(0)
    old = [p.detach().clone() for p in model.parameters()]
    args = GenerationArgs(temperature=1.0, max_tokens=100, seed=5)
    thread, box = _generate_in_thread(backend, [InferenceRequest(prompt="Once upon a time", generation_args=args)])
    start = backend.engine_steps
    deadline = time.time() + 120
    while backend.engine_steps < start + 3 and time.time() < deadline:
        time.sleep(0.01)
    backend.pause_generation()
    held = backend.engine_steps
    assert model.training, "train mode is restored while paused (the trainer updates the weights now)"
    time.sleep(0.3)
    assert backend.engine_steps == held and thread.is_alive(), "the engine stepped while paused"
    with torch.no_grad():  # the "optimizer step": in place, as the trainer updates the shared weights
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    backend.resume_generation(1)
    thread.join(timeout=300)
    if packed and packed_linear.available():
        assert cleared and cleared[0] > 0, "the engine packed its weights and dropped the packs at the resume"
    [resp] = box["responses"]
    assert resp.finish_reason in ("stop", "length"), resp.error
    versions = resp.policy_versions
    assert len(versions) == len(resp.logprobs) == len(resp.generated_token_ids)
    k = versions.index(1)  # tokens before the pause are version 0, after it version 1
    assert 0 < k and versions == [0] * k + [1] * (len(versions) - k)
    # before the update the tokens are the old policy's exactly; after it they are not (new weights)
    new = [p.detach().clone() for p in model.parameters()]
    backend.exit_inference_mode()
    with torch.no_grad():
        for p, w in zip(model.parameters(), old):
            p.copy_(w)
    ref_old = teacher_forced_logprobs(model, resp.token_ids, resp.prompt_length, 1.0)
    with torch.no_grad():
        for p, w in zip(model.parameters(), new):
            p.copy_(w)
    got = torch.tensor(resp.logprobs)
    torch.testing.assert_close(got[:k], ref_old[:k], atol=1e-5, rtol=0)
    if len(versions) > k:
        assert (got[k:] - ref_old[k:]).abs().max() > 1e-3
    assert model.training


def test_without_versions_set_responses_carry_none(setup):
    from megatron.rl.inference.api import GenerationArgs, InferenceRequest

    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model, _ = setup
    fresh = MegatronInference(model, ByteLevelTokenizer())  # nothing asynchronous: the response is as before
    [resp] = fresh.generate([InferenceRequest(prompt="abc", generation_args=GenerationArgs(max_tokens=4, seed=1))])
    fresh.exit_inference_mode()
    assert resp.policy_versions is None


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp2_ranks_pause_and_resume_in_lockstep():
    from tests.conftest import run_torchrun

    proc = run_torchrun(Path(__file__).parent / "scripts" / "megatron_tp2_pause.py", timeout=300)
    assert proc.stdout.count("TP2 PAUSE OK") == 2, proc.stdout[-4000:]
