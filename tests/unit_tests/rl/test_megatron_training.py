"""megatron-core's own trainer beside megatron-rl: without --perform-rl-step it runs without RL; with it, it stops
before any model is built, in one line naming train_rl.py (never an AttributeError mid-run)."""
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

try:  # megatron-core ships megatron.training from 0.17 on
    import importlib.util

    HAS_TRAINER = importlib.util.find_spec("megatron.training") is not None
except ModuleNotFoundError:
    HAS_TRAINER = False

pytestmark = pytest.mark.skipif(not HAS_TRAINER, reason="this megatron-core ships no megatron.training")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


def test_the_trainer_imports_and_sees_no_rl_package():
    out = _run("import megatron.training.training as t\nprint('has_rl_utils', t.has_rl_utils)")
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "has_rl_utils False"


def test_perform_rl_step_is_refused_at_import_in_one_line_naming_train_rl():
    code = ("import sys\n"
            "sys.argv = ['pretrain_gpt.py', '--num-layers', '2', '--perform-rl-step']\n"
            "import megatron.training.training\n"
            "print('the trainer went on')\n")
    out = _run(code)
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    assert "the trainer went on" not in out.stdout
    last = out.stderr.strip().splitlines()[-1]
    assert "train_rl.py" in last and "--perform-rl-step" in last
    assert "Traceback" not in out.stderr and "AttributeError" not in out.stderr
