"""``train_rl.py --eval-only --use-checkpoint-args --load RUN`` with no other flag, on a run of the quickstart's
model trained with non-default generation flags: the run's model, generation and environment flags come back
from its checkpoint and the start-up summary names them; neither run prints a ``UserWarning`` (megatron-core's
missing-kernel warnings are one INFO line)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from examples.rl.quickstart import model_flags
from tests.conftest import REPO_ROOT

# generation flags a default would contradict: the default --rl-max-new-tokens 64 leaves no room within
# --seq-length 64, and the others change what the evaluation does
RUN_FLAGS = ["--rl-max-new-tokens", "8", "--rl-default-temperature", "0.7", "--rl-eval-temperature", "1.0",
             "--rl-prompts-per-eval", "6", "--rl-eval-samples", "2", "--rl-eval-pass-at-k", "1", "2",
             "--rl-use-sequence-packing", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
             "--micro-batch-size", "4", "--global-batch-size", "16"]


def _run(args, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"{args} failed ({proc.returncode}):\n{(proc.stdout + proc.stderr)[-6000:]}"
    return proc


def _assert_quiet(proc: subprocess.CompletedProcess) -> None:
    assert proc.stderr.count("UserWarning") == 0, proc.stderr[-3000:]
    assert proc.stdout.count("INFO megatron.rl.dependencies: Apex and TransformerEngine are not installed") == 1


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ckpt_args")
    (tmp / "env.yaml").write_text("environments:\n  - type: arithmetic\n    weight: 1\n    args: "
                                  '{"max_digits": 1, "min_operands": 2, "max_operands": 2, "operators": "+"}\n')
    run = tmp / "run"
    # a relative env config path: the checkpoint stores it absolute, so evaluation works from anywhere
    proc = _run([*model_flags(False), *RUN_FLAGS, "--langrl-env-config", "env.yaml", "--train-iters", "1",
                 "--lr", "1e-4", "--save", run, "--eval-interval", "100"], cwd=tmp)
    return tmp, run, proc


def test_training_run_prints_no_user_warning(trained):
    _assert_quiet(trained[2])


def test_eval_only_needs_no_flag_but_the_checkpoint(trained, tmp_path):
    tmp, run, _ = trained
    out = tmp_path / "eval.json"
    proc = _run(["--eval-only", "--use-checkpoint-args", "--load", run, "--rl-eval-output", out], cwd=tmp_path)
    _assert_quiet(proc)
    summary = proc.stdout[proc.stdout.index("from checkpoint (--use-checkpoint-args):"):]
    summary = " ".join(summary[:summary.index("[")].split())  # the wrapped lines, up to the next record
    for flag in ("--num-layers 4", "--hidden-size 128", "--swiglu", "--rl-max-new-tokens 8",
                 "--rl-default-temperature 0.7", f"--langrl-env-config {tmp / 'env.yaml'}", "--rl-eval-pass-at-k 1 2"):
        assert f"{flag}," in summary + ",", (flag, summary)
    assert "--rl-eval-output" not in summary  # given on the command line
    record = json.loads(out.read_text())
    assert record["iteration"] == 1 and record["eval/arithmetic/num_prompts"] == 6
    assert "eval/pass@2" in record  # the run's pass@k, not the default pass@1 only
    assert "at temperature 1 " in proc.stdout or "at temperature 1\n" in proc.stdout


def test_command_line_wins_over_the_checkpoint(trained, tmp_path):
    tmp, run, _ = trained
    out = tmp_path / "eval.json"
    proc = _run(["--eval-only", "--use-checkpoint-args", "--load", run, "--rl-eval-output", out,
                 "--rl-prompts-per-eval", "2", "--rl-eval-pass-at-k", "1"], cwd=tmp_path)
    record = json.loads(out.read_text())
    assert record["eval/arithmetic/num_prompts"] == 2 and "eval/pass@2" not in record
    assert "--rl-prompts-per-eval 6" not in proc.stdout


def test_converted_model_stops_where_training_stopped(trained, tmp_path):
    """The run trained on one environment (arithmetic, stop string "\\n"): the converted generation_config.json
    carries it and the end-of-document id, and Hugging Face generate() stops there."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    _, run, _ = trained
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    hf = tmp_path / "hf"
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "tools/convert_megatron_to_hf.py"), "--load", str(run),
                           "--save", str(hf)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    gen = GenerationConfig.from_pretrained(hf)
    assert gen.stop_strings == ["\n"] and gen.eos_token_id == 256  # the byte-level tokenizer's end of document
    tok, model = AutoTokenizer.from_pretrained(hf), AutoModelForCausalLM.from_pretrained(hf)
    ids = tok(["Q: 3+5=? A:", "Q: 1+1=? A:", "Q: 7+2=? A:"], return_tensors="pt")
    sample = dict(max_new_tokens=40, do_sample=True, temperature=3.0, pad_token_id=gen.pad_token_id)

    def generate(seed, stop: bool):
        model.generation_config.stop_strings = gen.stop_strings if stop else None
        torch.manual_seed(seed)
        out = model.generate(**ids, **sample, **({"tokenizer": tok} if stop else {}))
        return tok.batch_decode(out[:, ids["input_ids"].shape[1]:], skip_special_tokens=True)

    # a seed whose sampling, without the stop string, writes a newline before going on
    seed = next(s for s in range(200) if any("\n" in t.rstrip("\n") for t in generate(s, stop=False)))
    for unstopped, stopped in zip(generate(seed, stop=False), generate(seed, stop=True)):
        if "\n" in unstopped:
            assert stopped == unstopped[:unstopped.index("\n") + 1], (stopped, unstopped)
