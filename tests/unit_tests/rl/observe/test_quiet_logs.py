"""Quiet by default: the start-up summary, staleness on the iteration line, one line for known dependency warnings,
and no per-request lines from the HTTP clients at INFO."""
from __future__ import annotations

import dataclasses

import io
import logging
import warnings
from pathlib import Path

import pytest

from megatron.rl.base.dependency_warnings import MISSING_KERNELS_NOTE, classify
from megatron.rl.observe.run_summary import run_summary
from megatron.rl.rollout.source import SynchronousRollouts
from megatron.rl.training.run import Resumed
from tests.conftest import REPO_ROOT

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "4", "--global-batch-size", "16", "--train-iters", "5", "--lr", "1e-3",
        "--langrl-env-config", str(REPO_ROOT / "examples/rl/environment_configs/arithmetic.yaml"),
        "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--rl-max-new-tokens", "8"]


def _configs(*extra, world_size=1):
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.training.config import parse_args

    cfg = parse_args([*BASE, *extra], extra_args_providers=[add_rl_args], world_size=world_size)
    return cfg, rl_config_from_args(cfg)


def test_summary_names_start_backend_layout_rollout_mode_and_packing():
    cfg, rl = _configs("--pretrained-checkpoint", "pre")
    text = run_summary(cfg, rl, Resumed(0, {}, False), SynchronousRollouts(None, None, rl, 0).describe())
    assert text.startswith("RL run: 5 iterations from 0 (4 prompts x 4 rollouts each, 1 optimizer step per iteration)")
    assert "start:    the pretrained checkpoint pre (weights only)" in text
    assert "backend:  megatron (the in-process engine on the training weights)" in text
    assert "layout:   TP=1 PP=1 EP=1 DP=1 (world 1); generation at the training layout" in text
    assert "rollouts: synchronous" in text
    # the default layout and why: rows of one group (64 + 3 x (8 + 1) = 91 -> 96 tokens), its prompt computed once
    assert "packing:  packed, rows of 96 tokens, 2 per micro-batch, a group's prompt computed once per row: " \
           "--rl-layout auto" in text
    assert "--seq-length 64 + 3 x (--rl-max-new-tokens 8 + 1) rounded up to 96" in " ".join(text.split())
    text = run_summary(*_configs("--rl-layout", "padded"), Resumed(0, {}, False), "synchronous")
    assert "packing:  padded, one rollout per row of 64 tokens, 4 per micro-batch: --rl-layout padded" in text

    cfg, rl = _configs("--rl-generation-lag", "1", "--rl-partial-rollouts", "--rl-submission-granularity", "G",
                       "--rl-consumption-granularity", "G", "--rl-use-sequence-packing",
                       "--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1",
                       world_size=2)

    class Loaded:
        path, loaded_optimizer, loaded_scheduler, loaded_rng = Path("ck/iter_0000003"), True, True, False

    text = run_summary(cfg, rl, Resumed(3, {"iteration": 3}, True, Loaded()), rl.async_rollouts.describe())
    assert "iterations from 3" in text
    assert "start:    resumed from ck/iter_0000003 at iteration 3 (weights, optimizer, scheduler, prompt positions)" \
        in text
    assert "TP=2 PP=1 EP=1 DP=1 (world 2); generation on an inference copy at TP=1 PP=1 EP=1" in text
    assert "rollouts: asynchronous: lag 1, partial rollouts, submission G, consumption G" in text
    assert "packing: packed, rows of 64 tokens, 4 per micro-batch, a group's prompt computed once per row: " \
           "--rl-use-sequence-packing; rows of --seq-length" in " ".join(text.split())
    assert "random" in run_summary(*_configs(), Resumed(0, {}, False), "synchronous")
    assert "from checkpoint" not in text
    cfg, rl = _configs()
    cfg = dataclasses.replace(cfg, checkpoint_args=("--num-layers 2", "--rl-max-new-tokens 8", "--swiglu"))
    last = run_summary(cfg, rl, Resumed(0, {}, False), "synchronous").splitlines()[-1]
    assert last == "  from checkpoint (--use-checkpoint-args): --num-layers 2, --rl-max-new-tokens 8, --swiglu"
    cfg, rl = _configs("--rl-durable-rollout-bank", "--save", "ck")
    assert rl.async_rollouts.describe("ck/rollout_bank/rank_0") == ("through the rollout pipeline (synchronous "
                                                                    "schedule): lag 0, drain before each update, "
                                                                    "submission B, consumption B, durable rollout "
                                                                    "bank ck/rollout_bank/rank_0")


def test_iteration_line_shows_staleness_in_asynchronous_mode():
    from megatron.rl.rl_loop import format_rl_line

    sync = {"reward_mean": 0.5, "rl_loss": 0.1}
    line = format_rl_line(3, 10, {**sync, "staleness_mean": 0.625, "staleness_max": 1.0,
                                  "off_policy_token_share": 0.5, "is_truncated_fraction": 0.0125}, 1e-3)
    parts = line.rstrip(" |").split(" | ")
    for part in ("stale: 0.625", "stale max: 1", "off-policy: 0.5", "is trunc: 0.0125"):
        assert parts.count(part) == 1, (part, line)
    assert "stale" not in format_rl_line(3, 10, sync, 1e-3)  # the synchronous path has no staleness metrics


@pytest.mark.parametrize("message,kind", [
    ("Transformer Engine and Apex are not installed. Falling back to Torch optimizers.", "missing"),
    ("Apex is not installed. Falling back to Torch Norm", "missing"),
    ("full scope is deprecated. Use empty cuda_graph_scope to capture the whole layer.", "internal"),
    ("Please use DTensor instead and we are deprecating ShardedTensor.", "internal"),
    ("`load_state_dict` is deprecated and will be removed in future versions. Please use `load` instead.", "internal"),
    ("something else entirely", None)])
def test_known_dependency_warnings_are_classified(message, kind):
    assert classify(message) == kind


def test_start_up_warnings_become_one_line_and_others_still_show(tmp_path):
    """A fresh interpreter (warnings show once per place) importing what a run imports, at INFO."""
    import subprocess
    import sys

    code = ("import warnings\n"
            "from megatron.rl.logging import setup_distributed_logging\n"
            "setup_distributed_logging('INFO')\n"
            "import megatron.core.optimizer, megatron.core.models.backends\n"
            "warnings.warn('full scope is deprecated. Use empty cuda_graph_scope')\n"
            "warnings.warn('an unrelated warning')\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT)})
    text = out.stdout + out.stderr
    assert out.returncode == 0, text
    assert text.count(MISSING_KERNELS_NOTE) == 1
    assert "not installed. Falling back" not in text and "full scope" not in text
    assert "an unrelated warning" in text


def test_train_rl_start_says_the_missing_kernels_once():
    """train_rl.py in a fresh interpreter, stopped by a named error once the trainer (and megatron-core) loaded:
    megatron-core's import-time fallback warnings are the one summary line, not a screenful."""
    import subprocess
    import sys

    at = BASE.index("--train-iters")
    argv = BASE[:at] + BASE[at + 2:]  # no --train-iters: refused after the imports, before any model
    out = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *argv], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT),
                                                      "OMP_NUM_THREADS": "1"})
    text = out.stdout + out.stderr
    assert out.returncode == 2 and "--train-iters is required" in text, text
    assert text.count(MISSING_KERNELS_NOTE) == 1, text
    assert "not installed. Falling back" not in text, text


def test_http_clients_log_no_per_request_lines_at_info():
    """httpx logs every request at INFO; a remote environment makes thousands. One request through a real server."""
    import httpx

    from megatron.rl.logging import setup_distributed_logging
    from tests.unit_tests.rl.server.inference.conftest import ServerProcess

    stream = io.StringIO()
    handler = setup_distributed_logging("INFO", stream=stream)
    old_stream = handler.setStream(stream)
    server = ServerProcess(["--backend", "fake"])
    try:
        with httpx.Client() as client:
            for _ in range(3):
                assert client.get(server.url + "/health").status_code == 200
        logging.getLogger("megatron.rl.test").info("after the requests")
    finally:
        server.stop()
        handler.setStream(old_stream)
    text = stream.getvalue()
    assert "after the requests" in text and "HTTP Request" not in text
    setup_distributed_logging("DEBUG")  # DEBUG shows them again
    assert logging.getLogger("httpx").getEffectiveLevel() <= logging.INFO
    setup_distributed_logging("INFO")


def test_short_iteration_line_fits_160_columns_with_the_log_prefix():
    from megatron.rl.logging import setup_distributed_logging
    from megatron.rl.observe.iteration_line import format_rl_line

    metrics = {"reward_mean": -0.62512, "reward_std": 0.3111, "rl_loss": -0.0123456, "kl_mean": 0.0123456,
               "logprob_gap_mean": 3.7312e-08, "logprob_gap_max": 1e-6, "entropy_mean": 1.234, "grad_norm": 12.5,
               "clip_fraction_low": 0.01, "clip_fraction_high": 0.02, "response_length_mean": 123.4,
               "generation_tokens_per_s": 12345.6, "train_tokens_per_s": 23456.7, "time_total_s": 1234.5,
               "time_generate_s": 1000.0, "env/arith/reward_mean": 0.5, "env/arith/groups": 4.0}
    last_eval = {"iteration": 9000, "eval/pass@1": 0.52311, "eval/pass@4": 0.9}
    stream = io.StringIO()
    handler = setup_distributed_logging("INFO")  # the run's handler and format, writing here for the test
    previous = handler.setStream(stream)
    logger = logging.getLogger("megatron.rl.rl_loop")
    try:
        logger.info(format_rl_line(14000, 20000, metrics, 1e-3, "short", last_eval))
        logger.info(format_rl_line(14000, 20000, metrics, 1e-3, "full", last_eval))
    finally:
        handler.setStream(previous)
    short, full = stream.getvalue().splitlines()
    assert len(short) <= 160, (len(short), short)
    assert short.endswith("iteration 14000/20000 | reward -0.625±0.31 | pass@1 0.523 | loss -0.012 | kl 0.012 | "
                          "gap 3.7e-8 | 1234s"), short
    assert len(full) > 300 and "learning rate: 1.000E-03" in full and "grad norm: 12.5" in full
    failed = format_rl_line(3, 10, {"reward_mean": 0.0, "failed_rollouts": 2.0, "skipped_update": 1.0}, 0.0, "short")
    assert failed == "iteration  3/10 | reward 0 | failed 2 | skipped"


def test_log_line_flag_chooses_the_form():
    assert _configs()[1].observe.log_line == "short"
    assert _configs("--log-line", "full")[1].observe.log_line == "full"
