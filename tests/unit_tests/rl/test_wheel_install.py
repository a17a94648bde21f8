"""The built wheel works on its own: installed into a fresh venv and run from outside the repository, it
trains one RL iteration on the built-in ``type: arithmetic`` environment.

Before the environments moved into the package, the built-in agent table pointed into
``examples.rl.environments``, which the wheel did not contain: ``type: arithmetic`` failed with "built-in
agent 'arithmetic' could not be imported: ModuleNotFoundError: No module named 'examples'", and there was no
installed command to run (``train_rl.py`` is a script in the checkout). Installed, training runs as
``megatron-rl-train`` (or ``python -m megatron.rl.train_rl``).
"""
from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

RL_TINY = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "32",
           "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "16",
           "--lr", "1e-3", "--seed", "3", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
           "--rl-max-new-tokens", "4", "--log-interval", "1", "--train-iters", "1"]


def _run(cmd: list, cwd: Path, env: dict, timeout: int = 600) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-6000:]}"
    return proc


def _outside_env() -> dict:
    """This environment without anything that points at the checkout or a distributed job."""
    drop = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
            "MASTER_PORT")
    return {**{k: v for k, v in os.environ.items() if k not in drop}, "OMP_NUM_THREADS": "1"}


def _fresh_venv(path: Path) -> Path:
    """A venv that sees this interpreter's packages (torch, megatron-core) but not the editable checkout."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(path)], check=True)
    python = path / ("Scripts/python.exe" if os.name == "nt" else "bin/python")
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             check=True, capture_output=True, text=True).stdout.strip()
    # When this interpreter is itself a venv, --system-site-packages reaches the base Python, not this venv's
    # packages. Add its site directories as plain paths: a .pth file's lines are not processed recursively, so
    # the editable install's finder (another .pth hook there) stays off and the checkout is not importable.
    ours = [p for p in {*site.getsitepackages(), sysconfig.get_paths()["purelib"]} if Path(p).is_dir()]
    (Path(purelib) / "zz_parent_env.pth").write_text("\n".join(ours) + "\n")
    return python


@pytest.mark.slow  # ~1-2 min: builds a wheel, installs it and runs train_rl in a child process
def test_wheel_installs_and_trains_one_iteration_outside_the_repo(tmp_path):
    # build from a copy holding only what setup.py packages, so no build/ or egg-info lands in the checkout
    src = tmp_path / "src"
    src.mkdir()
    for name in ("setup.py", "README.md"):
        shutil.copy2(REPO_ROOT / name, src / name)
    shutil.copytree(REPO_ROOT / "megatron", src / "megatron", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    env = _outside_env()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w",
          tmp_path / "wheels", src], cwd=tmp_path, env=env)
    (wheel,) = (tmp_path / "wheels").glob("megatron_rl-*.whl")

    python = _fresh_venv(tmp_path / "venv")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", wheel],
         cwd=tmp_path, env=env)

    work = tmp_path / "work"  # not the repository, not its parent
    work.mkdir()
    where = _run([python, "-c", "import json, megatron.rl, megatron.core, megatron.rl.environments.math_task as m; "
                                "print(json.dumps([megatron.rl.__file__, megatron.core.__file__, m.SAMPLE_DATA]))"],
                 cwd=work, env=env)
    rl_file, core_file, sample_data = json.loads(where.stdout.strip().splitlines()[-1])
    assert str(tmp_path / "venv") in rl_file and str(REPO_ROOT) not in rl_file, rl_file  # the wheel, not the checkout
    assert "site-packages" in core_file, core_file
    assert str(tmp_path / "venv") in sample_data and Path(sample_data).is_file()  # data files ship too

    (work / "env.yaml").write_text("environments:\n  - type: arithmetic\n    args: {max_digits: 1}\n")
    metrics = work / "metrics.jsonl"
    train = Path(python).parent / ("megatron-rl-train.exe" if os.name == "nt" else "megatron-rl-train")
    proc = _run([train, *RL_TINY, "--langrl-env-config", "env.yaml", "--rl-metrics-jsonl", metrics], cwd=work,
                env=env)
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    metric_rows = [r for r in rows if "samples" not in r and "run" not in r]  # the run record names the run
    assert [r["iteration"] for r in metric_rows] == [1], (rows, proc.stderr[-3000:])
    assert metric_rows[0]["env/arithmetic/groups"] == 4  # the built-in environment from the wheel ran
