"""Bad input at the entry points: one line on stderr (rank 0), and torchrun's failure report names it."""
import io
import json
import os
import subprocess
import sys

import pytest

from megatron.rl.training.cli_errors import report_user_error
from megatron.rl.training.config import ConfigError
from tests.conftest import REPO_ROOT, free_port

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--micro-batch-size", "4", "--global-batch-size", "8", "--lr", "1e-3",
        "--tokenizer-type", "ByteLevelTokenizer", "--seed", "1"]


def test_one_line_on_rank_0_and_torchruns_report_shows_it(tmp_path, monkeypatch):
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    import torch.distributed as dist

    # The rank comes from $RANK here: a one-process world that an earlier in-process test left open would
    # otherwise answer 0 for every rank this test plays.
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    error_file = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(error_file))
    monkeypatch.setenv("RANK", "0")
    out = io.StringIO()
    line = report_user_error("train_rl.py", ConfigError("--foo=3: must be even."), stream=out)
    assert out.getvalue() == "train_rl.py: error: ConfigError: --foo=3: must be even.\n" == line + "\n"
    # torchrun reads the file with ProcessFailure and prints ChildFailedError's report
    failure = ProcessFailure(local_rank=0, pid=123, exitcode=2, error_file=str(error_file))
    report = ChildFailedError("train_rl.py", {0: failure}).format_msg()
    assert line in report and "To enable traceback" not in report

    monkeypatch.setenv("RANK", "1")  # other ranks stay quiet but still leave the error file
    error_file.unlink()
    out = io.StringIO()
    report_user_error("train_rl.py", ConfigError("x"), stream=out)
    assert out.getvalue() == "" and json.loads(error_file.read_text())["message"]["message"].endswith("x")


def _env():
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_ERROR_FILE"):
        env.pop(k, None)
    return env


def test_train_rl_bad_flags_exit_2_with_one_line(tmp_path):
    env_yaml = tmp_path / "env.yaml"
    env_yaml.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *TINY, "--train-iters", "1",
                           "--langrl-env-config", str(env_yaml), "--rl-eval-pass-at-k", "1", "4"],
                          cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [x for x in proc.stderr.splitlines() if "error:" in x]
    assert line.startswith("train_rl.py: error: ConfigError: --rl-eval-samples=4 with --rl-eval-temperature=0.0")


@pytest.mark.slow
@pytest.mark.multiprocess
def test_tp_vocabulary_error_under_torchrun_is_one_line_before_the_report(tmp_path):
    """The padded vocabulary of a TP=1 checkpoint (384) does not match TP=2 (512): the CheckpointError is
    printed once, before torchrun's report, and is the report's root cause."""
    env = _env()
    ckpt = tmp_path / "tp1"
    pre = subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *TINY, "--train-iters", "1",
                          "--mock-data", "--save", str(ckpt)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
    env_yaml = tmp_path / "env.yaml"
    env_yaml.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
           f"--master-port={free_port()}", str(REPO_ROOT / "train_rl.py"), *TINY, "--train-iters", "1",
           "--tensor-model-parallel-size", "2", "--pretrained-checkpoint", str(ckpt),
           "--langrl-env-config", str(env_yaml), "--grpo-prompts-per-step", "2", "--grpo-group-size", "4",
           "--rl-max-new-tokens", "8"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0, out[-3000:]
    lines = [x for x in proc.stderr.splitlines() if x.startswith("train_rl.py: error: CheckpointError: vocabulary")]
    assert len(lines) == 1, out[-5000:]  # rank 0 only
    assert "padded vocab 384" in lines[0] and "this run pads to 512" in lines[0], lines[0]
    report = proc.stderr[proc.stderr.index(lines[0]) + len(lines[0]):]
    assert "Root Cause" in report and "vocabulary mismatch" in report.split("Root Cause", 1)[1], report[-3000:]
    assert "Traceback" not in proc.stderr.split(lines[0])[0], out[-5000:]  # no worker traceback before it
