"""A pretrained checkpoint is enough on its own: converted to Hugging Face and served, with no model flags.

A quickstart-style model (RoPE, SwiGLU, RMSNorm, byte-level tokenizer) is pretrained for a few iterations with
pretrain_gpt.py, then served by our engine over HTTP (the OpenAI client asks), converted to Hugging Face (with
its tokenizer), and scored, generated and served through the Hugging Face side.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.server.inference.conftest import ServerProcess

pytestmark = pytest.mark.slow  # four fresh interpreters (pretrain, convert, two servers): minutes on 2 cores

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "128", "--swiglu", "--normalization", "RMSNorm", "--position-embedding-type",
         "rope", "--disable-bias-linear", "--tokenizer-type", "ByteLevelTokenizer", "--seed", "1"]
PROMPTS = ["Q: 3+5=? A:", "hello", "12 + 7 ="]
NEW_TOKENS = 16


def _run(cmd, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, *map(str, cmd)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from megatron.rl.environments.arithmetic import write_pretraining_corpus

    root = tmp_path_factory.mktemp("alone")
    corpus = root / "arithmetic.jsonl"
    write_pretraining_corpus(corpus, num_documents=200, examples_per_document=8, noise=0.0, seed=7, min_operands=2,
                             max_operands=2, min_digits=1, max_digits=1, operators="+")
    # trained enough that the padded vocabulary rows (dropped by the conversion) are never the greedy choice
    _run([REPO_ROOT / "pretrain_gpt.py", *MODEL, "--micro-batch-size", "8", "--global-batch-size", "8",
          "--train-iters", "40", "--lr", "3e-3", "--data-path", corpus, "--split", "100,0,0", "--save",
          root / "ckpt"], cwd=root)
    return root


def _ask(server, prompt):
    """Greedy completion from a server: (token ids, per-token log-probs, text)."""
    from openai import OpenAI

    client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
    r = client.completions.create(model="ckpt", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, logprobs=1)
    choice = r.choices[0]
    return choice.model_extra["token_ids"], choice.logprobs.token_logprobs, choice.text


def _serve(args):
    return ServerProcess(["--model-name", "ckpt", *args], startup_timeout=300)


def test_convert_to_hf_and_serve_from_the_checkpoint_alone(pretrained):
    """The converted directory is a complete Hugging Face model: AutoTokenizer and AutoModelForCausalLM, called
    the standard way (no hand tokenisation), score our engine's completions with our engine's log-probs, greedy
    generate() continues as our engine does, and `--backend huggingface` serves the directory with the same
    answers."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    ckpt, hf_dir = pretrained / "ckpt", pretrained / "hf"
    _run([REPO_ROOT / "tools" / "convert_megatron_to_hf.py", "--load", ckpt, "--save", hf_dir], cwd=pretrained)
    tok = AutoTokenizer.from_pretrained(hf_dir)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ours = ByteLevelTokenizer()
    assert len(tok) == ours.vocab_size == 259 and hf.config.eos_token_id == tok.eos_token_id == ours.eod
    assert hf.config.vocab_size == 384  # Megatron's padded vocabulary: the softmax the model was trained with
    assert hf.config.bos_token_id is None and tok.bos_token_id is None  # trained without BOS: none is declared

    # the engine's own flags pass through too (a small request limit: the prompts come one at a time)
    server = _serve(["--backend", "megatron", "--", "--load", str(ckpt),
                     "--inference-dynamic-batching-max-requests", "8"])
    try:
        engine = {prompt: _ask(server, prompt) for prompt in PROMPTS}
    finally:
        server.stop()
    assert len({tuple(ids) for ids, _, _ in engine.values()}) > 1  # the completions depend on the prompt

    for prompt, (ids, engine_lp, text) in engine.items():
        assert all(t < ours.vocab_size for t in ids)
        n_prompt = len(tok(prompt)["input_ids"])
        scored = tok(prompt + text, return_tensors="pt")  # the standard path: the same text, tokenised by HF
        n_text = scored["input_ids"].shape[1] - n_prompt
        assert n_text > 0 and scored["input_ids"][0, n_prompt:].tolist() == ids[:n_text]
        with torch.no_grad():
            logits = hf(**scored).logits[0, n_prompt - 1:-1].float()
        hf_lp = torch.log_softmax(logits, -1).gather(-1, scored["input_ids"][0, n_prompt:, None])[:, 0]
        torch.testing.assert_close(hf_lp, torch.tensor(engine_lp[:n_text]), atol=1e-4, rtol=0)
        # greedy generate() continues exactly as our engine did, stopping at the end-of-document id as it does
        prompt_ids = tok(prompt, return_tensors="pt")
        out = hf.generate(**prompt_ids, max_new_tokens=NEW_TOKENS, do_sample=False)
        assert out[0, n_prompt:].tolist() == ids, prompt
        assert tok.decode(ids, skip_special_tokens=True) == text

    server = _serve(["--backend", "huggingface", "--backend-arg", f"model_path={hf_dir}"])
    try:
        for prompt, (ids, engine_lp, text) in engine.items():
            hf_ids, hf_lp, hf_text = _ask(server, prompt)
            assert (hf_ids, hf_text) == (ids, text)
            torch.testing.assert_close(torch.tensor(hf_lp), torch.tensor(engine_lp), atol=1e-4, rtol=0)
    finally:
        server.stop()
