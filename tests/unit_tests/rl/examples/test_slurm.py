"""examples/rl/slurm: bash syntax, and the torchrun command lines the sbatch scripts produce under a fake Slurm.

srun, scontrol and torchrun are replaced by stub executables on PATH: torchrun records its argv (and the
SLURM_NODEID it ran under), srun runs its command once per node with SLURM_NODEID set, scontrol answers
``show hostnames`` and records ``requeue``.
"""
from __future__ import annotations

import importlib.util
import os
import stat
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
SLURM_DIR = REPO / "examples" / "rl" / "slurm"
SINGLE = SLURM_DIR / "train_rl_single_node.sbatch"
MULTI = SLURM_DIR / "train_rl_multi_node.sbatch"

STUBS = {
    "torchrun": """#!/bin/bash
{ printf 'NODEID=%s\\0' "${SLURM_NODEID:-}"; printf '%s\\0' "$@"; } > "$STUB_OUT/torchrun.$$"
if [[ "${STUB_SEND_USR1:-0}" == 1 ]]; then kill -USR1 "$PPID"; exec sleep 30; fi  # exec: the TERM reaches the sleeper
""",
    "srun": """#!/bin/bash
echo "$*" >> "$STUB_OUT/srun.log"
while [[ $# -gt 0 && "$1" == --* ]]; do shift; done
for ((n = 0; n < ${SLURM_NNODES:-1}; n++)); do SLURM_NODEID=$n SLURM_PROCID=$n "$@" || exit $?; done
""",
    "scontrol": """#!/bin/bash
echo "$*" >> "$STUB_OUT/scontrol.log"
if [[ "$1 $2" == "show hostnames" ]]; then
    for ((i = 1; i <= ${SLURM_NNODES:-1}; i++)); do printf 'node%02d\\n' "$i"; done
fi
""",
}


LAUNCH_VARS = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MEGATRON_RL_DIR", "MODEL_CONFIG",
               "PRETRAINED_CKPT", "TOKENIZER_MODEL", "ENV_CONFIG", "RUNS_ROOT", "RUN_NAME", "GPUS_PER_NODE",
               "SAVE_INTERVAL", "PYTHON_ENV", "RL_CUDA"}


@pytest.fixture
def fake_slurm(tmp_path):
    """(env, out_dir): a PATH with the stubs and a Slurm-like environment for job 1234."""
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    bin_dir.mkdir()
    out.mkdir()
    for name, text in STUBS.items():
        path = bin_dir / name
        path.write_text(text)
        path.chmod(path.stat().st_mode | stat.S_IEXEC)
    pretrained = tmp_path / "pretrained"
    (pretrained / "tokenizer").mkdir(parents=True)
    # a clean slate: no Slurm/torchrun variables (in-process tests set MASTER_PORT etc.) or launcher settings
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k not in LAUNCH_VARS}
    env.update(PATH=f"{bin_dir}:{env['PATH']}", STUB_OUT=str(out), SLURM_JOB_ID="1234", SLURM_JOB_NAME="rl",
               SLURM_SUBMIT_DIR=str(REPO), SLURM_GPUS_ON_NODE="8", SLURM_NNODES="1", SLURM_JOB_NODELIST="node01",
               RUNS_ROOT=str(tmp_path / "runs"), PRETRAINED_CKPT=str(pretrained))
    return env, out


def run_script(script: Path, env: dict, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(script), *args], env=env, capture_output=True, text=True, timeout=60)


def torchrun_calls(out: Path) -> list[tuple[str, list[str]]]:
    """[(SLURM_NODEID, argv)] of every torchrun invocation, ordered by node id."""
    calls = []
    for f in out.glob("torchrun.*"):
        items = f.read_text().split("\0")[:-1]
        calls.append((items[0].removeprefix("NODEID="), items[1:]))
    return sorted(calls)


def value(argv: list[str], flag: str) -> str:
    assert argv.count(flag) == 1, f"{flag} appears {argv.count(flag)} times in {argv}"
    return argv[argv.index(flag) + 1]


def bash_array(config: Path, array: str) -> list[str]:
    script = f'source "$1"; printf "%s\\0" "${{{array}[@]}}"'
    out = subprocess.run(["bash", "-c", script, "bash", str(config)], check=True, capture_output=True, text=True)
    return out.stdout.split("\0")[:-1]


def parsed(train_args: list[str], world_size: int):
    """The train_rl.py flags through our parser (RL-only flags ignored; tensorboard dir dropped if not installed)."""
    from megatron.rl.training.config import parse_args

    args = list(train_args)
    if importlib.util.find_spec("tensorboard") is None and importlib.util.find_spec("tensorboardX") is None:
        i = args.index("--tensorboard-dir")
        del args[i:i + 2]
    return parse_args(args, world_size=world_size, ignore_unknown_args=True)


@pytest.mark.parametrize("script", [SINGLE, MULTI, SLURM_DIR / "rl_launch_lib.sh"], ids=lambda p: p.name)
def test_bash_syntax(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


def test_single_node_command_line(fake_slurm, tmp_path):
    env, out = fake_slurm
    proc = run_script(SINGLE, env, "--train-iters", "7", "--lr", "1e-6")
    assert proc.returncode == 0, proc.stderr
    (node, argv), = torchrun_calls(out)  # exactly one torchrun, run by the batch shell itself (no srun)
    assert not (out / "srun.log").exists()
    assert value(argv, "--nnodes") == "1" and value(argv, "--nproc-per-node") == "8"
    assert value(argv, "--rdzv-endpoint") == "localhost:21234"  # 20000 + 1234 % 20000
    assert value(argv, "--rdzv-id") == "1234"
    script_at = argv.index(str(REPO / "train_rl.py"))
    train = argv[script_at + 1:]
    run_dir = tmp_path / "runs" / "rl-1234"
    assert value(train, "--load") == value(train, "--save") == str(run_dir / "checkpoints")
    assert value(train, "--pretrained-checkpoint") == env["PRETRAINED_CKPT"]
    assert value(train, "--tokenizer-model") == env["PRETRAINED_CKPT"] + "/tokenizer"
    assert value(train, "--tensorboard-dir") == str(run_dir / "tensorboard")
    assert value(train, "--langrl-env-config").endswith("examples/rl/environment_configs/arithmetic.yaml")
    assert train[-4:] == ["--train-iters", "7", "--lr", "1e-6"]  # the user's extras come last and win
    model_args = bash_array(SLURM_DIR.parent / "model_configs" / "qwen2.5-0.5b.sh", "MODEL_ARGS")
    assert train[:len(model_args)] == model_args  # the default model config, verbatim
    cfg = parsed(train, world_size=8)
    assert (cfg.model.hidden_size, cfg.model.num_layers, cfg.model.add_qkv_bias) == (896, 24, True)
    assert cfg.checkpoint.load == str(run_dir / "checkpoints") and cfg.model.bf16
    assert "--exit-signal-handler" in train  # a preempted (SIGTERM) job saves before it is requeued
    for sub in ("checkpoints", "logs", "tensorboard"):
        assert (run_dir / sub).is_dir()
    assert list((run_dir / "logs").glob("train-1234-attempt0.log"))


def test_fresh_run_without_pretrained_checkpoint_loads_only_its_own_checkpoints(fake_slurm, tmp_path):
    env, out = fake_slurm
    del env["PRETRAINED_CKPT"]
    assert run_script(SINGLE, env).returncode == 0
    (_, argv), = torchrun_calls(out)
    assert "--load" not in argv and "--pretrained-checkpoint" not in argv  # nothing to resume from yet
    ckpt = tmp_path / "runs" / "rl-1234" / "checkpoints"
    (ckpt / "latest_checkpointed_iteration.txt").write_text("20")  # the first attempt saved, then was requeued
    for f in out.glob("torchrun.*"):
        f.unlink()
    env["SLURM_RESTART_COUNT"] = "1"
    assert run_script(SINGLE, env).returncode == 0
    (_, argv), = torchrun_calls(out)
    assert value(argv, "--load") == str(ckpt)


def test_multi_node_command_line(fake_slurm, tmp_path):
    env, out = fake_slurm
    config = SLURM_DIR.parent / "model_configs" / "qwen3-8b.sh"
    env.update(SLURM_NNODES="2", SLURM_JOB_NODELIST="node[01-02]", MODEL_CONFIG=str(config))
    proc = run_script(MULTI, env, "--train-iters", "3")
    assert proc.returncode == 0, proc.stderr
    calls = torchrun_calls(out)
    assert [node for node, _ in calls] == ["0", "1"]  # one torchrun per node, via srun
    assert "--ntasks-per-node=1" in (out / "srun.log").read_text()
    assert "show hostnames node[01-02]" in (out / "scontrol.log").read_text()
    assert calls[0][1] == calls[1][1]  # every node gets the same command line
    argv = calls[0][1]
    assert value(argv, "--nnodes") == "2" and value(argv, "--nproc-per-node") == "8"
    assert value(argv, "--rdzv-backend") == "c10d"
    assert value(argv, "--rdzv-endpoint") == "node01:21234"
    train = argv[argv.index(str(REPO / "train_rl.py")) + 1:]
    assert train[:len(bash_array(config, "MODEL_ARGS"))] == bash_array(config, "MODEL_ARGS")
    cfg = parsed(train, world_size=16)
    assert cfg.parallel.tensor_model_parallel_size == 2 and cfg.parallel.data_parallel_size == 8
    assert cfg.model.qk_layernorm and cfg.model.kv_channels == 128
    assert cfg.checkpoint.load == str(tmp_path / "runs" / "rl-1234" / "checkpoints")
    assert train[-2:] == ["--train-iters", "3"]


def test_usr1_before_time_limit_requeues_and_stops_the_run(fake_slurm):
    env, out = fake_slurm
    env["STUB_SEND_USR1"] = "1"  # torchrun "receives" the time-limit warning right away
    proc = run_script(SINGLE, env)
    assert proc.returncode != 0  # the run was stopped (SIGTERM), not left to hit the time limit
    assert "requeue 1234" in (out / "scontrol.log").read_text()
    assert "caught SIGUSR1" in proc.stdout + proc.stderr
