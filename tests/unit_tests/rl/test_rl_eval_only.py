"""``train_rl.py --eval-only`` builds through :class:`~megatron.rl.training.run.TrainingRun` (one build and load
sequence): it honours ``--no-verify-checkpoint-checksums`` and scores a checkpoint as a training run's own
evaluation of the same weights does. One process, in-process megatron-core engine, fp32 CPU."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.training.checkpoint.save_load import CheckpointError
from megatron.rl.training.config import parse_args
from megatron.rl.training.initialize import destroy_megatron

# The checkpoint and the training run's evaluation take ~60 s together; test_rl_train_e2e's
# test_eval_only_prints_a_pass_at_k_table runs --eval-only in the default suite.
pytestmark = pytest.mark.slow

AGENTS = "tests.unit_tests.rl.rl_test_agents"
TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--seed", "5", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--rl-max-new-tokens", "6",
        "--langrl-allow-imports", "--rl-prompts-per-eval", "6", "--rl-eval-samples", "4",
        "--rl-eval-pass-at-k", "1", "2", "--rl-eval-temperature", "1.0"]
COMPARED = ("eval/pass@1", "eval/pass@2", "eval/hash/pass@1", "eval/hash/mean_reward", "eval/hash/num_prompts")


def _configs(tmp: Path, *flags):
    env = tmp / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashPassAt", name: hash, weight: 1}}]\n')
    cfg = parse_args([*TINY, "--langrl-env-config", str(env), *map(str, flags)], extra_args_providers=[add_rl_args],
                     world_size=1)
    return cfg, rl_config_from_args(cfg)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A checkpoint of iteration 3 with weights a fresh build does not have; and a training run's evaluation of
    the same weights (``--pretrained-checkpoint``: its evaluation at iteration 0, before any update)."""
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.run import RL_RESUME, TrainingRun

    tmp = tmp_path_factory.mktemp("eval_only")
    ckpt = tmp / "ckpt"
    cfg, _ = _configs(tmp, "--train-iters", "3", "--save", ckpt)
    run = TrainingRun.build(cfg, RL_RESUME)
    with torch.no_grad():
        for p in run.model[0].module.parameters():
            p.mul_(3.0)  # a sharper policy than the random init: samples differ in reward
    run.save(3, {"iteration": 3})
    destroy_megatron()
    cfg, rl = _configs(tmp, "--train-iters", "1", "--eval-interval", "1", "--pretrained-checkpoint", ckpt)
    try:
        evals = run_rl(cfg, rl).evals
    finally:
        destroy_megatron()
    assert [e["iteration"] for e in evals] == [0, 1]
    return tmp, ckpt, evals[0]


def _eval_only(tmp: Path, ckpt: Path, *flags) -> tuple[dict, dict]:
    from megatron.rl.rl_eval import run_eval_only

    out = tmp / "eval.json"
    cfg, rl = _configs(tmp, "--eval-only", "--load", ckpt, "--rl-eval-output", out, *flags)
    try:
        return run_eval_only(cfg, rl), json.loads(out.read_text())
    finally:
        destroy_megatron()


def test_eval_only_scores_the_checkpoint_as_training_does(checkpoint):
    tmp, ckpt, in_training = checkpoint
    metrics, record = _eval_only(tmp, ckpt)
    assert record["iteration"] == 3 and record["checkpoint"] == str(ckpt / "iter_0000003")
    assert {k: metrics[k] for k in COMPARED} == {k: in_training[k] for k in COMPARED}
    assert metrics["eval/hash/num_prompts"] == 6 and 0 < metrics["eval/pass@1"] <= metrics["eval/pass@2"] < 1


def test_eval_only_honours_no_verify_checkpoint_checksums(checkpoint, tmp_path):
    from megatron.rl.training.checkpoint.integrity import MANIFEST_FILENAME

    _, ckpt, in_training = checkpoint
    tampered = tmp_path / "ckpt"
    shutil.copytree(ckpt, tampered)
    manifest_path = tampered / "iter_0000003" / MANIFEST_FILENAME
    manifest = json.loads(manifest_path.read_text())
    name = next(n for n in sorted(manifest["files"]) if n.endswith(".distcp"))
    manifest["files"][name]["hash"] = "0" * len(manifest["files"][name]["hash"])  # the bytes no longer match it
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not match its checksum"):
        _eval_only(tmp_path, tampered)
    metrics, _ = _eval_only(tmp_path, tampered, "--no-verify-checkpoint-checksums")
    assert {k: metrics[k] for k in COMPARED} == {k: in_training[k] for k in COMPARED}
