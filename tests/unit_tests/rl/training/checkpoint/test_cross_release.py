"""Checkpoints across the two supported megatron-core releases, with real checkpoints of each.

On the megatron-core 0.19 leg, with the 0.16.1 leg's interpreter (the repository's ``.venv``; ``.ci/run`` makes it
before ``.venv312``): a checkpoint written by 0.16.1 (common state in ``common.pt``) loads and resumes under 0.19
with the weights, Adam state, schedule, generator state and run state it was written with; a checkpoint written by
0.19 (common state inside the sharded files) is refused by 0.16.1's ``pretrain_gpt.py`` in one line that says why
and what to do.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron.rl.runtime import versions
from megatron.rl.training.checkpoint.paths import checkpoint_format
from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint
from tests.conftest import REPO_ROOT

OTHER_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
SCRIPTS = Path(__file__).parent / "scripts"
# The continuation under 0.19 runs other megatron-core code (and torch's CUDA build on the CPU) than the one under
# 0.16.1 did: the same losses up to float32 rounding, while a lost generator or optimizer state moves them by ~1e-2.
LOSS_RTOL = 1e-5


def _other_release() -> str:
    """The megatron-core release of the repository's ``.venv`` ("" when there is none)."""
    if not OTHER_PYTHON.is_file():
        return ""
    proc = subprocess.run([str(OTHER_PYTHON), "-c", "from importlib import metadata; "
                           "print(metadata.version('megatron-core'))"], capture_output=True, text=True, timeout=60)
    return versions.base_version(proc.stdout) if proc.returncode == 0 else ""


def _skip_reason() -> str:
    if not versions.is_0_19():
        return (f"runs on the megatron-core 0.19 leg (installed: {versions.installed_version()}); it drives the "
                f"0.16.1 leg's interpreter, {OTHER_PYTHON}")
    other = _other_release()
    if versions.release(other) != "0.16":
        return (f"needs megatron-core 0.16.1 in {OTHER_PYTHON} (found: {other or 'no such interpreter'}); make it as "
                f"leg 1 of .ci/run does (python3.11 -m venv .venv, then pip install torch and -e '.[dev]')")
    return ""


@pytest.fixture(scope="module", autouse=True)
def _other_interpreter():
    """Skip, naming why, where the 0.16.1 interpreter is not there to drive (asked once per module, not while
    collecting)."""
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)


def _run_other(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``args`` under the 0.16.1 interpreter, on this checkout's code, outside any process group of this one."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "VIRTUAL_ENV")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT))
    return subprocess.run([str(OTHER_PYTHON), *map(str, args)], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=600)


def test_a_checkpoint_written_by_0_16_1_resumes_under_0_19_as_written(dist1, tmp_path):
    tiny = dist1
    proc = _run_other([SCRIPTS / "save_for_other_release.py", tmp_path / "ckpt", tmp_path / "written.pt"], tmp_path)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    written = torch.load(tmp_path / "written.pt", weights_only=False)
    assert versions.release(written["release"]) == "0.16"
    k, n = written["k"], written["n"]
    assert checkpoint_format(tmp_path / "ckpt" / f"iter_{k:07d}") == "common.pt"

    arch = tiny.Arch(dropout=0.1)
    chunks, opt, sched = tiny.build(arch, False, seed=99)  # another init: only the load can make them equal
    tiny.reseed(4321)  # and other generator states
    info = load_checkpoint(tmp_path / "ckpt", chunks, opt, sched, model_args=arch.model_args())
    assert (info.iteration, info.run_state) == (k, written["run_state"])
    assert info.loaded_optimizer and info.loaded_scheduler and info.loaded_rng

    saved, params = written["saved"], tiny.full_params(chunks)
    assert params.keys() == saved["params"].keys()
    assert all(torch.equal(params[name], saved["params"][name]) for name in params)
    adam = tiny.adam_state_by_name(chunks, opt)
    assert adam.keys() == saved["adam"].keys()
    for name, state in saved["adam"].items():
        assert float(adam[name]["step"]) == float(state["step"]) == k
        assert torch.equal(adam[name]["exp_avg"], state["exp_avg"]), name
        assert torch.equal(adam[name]["exp_avg_sq"], state["exp_avg_sq"]), name
    assert (sched.num_steps, opt.param_groups[0]["lr"]) == (saved["sched_steps"], saved["lr"])
    assert torch.equal(torch.get_rng_state(), saved["torch_rng"])

    losses = [tiny.train_step(chunks, opt, sched, step) for step in range(k, n)]
    assert losses == pytest.approx(written["losses"], rel=LOSS_RTOL, abs=0)
    final = tiny.full_params(chunks)
    assert all(torch.allclose(final[name], value, rtol=1e-4, atol=1e-6)
               for name, value in written["final_params"].items())


def test_a_checkpoint_written_by_0_19_is_refused_by_0_16_1_in_one_line(dist1, tmp_path):
    tiny = dist1
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, False)
    tiny.train_step(chunks, opt, sched, 0)
    ckpt = save_checkpoint(tmp_path / "ckpt", 1, chunks, opt, sched, model_args=arch.model_args())
    assert checkpoint_format(ckpt) == "sharded common"

    tiny_run = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
                "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "2", "--lr", "1e-3",
                "--mock-data", "--log-interval", "1"]
    proc = _run_other([REPO_ROOT / "pretrain_gpt.py", *tiny_run, "--load", tmp_path / "ckpt"], tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-4000:]
    assert "Traceback" not in out and "iteration " not in out, out[-4000:]  # refused before any training step
    [line] = [ln for ln in out.splitlines() if "error:" in ln]
    assert line.startswith("pretrain_gpt.py: error: CheckpointError: ") and str(ckpt) in line
    assert "written by megatron-core 0.19" in line and "megatron-core 0.16.1 cannot read" in line  # why
    assert "load it with megatron-core 0.19" in line and "convert_megatron_to_hf.py" in line  # what to do
