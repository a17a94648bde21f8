"""The code blocks of README.md, examples/rl/README.md and docs/architecture.md: every one is run by a test here,
written to a file for them, or marked as an excerpt or as text (:mod:`doc_blocks` says how). The runs are slow: they
train, convert and serve small models; the checks that every block is accounted for, and the cheap blocks, are not.
"""
from __future__ import annotations

import ast
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT, free_port
from tests.unit_tests.rl.examples.doc_blocks import PAGES, blocks, fence_count, group, run_group

README, EXAMPLES, _ARCHITECTURE = PAGES
# every run group of the pages and the test that runs it
RUN_GROUPS = {(README, "setup"): "test_readme_set_up_commands_pin_what_is_installed + test_quickstart_runs_as_written",
              (README, "reuse"): "test_readme_reuse_a_checkpoint_runs",
              (EXAMPLES, "walkthrough"): "test_readme_walkthrough_runs",
              (EXAMPLES, "corpus"): "test_corpus_command_runs"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_block_is_run_written_or_marked(page):
    found = blocks(page)
    assert len(found) == fence_count(page), "a code block without a <!-- file|run|excerpt|text --> marker"
    for b in found:
        if b.kind == "excerpt":  # the reader sees it too, not only the HTML comment
            assert b.body.splitlines()[0].startswith("# excerpt"), b.body[:200]
        if b.kind == "run":
            assert (page, b.name) in RUN_GROUPS, f"run group {b.name!r} of {page.name} is run by no test"
            assert b.language in ("bash", "python"), b.body[:200]
    for (p, name), test in RUN_GROUPS.items():
        if p == page:
            assert group(page, name), f"no block of run group {name!r} left in {page.name} ({test})"


def test_readme_blocks_are_found_and_the_module_is_the_fixture():
    files = {b.name: b.body for b in blocks(EXAMPLES) if b.kind == "file"}
    runs = group(EXAMPLES, "walkthrough")
    assert sorted(files) == ["my_env.yaml", "my_envs.py"] and len(runs) == 7
    assert "--eval-only" in runs[4].body and "show_samples.py" in runs[3].body
    assert "--backend megatron" in runs[5].body and "convert_megatron_to_hf.py" in runs[6].body
    fixture = (REPO_ROOT / "tests/unit_tests/rl/agent/user_agents_fixture.py").read_text()
    code = [line.split("#")[0].rstrip() for line in files["my_envs.py"].splitlines() if line.strip()]
    assert all(line in fixture for line in code), "the README's module and user_agents_fixture.py differ"


def test_readme_set_up_commands_pin_what_is_installed():
    """The two set-up commands install the torch this suite runs on and an extra setup.py declares; their last
    commands are the quickstart (run by test_quickstart_runs_as_written) and this test suite itself."""
    import torch

    setup = (REPO_ROOT / "setup.py").read_text()
    last = []
    for b in group(README, "setup"):
        steps = [s.strip() for s in b.body.strip().split("&&")]
        assert steps[:2] == ["python3 -m venv .venv", ". .venv/bin/activate"], steps
        assert steps[2] == f"pip install torch=={torch.__version__.split('+')[0]}", steps
        extra = re.fullmatch(r'pip install -e "\.\[(\w+)\]"', steps[3])
        assert extra and f'"{extra.group(1)}":' in setup, steps
        last.append(steps[4])
    assert last == ["python examples/rl/quickstart.py", "pytest -q"]


def test_corpus_command_runs(tmp_path):
    proc = run_group(group(EXAMPLES, "corpus"), tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = (tmp_path / "corpus.jsonl").read_text().splitlines()
    assert len(lines) == 20000 and "Q: " in json.loads(lines[0])["text"]


def _printed_strings(stdout: str) -> list[str]:
    """The lines of ``stdout`` that are Python string literals (what the blocks print with ``repr``)."""
    out = []
    for line in stdout.splitlines():
        if line[:1] in ("'", '"'):
            try:
                value = ast.literal_eval(line)
            except (ValueError, SyntaxError):
                continue
            if isinstance(value, str):
                out.append(value)
    return out


def _repo_copy(dst: Path) -> Path:
    """The checkout without its build outputs, runs and environments: what a fresh clone holds."""
    shutil.copytree(REPO_ROOT, dst, ignore=shutil.ignore_patterns(".git", ".venv", "runs", "__pycache__", "*.egg-info",
                                                                  ".pytest_cache", "build", "dist"))
    return dst


@pytest.mark.slow  # the whole quickstart: 600 pretraining + 200 GRPO iterations (minutes on 2 CPU cores)
def test_quickstart_runs_as_written(tmp_path):
    repo = _repo_copy(tmp_path / "repo")
    proc = subprocess.run([sys.executable, "examples/rl/quickstart.py"], cwd=repo, capture_output=True, text=True,
                          timeout=3600, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-5000:]
    for banner in ("[1/4] corpus", "[2/4] pretraining", "[3/4] GRPO", "[4/4] plot"):
        assert f"=== {banner}: " in out, out[-3000:]
    m = re.search(r"held-out pass@1 .*: (\d\.\d+) at iteration 0 -> (\d\.\d+) ", out)
    assert m and float(m.group(2)) > float(m.group(1)) + 0.1, out[-3000:]  # reward rises (README: +0.2 to +0.4)
    assert (repo / "runs/quickstart/reward_curve.png").stat().st_size > 0
    rerun = subprocess.run([sys.executable, "examples/rl/quickstart.py"], cwd=repo, capture_output=True, text=True,
                           timeout=600, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert rerun.returncode == 0 and "reusing the pretrained checkpoint" in rerun.stdout, rerun.stdout[-3000:]
    assert "[3/4] GRPO: skipped" in rerun.stdout
    # retention (the last 2 and the best 1 by pass@1): at most three RL checkpoints, and the run resumes from them
    kept = sorted(p.name for p in (repo / "runs/quickstart/rl").glob("iter_*"))
    assert 1 <= len(kept) <= 3 and kept[-1] == "iter_0000200", kept
    more = subprocess.run([sys.executable, "examples/rl/quickstart.py", "--rl-iters", "201"], cwd=repo,
                          capture_output=True, text=True, timeout=900, env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert more.returncode == 0 and "at iteration 200" in more.stdout, more.stdout[-3000:]
    assert len(list((repo / "runs/quickstart/rl").glob("iter_*"))) <= 3


@pytest.mark.slow  # a short pretraining, two RL iterations, a server, a conversion: a few minutes on 2 CPU cores
def test_readme_reuse_a_checkpoint_runs(tmp_path):
    repo = _repo_copy(tmp_path / "repo")
    pre = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'examples/rl'); import quickstart; "
                          "from pathlib import Path; quickstart.pretrain(Path('runs/quickstart').resolve(), nproc=1, "
                          "gpu=False, iters=60)"], cwd=repo, capture_output=True, text=True, timeout=1200,
                         env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(repo)})
    assert pre.returncode == 0, pre.stdout[-3000:] + pre.stderr[-3000:]
    proc = run_group(group(README, "reuse"), repo, env={"PORT": str(free_port())})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert re.search(r"iteration +2/ *2 \|", out), out[-3000:]
    answers = _printed_strings(proc.stdout)  # the served answer (greedy), then Hugging Face's generate()
    assert len(answers) == 2 and answers[0] == answers[1], proc.stdout[-2000:]
    assert (repo / "runs/quickstart/hf/tokenizer.json").is_file()


@pytest.mark.slow
def test_readme_walkthrough_runs(tmp_path):
    """The walkthrough as written: the module and config files, trying the agent without a model, training,
    samples, evaluation, serving the checkpoint and converting it to Hugging Face (served too)."""
    for b in blocks(EXAMPLES):
        if b.kind == "file":
            (tmp_path / b.name).write_text(b.body)
    proc = run_group(group(EXAMPLES, "walkthrough"), tmp_path,
                     env={"R": str(REPO_ROOT), "OUT": str(tmp_path / "out"), "PORT": str(free_port())})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]

    # without a model: the fake backend's groups, two per environment
    assert re.search(r"^reverse_word \S+ \[", proc.stdout, re.M) and re.search(r"^arithmetic \S+ \[", proc.stdout, re.M)
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
    # served: by our engine from the checkpoint, then by transformers from the converted directory (greedy there,
    # so transformers' own generate() printed the same continuation)
    answers = _printed_strings(proc.stdout)
    assert len(answers) == 3 and answers[1].startswith("Reverse apple:") and answers[1][14:] == answers[2], answers
    assert (tmp_path / "out/hf/tokenizer.json").is_file()


def test_inference_server_help_shows_how_to_serve_a_checkpoint():
    """The pages serve checkpoints as `--backend megatron -- --load CKPT`; --help says so too."""
    from megatron.rl.server.inference.__main__ import build_parser

    text = build_parser().format_help()
    assert "--backend megatron --port 8000 -- --load CKPT" in text and "model_path=DIR" in text
