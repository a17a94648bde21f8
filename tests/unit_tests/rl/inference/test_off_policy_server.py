"""--inference-backend openai is honest: a server that never receives the trainer's weights stops the run with a
named error once the log-probs show it, unless the run says it is off-policy by design (--rl-off-policy-server).

The server serves the very checkpoint the trainer starts from, so the first iteration is on-policy (the gap is
rounding) and the check must stay quiet there; the trainer's updates then move it away from the frozen server.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.server.inference.conftest import ServerProcess

pytestmark = pytest.mark.slow  # pretraining, a server and two train_rl.py runs: a few minutes on 2 cores

MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32"]
E2E = REPO_ROOT / "tests" / "unit_tests" / "rl" / "e2e"


def _run(args, tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": f"{E2E}{os.pathsep}{REPO_ROOT}"}
    return subprocess.run([sys.executable, *map(str, args)], cwd=REPO_ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


def test_frozen_openai_server_is_named_unless_off_policy_is_declared(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = _run([REPO_ROOT / "pretrain_gpt.py", *MODEL, "--micro-batch-size", "2", "--global-batch-size", "4",
                 "--train-iters", "2", "--lr", "1e-3", "--mock-data", "--save", ckpt], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    env_yaml = tmp_path / "env.yaml"
    env_yaml.write_text("imports: [digit_agents]\nenvironments:\n  - type: digits_please\n    weight: 1\n")
    server = ServerProcess(["--backend", "megatron", "--", "--load", str(ckpt)], startup_timeout=300)
    try:
        def train(extra, iters, metrics):
            return _run([REPO_ROOT / "train_rl.py", "--use-checkpoint-args", "--pretrained-checkpoint", ckpt,
                         "--micro-batch-size", "8", "--global-batch-size", "64", "--train-iters", str(iters),
                         "--lr", "2e-2", "--lr-decay-style", "constant", "--seed", "3", "--langrl-env-config",
                         env_yaml, "--langrl-allow-imports", "--grpo-prompts-per-step", "8", "--grpo-group-size",
                         "8", "--rl-max-new-tokens", "6", "--log-interval", "1", "--rl-metrics-jsonl", metrics,
                         "--inference-backend", "openai", "--inference-server-url", server.url + "/v1", *extra],
                        tmp_path)

        stopped = train([], 10, tmp_path / "m1.jsonl")
        assert stopped.returncode != 0 and "OffPolicyServerError" in stopped.stderr, stopped.stderr[-4000:]
        assert "--rl-off-policy-server" in stopped.stderr
        records = [json.loads(line) for line in (tmp_path / "m1.jsonl").read_text().splitlines()]
        gaps = [r["logprob_gap_mean"] for r in records if "logprob_gap_mean" in r]  # (not the sample lines)
        assert gaps[0] < 1e-4  # same weights on both sides: on-policy, no false alarm
        assert 1 < len(gaps) < 10 and gaps[-1] > 0.1  # stopped at the first iteration past the threshold

        declared = train(["--rl-off-policy-server"], len(gaps) + 1, tmp_path / "m2.jsonl")
        assert declared.returncode == 0, declared.stderr[-4000:]
    finally:
        server.stop()
