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


def _bad_config_files(tmp_path):
    """{case: (extra flags, the start of the error line)}: non-UTF-8 bytes, 100,000 nested brackets and an oversized
    file as the environment config, and a binary checkpoint tracker."""
    from megatron.rl.agent.env_config import MAX_ENV_CONFIG_BYTES

    (tmp_path / "latin1.yaml").write_bytes("environments: [{type: arithmetic, name: caf\xe9}]\n".encode("latin-1"))
    (tmp_path / "deep.yaml").write_bytes(b"[" * 100_000)
    with open(tmp_path / "huge.yaml", "wb") as f:
        f.truncate(MAX_ENV_CONFIG_BYTES + 1)  # sparse: never read whole
    good = tmp_path / "good.yaml"
    good.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    (tmp_path / "ckpt").mkdir()
    tracker = tmp_path / "ckpt" / "latest_checkpointed_iteration.txt"
    tracker.write_bytes(b"\xff\xfe\x00\x01" * 1000)
    env = {name: ["--langrl-env-config", str(tmp_path / f"{name}.yaml")] for name in ("latin1", "deep", "huge")}
    return {
        "latin1": (env["latin1"], f"EnvConfigError: environment config {tmp_path / 'latin1.yaml'} is not UTF-8 text "
                                  f"(byte 0xe9 at offset 43)"),
        "deep": (env["deep"], f"EnvConfigError: {tmp_path / 'deep.yaml'}:1:65: invalid YAML: nested more than 64 "
                              f"levels deep"),
        "huge": (env["huge"], f"EnvConfigError: environment config {tmp_path / 'huge.yaml'} is larger than 4 MiB"),
        "tracker": (["--langrl-env-config", str(good), "--load", str(tmp_path / "ckpt")],
                    f"CheckpointError: corrupt tracker file {tracker}"),
    }


RL_TINY = [*TINY, "--train-iters", "1", "--rl-max-new-tokens", "8", "--grpo-prompts-per-step", "2",
           "--grpo-group-size", "4"]


@pytest.mark.parametrize("case", ["latin1", "deep", "huge"])
def test_train_rl_bad_environment_configs_are_one_line_and_status_2(tmp_path, capsys, case):
    """train_rl's main in this process (the CLI's own entry, without the interpreter start): see the next test."""
    from megatron.rl.train_rl import main

    extra, expected = _bad_config_files(tmp_path)[case]
    assert main([*RL_TINY, *extra]) == 2
    [line] = [x for x in capsys.readouterr().err.splitlines() if "error:" in x]
    assert line.startswith(f"train_rl.py: error: {expected}"), line


@pytest.mark.slow
def test_train_rl_bad_config_files_exit_2_with_one_line(tmp_path):
    """Each bad file: one line naming it, status 2, no traceback, through the CLI (the runs go in parallel)."""
    procs = {name: (subprocess.Popen([sys.executable, str(REPO_ROOT / "train_rl.py"), *RL_TINY, *extra], cwd=tmp_path,
                                     env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True), expected)
             for name, (extra, expected) in _bad_config_files(tmp_path).items()}
    for name, (proc, expected) in procs.items():
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, (name, err[-3000:])
        assert "Traceback" not in err, (name, err[-3000:])
        [line] = [x for x in err.splitlines() if "error:" in x]
        assert line.startswith(f"train_rl.py: error: {expected}"), (name, line)


def test_entry_point_logging_starts_at_the_command_lines_level():
    from megatron.rl.training.cli_errors import _log_level

    assert _log_level(["--lr", "1"]) == "INFO"
    assert _log_level(["--log-level", "WARNING", "--lr", "1"]) == "WARNING"
    assert _log_level(["--log-level=DEBUG"]) == "DEBUG"
    assert _log_level(["--log-level", "LOUD"]) == "INFO"  # the parser reports the bad value
