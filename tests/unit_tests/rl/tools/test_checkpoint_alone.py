"""A pretrained checkpoint is enough on its own: converted to Hugging Face and served, with no model flags.

The case: ``convert_megatron_to_hf.py`` must not ask for --vocab-size (and then refuse it: ``vocab_size is None
in the checkpoint but 259``), and ``server.inference --backend megatron -- --load`` must build the model from
the checkpoint alone. Here a quickstart-style model (RoPE, SwiGLU, RMSNorm, byte-level tokenizer) is
pretrained for a few iterations with pretrain_gpt.py; Hugging Face greedy completions of the converted model
must equal those of our engine serving the checkpoint over HTTP (the OpenAI client asks).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.server.inference.conftest import ServerProcess

pytestmark = pytest.mark.slow  # three fresh interpreters (pretrain, convert, serve): about a minute on 2 cores

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


def test_convert_to_hf_and_serve_from_the_checkpoint_alone(pretrained):
    from openai import OpenAI
    from transformers import AutoModelForCausalLM

    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    ckpt, hf_dir = pretrained / "ckpt", pretrained / "hf"
    _run([REPO_ROOT / "tools" / "convert_megatron_to_hf.py", "--load", ckpt, "--save", hf_dir], cwd=pretrained)
    tok = ByteLevelTokenizer()
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    assert hf.config.vocab_size == tok.vocab_size == 259 and hf.config.eos_token_id == tok.eod
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.tokenize(prompt)])
        out = hf.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, attention_mask=torch.ones_like(ids))
        expected.append(out[0, ids.shape[1]:].tolist())
    assert len({tuple(e) for e in expected}) > 1  # the completions depend on the prompt: a real comparison

    server = ServerProcess(["--backend", "megatron", "--model-name", "ckpt", "--", "--load", str(ckpt)],
                           startup_timeout=300)
    try:
        client = OpenAI(base_url=server.url + "/v1", api_key="unused", timeout=120)
        for prompt, want in zip(PROMPTS, expected):
            r = client.completions.create(model="ckpt", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0)
            choice = r.choices[0]
            got = choice.model_extra["token_ids"]
            assert all(t < tok.vocab_size for t in got)
            # our engine stops at the end-of-document id; Hugging Face stops there too (eos_token_id)
            assert got == want, (prompt, got, want)
            assert choice.text == tok.detokenize(want)
    finally:
        server.stop()
