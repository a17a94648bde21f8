"""Hugging Face backend on a tiny random Llama built in the test (no downloads)."""
import asyncio

import numpy as np
import pytest
import torch

from megatron.rl.inference import (ChatMessage, GenerationArgs, InferenceError, InferenceRequest,
                                   build_inference_interface)
from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model


@pytest.fixture(scope="module")
def hf_backend(tmp_path_factory):
    path = build_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf"), chat_template=True)
    return build_inference_interface("huggingface", model_path=str(path), device="cpu", max_batch_size=4)


def _reference_logprobs(model, token_ids, prompt_length, temperature):
    """Teacher-forced forward written independently of the backend: one full-sequence pass, float64 softmax."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].double()
    out = []
    for pos in range(prompt_length, len(token_ids)):
        row = logits[pos - 1] / (temperature if temperature > 0 else 1.0)
        out.append(float(row[token_ids[pos]] - torch.logsumexp(row, 0)))
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7, 0.0])
def test_logprobs_equal_teacher_forced_forward(hf_backend, temperature):
    # mixed prompt lengths in one batch (left padding) and more samples than max_batch_size (several batches)
    prompts = ["Hi", "The quick brown fox jumps over", "Hello world! How", "1 + 2 = 3"]
    reqs = [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=temperature, max_tokens=12,
                                                                       seed=i, n=2))
            for i, p in enumerate(prompts)]
    out = asyncio.run(hf_backend.agenerate(reqs))
    assert len(out) == 8
    assert [r.prompt_text for r in out] == [p for p in prompts for _ in range(2)]
    for r in out:
        assert r.finish_reason in ("stop", "length") and len(r.logprobs) == len(r.generated_token_ids) > 0
        ref = _reference_logprobs(hf_backend.model, r.token_ids, r.prompt_length, temperature)
        np.testing.assert_allclose(r.logprobs, ref, rtol=0, atol=1e-5)
        assert r.token_ids[:r.prompt_length] == hf_backend.tokenizer(r.prompt_text)["input_ids"]


def test_greedy_is_deterministic_argmax(hf_backend):
    a, b = (hf_backend.generate("Hello world", temperature=0, max_tokens=10)[0] for _ in range(2))
    assert a.token_ids == b.token_ids
    with torch.no_grad():
        logits = hf_backend.model(input_ids=torch.tensor([a.token_ids])).logits[0]
    for pos in range(a.prompt_length, len(a.token_ids)):
        assert a.token_ids[pos] == int(torch.argmax(logits[pos - 1]))
    # greedy alone == greedy padded into a batch with a longer prompt
    c = hf_backend.generate([InferenceRequest(prompt="The quick brown fox jumps over the lazy",
                                              generation_args=GenerationArgs(temperature=0, max_tokens=10)),
                             InferenceRequest(prompt="Hello world", generation_args=GenerationArgs(temperature=0,
                                                                                                   max_tokens=10))])
    assert c[1].token_ids == a.token_ids


def test_seeds_reproducible_and_distinct(hf_backend):
    s1 = hf_backend.generate("Hello", temperature=1.0, max_tokens=10, seed=7, n=2)
    s2 = hf_backend.generate("Hello", temperature=1.0, max_tokens=10, seed=7, n=2)
    assert [r.token_ids for r in s1] == [r.token_ids for r in s2]
    assert s1[0].token_ids != s1[1].token_ids


def test_top_k_one_equals_greedy_tokens(hf_backend):
    g = hf_backend.generate("Hello world", temperature=0, max_tokens=8)[0]
    k1 = hf_backend.generate("Hello world", temperature=0.5, top_k=1, max_tokens=8, seed=3)[0]
    assert k1.token_ids == g.token_ids
    # ... but the log-probs are reported under the T=0.5 distribution, not the truncated one (which would be 0)
    assert all(lp < 0 for lp in k1.logprobs) and k1.logprobs != g.logprobs


def test_stop_string_cuts_text(hf_backend):
    full = hf_backend.generate("Hello world", temperature=0, max_tokens=20)[0]
    stop = full.text[3:5]
    assert stop and stop in full.text
    r = hf_backend.generate("Hello world", temperature=0, max_tokens=20, stop=[stop])[0]
    assert r.finish_reason == "stop" and r.text == full.text[: full.text.find(stop)]
    assert r.token_ids == full.token_ids[: len(r.token_ids)] and len(r.token_ids) < len(full.token_ids)


def test_chat_uses_hf_template(hf_backend):
    r = hf_backend.generate([InferenceRequest(messages=[ChatMessage(role="user", content="hi")],
                                              generation_args=GenerationArgs(temperature=0, max_tokens=4))])[0]
    assert r.prompt_text == "[user]: hi\n[assistant]: "


def test_too_long_prompt_is_a_per_request_error(hf_backend):
    out = hf_backend.generate([InferenceRequest(prompt="fox " * 200), InferenceRequest(prompt="Hi", generation_args=
                                                                                          GenerationArgs(max_tokens=3))])
    assert out[0].finish_reason == "error" and "maximum sequence length is 96" in out[0].error
    assert out[1].finish_reason in ("stop", "length") and len(out[1].generated_token_ids) >= 1


def test_missing_directory_is_clear_error(tmp_path):
    with pytest.raises(InferenceError, match="not a local directory"):
        build_inference_interface("huggingface", model_path=str(tmp_path / "nope"))


def test_directory_without_tokenizer_files_says_so(tmp_path):
    """transformers' own error for this case asks for sentencepiece or tiktoken, which is not what is missing."""
    import shutil

    path = build_tiny_hf_model(tmp_path / "m")
    for f in path.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            f.unlink() if f.is_file() else shutil.rmtree(f)
    with pytest.raises(InferenceError, match="has no tokenizer files.*convert_megatron_to_hf"):
        build_inference_interface("huggingface", model_path=str(path))


def test_sample_batch_truncation_and_distribution():
    from megatron.rl.inference.huggingface import sample_batch

    logits = torch.log(torch.tensor([0.05, 0.4, 0.1, 0.3, 0.15]))
    cases = [  # expected sampling distribution after truncation (reference written out by hand)
        (GenerationArgs(temperature=1.0), [0.05, 0.4, 0.1, 0.3, 0.15]),
        (GenerationArgs(temperature=1.0, top_k=2), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]),
        (GenerationArgs(temperature=1.0, top_p=0.75), [0, 0.4 / 0.85, 0, 0.3 / 0.85, 0.15 / 0.85]),
        (GenerationArgs(temperature=1.0, top_p=0.69), [0, 0.4 / 0.7, 0, 0.3 / 0.7, 0]),
        (GenerationArgs(temperature=1.0, top_p=1e-6), [0, 1, 0, 0, 0]),
    ]
    draws = 4000
    for args, expected in cases:
        gens = [torch.Generator().manual_seed(i) for i in range(draws)]
        toks, lps = sample_batch(logits.expand(draws, -1), [args] * draws, gens)
        freq = np.bincount(toks, minlength=5) / draws
        np.testing.assert_allclose(freq, expected, atol=0.03)
        # log-probs are of the untruncated distribution whatever the truncation
        np.testing.assert_allclose(lps, torch.log_softmax(logits, -1)[toks].numpy(), atol=1e-6)
    # temperature reshapes both the sampling and the reported log-probs; greedy rows mix with sampled rows
    args = [GenerationArgs(temperature=0.5), GenerationArgs(temperature=0)]
    toks, lps = sample_batch(torch.stack([logits, logits]), args, [torch.Generator().manual_seed(0), None])
    assert toks[1] == 1 and lps[1] == pytest.approx(float(torch.log_softmax(logits, -1)[1]))
    assert lps[0] == pytest.approx(float(torch.log_softmax(logits / 0.5, -1)[toks[0]]))


def test_top_p_tiny_equals_greedy_tokens(hf_backend):
    g = hf_backend.generate("Hello world", temperature=0, max_tokens=8)[0]
    p = hf_backend.generate("Hello world", temperature=0.9, top_p=1e-6, max_tokens=8, seed=3)[0]
    assert p.token_ids == g.token_ids


def test_caller_releases_its_openmp_pool_before_the_worker_decodes(hf_backend, monkeypatch):
    """The calling thread frees its OpenMP pool (megatron/rl/runtime/openmp.py) so the decoding thread's is not
    throttled; decoding itself happens on another thread."""
    import threading

    import megatron.rl.inference.huggingface as hf_module

    calls, decoders = [], []
    monkeypatch.setattr(hf_module, "release_thread_pool", lambda: calls.append(threading.get_ident()) or True)
    decode = hf_backend._decode_batch
    monkeypatch.setattr(hf_backend, "_decode_batch", lambda rows: decoders.append(threading.get_ident()) or decode(rows))
    out = asyncio.run(hf_backend.agenerate([InferenceRequest(prompt="Hi", generation_args=GenerationArgs(max_tokens=2))]))
    assert out[0].finish_reason in ("stop", "length")
    assert calls == [threading.get_ident()]
    assert decoders and decoders[0] != threading.get_ident()


def test_a_cancelled_request_leaves_the_decoding_batch_at_the_next_step(hf_backend, monkeypatch):
    """cancel() (the inference server, on a client disconnect) ends a request mid-batch; the others run on."""
    from megatron.rl.inference.api import CANCELLED

    long = InferenceRequest(prompt="hello", generation_args=GenerationArgs(temperature=0, max_tokens=60, n=2))
    short = InferenceRequest(prompt="hi", generation_args=GenerationArgs(temperature=0, max_tokens=8))
    steps = []
    forward = hf_backend.model.forward

    def counted(*a, **k):
        steps.append(1)
        if len(steps) == 12:  # past the short request's end: only the long ones are decoded now
            long.cancel()  # as the server's event loop does while this thread decodes
        return forward(*a, **k)

    monkeypatch.setattr(hf_backend.model, "forward", counted)
    got = hf_backend.generate([long, short])
    assert [r.error for r in got] == [CANCELLED, CANCELLED, None] and len(got[2].generated_token_ids) == 8
    assert len(steps) == 12  # the next step saw it: not the 60 the long request asked for
