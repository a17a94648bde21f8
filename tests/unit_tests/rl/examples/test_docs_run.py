"""examples/rl/README.md's walkthrough, run as written: its module and config files, then its shell blocks.

Blocks preceded by ``<!-- file: NAME -->`` are written to NAME; blocks preceded by ``<!-- run: walkthrough -->``
are run in order by one ``bash -e`` in that directory. The run trains a tiny random model, so the test checks
the mechanics (samples, per-environment metrics, a pass@k table), not learning.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

README = REPO_ROOT / "examples/rl/README.md"
_BLOCK = re.compile(r"<!-- (file|run): (\S+) -->\n```\w*\n(.*?)```", re.S)


def readme_blocks() -> tuple[dict[str, str], list[str]]:
    """``({file name: content}, [shell blocks to run])`` from the README."""
    files, runs = {}, []
    for kind, name, body in _BLOCK.findall(README.read_text()):
        if kind == "file":
            files[name] = body
        elif name == "walkthrough":
            runs.append(body)
    return files, runs


def test_readme_blocks_are_found_and_the_module_is_the_fixture():
    files, runs = readme_blocks()
    assert sorted(files) == ["my_env.yaml", "my_envs.py"] and len(runs) == 4
    assert "--eval-only" in runs[-1] and "show_samples.py" in runs[2]
    fixture = (REPO_ROOT / "tests/unit_tests/rl/agent/user_agents_fixture.py").read_text()
    code = [line.split("#")[0].rstrip() for line in files["my_envs.py"].splitlines() if line.strip()]
    assert all(line in fixture for line in code), "the README's module and user_agents_fixture.py differ"


@pytest.mark.slow
def test_readme_walkthrough_runs(tmp_path):
    files, runs = readme_blocks()
    for name, body in files.items():
        (tmp_path / name).write_text(body)
    script = tmp_path / "walkthrough.sh"
    script.write_text("set -euo pipefail\n" + "\n".join(runs))
    env = {**os.environ, "R": str(REPO_ROOT), "OUT": str(tmp_path / "out"), "OMP_NUM_THREADS": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    env.pop("PYTHONPATH", None)
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    # training: the per-environment split in the iteration line and in the metrics
    assert re.search(r"iteration +4/ +4 .*\| envs: arithmetic 2g r=\S+ len=\S+, reverse_word 2g r=", out), out[-4000:]
    lines = [json.loads(x) for x in (tmp_path / "out/metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if "reward_mean" in r]
    assert [r["iteration"] for r in train] == [1, 2, 3, 4]
    for r in train:
        assert r["env/reverse_word/groups"] == 2 and r["env/arithmetic/groups"] == 2
        both = (r["env/reverse_word/reward_mean"] + r["env/arithmetic/reward_mean"]) / 2  # equal group counts
        assert r["reward_mean"] == pytest.approx(both, abs=1e-12)
    # samples: printed by show_samples.py, from both environments
    samples = [s for r in lines if "samples" in r for s in r["samples"]]
    assert {s["env"] for s in samples} == {"arithmetic", "reverse_word"} and len(samples) == 16
    assert "iteration 4 | " in out and "  completion: '" in out
    assert (tmp_path / "out/envs.png").stat().st_size > 0
    # evaluation during training and --eval-only: pass@1 and pass@4 per environment
    evals = [r for r in lines if "eval/pass@4" in r]
    assert [r["iteration"] for r in evals] == [0, 2, 4]
    assert re.search(r"^environment +prompts +pass@1 +pass@4 +mean reward +failed$", out, re.M), out[-3000:]
    assert re.search(r"^reverse_word +8 +\d\.\d{3} +\d\.\d{3} ", out, re.M), out[-3000:]
    result = json.loads((tmp_path / "out/eval.json").read_text())
    assert result["iteration"] == 4 and result["eval/reverse_word/num_prompts"] == 8
    assert result["eval/arithmetic/pass@1"] <= result["eval/arithmetic/pass@4"]
