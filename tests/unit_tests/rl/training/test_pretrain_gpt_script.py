"""pretrain_gpt.py as users run it: plain python from any directory, no install, clean errors for bad input."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
        "--mock-data", "--log-interval", "1"]


def _run(args, cwd):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                            "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    return subprocess.run([sys.executable, str(REPO_ROOT / "pretrain_gpt.py"), *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_single_process_run_from_elsewhere(tmp_path):
    proc = _run([*TINY, "--save", str(tmp_path / "ckpt")], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "iteration        2/       2" in out and "lm loss:" in out and "tokens/s:" in out
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "2"


@pytest.mark.parametrize("bad,needle", [
    (["--tensor-model-parallel-size", "2"], "world size 1 is not divisible"),
    pytest.param(["--load", "/nonexistent/ckpt"], "--load /nonexistent/ckpt: no checkpoint there",
                 marks=pytest.mark.slow),
    pytest.param(["--tokenizer-type", "NoSuchTokenizer"], "NoSuchTokenizer", marks=pytest.mark.slow),
], ids=["tp-vs-world", "missing-load", "unknown-tokenizer"])
def test_bad_input_fails_before_compute_with_named_error(tmp_path, bad, needle):
    proc = _run([*TINY, "--save", str(tmp_path / "ckpt"), *bad], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert needle in out and "Traceback" not in out, out[-4000:]
    assert "iteration " not in out and not (tmp_path / "ckpt").exists()  # nothing ran, nothing written


def test_resolve_load_dir(tmp_path):
    from megatron.rl.training.checkpoint.paths import CheckpointError
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.run import resolve_load_dir

    missing = str(tmp_path / "none")
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        resolve_load_dir(parse_args([*TINY, "--load", missing], world_size=1))
    # auto-resume pattern (--save DIR --load DIR) and --pretrained-checkpoint start fresh instead
    assert resolve_load_dir(parse_args([*TINY, "--load", missing, "--save", missing], world_size=1)) is None
    assert resolve_load_dir(parse_args([*TINY, "--load", missing, "--pretrained-checkpoint", "x"],
                                       world_size=1)) is None
    (tmp_path / "ck").mkdir()
    (tmp_path / "ck" / "latest_checkpointed_iteration.txt").write_text("garbage")
    with pytest.raises(CheckpointError):
        resolve_load_dir(parse_args([*TINY, "--load", str(tmp_path / "ck")], world_size=1))


@pytest.mark.slow  # four tiny pretraining runs (~40 s on an idle 2-core machine, 5 min on a busy one)
def test_resume_with_changed_flags_is_a_named_error(tmp_path):
    """A --train-iters changed on resume, and a changed --hidden-size, are one-line errors naming the flag (not
    megatron-core's bare AssertionError, not ffn_hidden_size)."""
    ckpt = str(tmp_path / "ckpt")
    assert _run([*TINY, "--save", ckpt], cwd=tmp_path).returncode == 0
    longer = [*TINY[:TINY.index("--train-iters")], "--train-iters", "4", *TINY[TINY.index("--train-iters") + 2:]]
    proc = _run([*longer, "--load", ckpt], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "Traceback" not in out, out[-4000:]
    assert "CheckpointError" in out and "--train-iters)" in out and "--use-checkpoint-opt-param-scheduler" in out
    proc = _run([*longer, "--load", ckpt, "--use-checkpoint-opt-param-scheduler"], cwd=tmp_path)
    assert proc.returncode == 0 and "iteration        4/       4" in proc.stdout + proc.stderr
    wider = [*TINY[:TINY.index("--hidden-size")], "--hidden-size", "64", *TINY[TINY.index("--hidden-size") + 2:]]
    proc = _run([*wider, "--load", ckpt], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2 and "pass --hidden-size 32" in out, out[-4000:]
