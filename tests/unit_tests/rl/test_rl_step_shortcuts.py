"""The GRPO step's speed paths change nothing but the time.

1. Old-policy log-probs from the training forward (one optimizer step, one pass): loss, gradients,
   updated weights, every metric (log-prob gap, ratios, clip fractions, entropy, KL) and the stored old
   log-probs are bit-identical to the separate scoring pass (``--rl-recompute-old-logprobs``), while the
   scoring pass for the old policy really is skipped. Several steps or passes keep the pass.
2. Dynamic micro-batch shapes (the default without pipeline parallelism): the model sees no padding-only
   rows or positions, the packing efficiency rises, and the step equals the fixed-shape one up to float
   rounding of differently shaped matmuls.
"""
from __future__ import annotations

import json

import pytest

from tests.conftest import REPO_ROOT, run_torchrun

SCRIPT = REPO_ROOT / "tests/unit_tests/rl/scripts/rl_step_shortcuts.py"

# 16 fixed rollouts (prompts 3-9 tokens, 2-24 generated), one optimizer step of 16 sequences in 8 micro-batches
BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "2", "--global-batch-size", "16",
        "--train-iters", "1", "--lr", "1e-2", "--lr-decay-style", "constant", "--vocab-size", "512",
        "--untie-embeddings-and-output-weights", "--seed", "3", "--grpo-prompts-per-step", "4",
        "--grpo-group-size", "4", "--rl-max-new-tokens", "24", "--grpo-entropy-term-weight", "0.01",
        "--rl-default-temperature", "0.7"]
# every loss term: KL to the reference (its scoring pass stays), truncated IS correction, sequence aggregation
ALT = ["--grpo-kl-beta", "0.05", "--rl-inference-logprobs-is-correction", "--grpo-loss-aggregation", "sequence",
       "--rl-use-sequence-packing", "--micro-batch-size", "1"]
RECOMPUTE = ["--rl-recompute-old-logprobs"]
FIXED = ["--rl-fixed-microbatch-shapes"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("rlshortcut")
    env = tmp / "env.yaml"
    env.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    base = [*BASE, "--langrl-env-config", str(env)]
    padded = [*base, "--rl-layout", "padded"]  # the fixed-shape comparisons below count padded rows
    variants = {
        "shortcut": padded, "recompute": [*padded, *RECOMPUTE],
        "alt_shortcut": [*base, *ALT], "alt_recompute": [*base, *ALT, *RECOMPUTE],
        "fixed": [*padded, *FIXED, *RECOMPUTE],
        "two_passes": [*padded, "--grpo-iterations", "2"],
        "two_steps": [*padded, "--global-batch-size", "8"],
        # the default layout (rows of one group): the shortcut is exact there too
        "auto_shortcut": base, "auto_recompute": [*base, *RECOMPUTE],
    }
    vfile, out = tmp / "variants.json", tmp / "out.json"
    vfile.write_text(json.dumps(variants))
    run_torchrun(SCRIPT, ["--variants", vfile, "--ckpt", tmp / "ckpt", "--out", out], nproc=1, timeout=600)
    return json.loads(out.read_text())


@pytest.mark.parametrize("fast,slow", [("shortcut", "recompute"), ("alt_shortcut", "alt_recompute"),
                                       ("auto_shortcut", "auto_recompute")])
def test_old_logprobs_from_the_training_forward_are_exact(runs, fast, slow):
    a, b = runs[fast], runs[slow]
    assert a["scoring_passes"].count("old_logprobs") == 0
    assert b["scoring_passes"].count("old_logprobs") == 1
    assert a["scoring_passes"].count("ref_logprobs") == b["scoring_passes"].count("ref_logprobs")
    assert a["any_grad_nonzero"]
    assert a["metrics"] == b["metrics"]  # loss, gap, ratios, clip fractions, entropy, KL: bit for bit
    assert a["grads"] == b["grads"]
    assert a["weights"] == b["weights"]
    assert a["old_logprobs"] == b["old_logprobs"]
    assert a["metrics"]["logprob_gap_mean"] > 0 and a["metrics"]["rl_loss"] != 0


def test_alt_variant_exercises_every_term(runs):
    m = runs["alt_shortcut"]["metrics"]
    assert runs["alt_shortcut"]["scoring_passes"] == ["ref_logprobs"]
    assert "kl_mean" in m and m["entropy_mean"] > 0


@pytest.mark.parametrize("name", ["two_passes", "two_steps"])
def test_several_updates_keep_the_scoring_pass(runs, name):
    assert runs[name]["scoring_passes"].count("old_logprobs") == len(runs[name]["num_token_slots"])


def test_dynamic_shapes_drop_padding_and_keep_the_step(runs):
    dyn, fixed = runs["recompute"], runs["fixed"]
    assert all(shape == [2, 64] for shape in fixed["shapes"])
    assert len(dyn["shapes"]) == len(fixed["shapes"])  # same micro-batches, cropped
    assert all(rows <= 2 and length < 64 for rows, length in dyn["shapes"])
    assert dyn["num_token_slots"][0] < fixed["num_token_slots"][0] == 8 * 2 * 64
    assert dyn["num_real_tokens"] == fixed["num_real_tokens"]
    assert dyn["metrics"]["packing_efficiency"] > 1.5 * fixed["metrics"]["packing_efficiency"]
    for key in ("rl_loss", "grad_norm", "logprob_gap_mean", "entropy_mean", "ratio_mean"):
        assert dyn["metrics"][key] == pytest.approx(fixed["metrics"][key], rel=1e-5, abs=1e-6), key
    worst = max(abs(x - y) for n in dyn["grads"] for x, y in zip(dyn["grads"][n], fixed["grads"][n]))
    assert worst < 1e-6
