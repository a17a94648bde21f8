"""--rl-serve-inference: the gate between rollout phases and updates, flag checks, and the real loop end to end:
an environment server process generating through the trainer's served policy while GRPO trains it."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from megatron.rl.inference.api import GenerationArgs, InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.server.policy_server import PolicyGate, PolicyServingError, _GatedBackend, parse_address
from tests.conftest import REPO_ROOT, free_port

E2E = REPO_ROOT / "tests" / "unit_tests" / "rl" / "e2e"


def test_parse_address():
    assert parse_address("8000") == ("127.0.0.1", 8000)
    assert parse_address("0.0.0.0:9001") == ("0.0.0.0", 9001)
    assert parse_address("[::1]:80") == ("::1", 80)
    for bad in ("", "host:", "x:99999", "eighty"):
        with pytest.raises(ValueError, match="--rl-serve-inference"):
            parse_address(bad)


class _Recorder(InferenceInterface):
    """Records whether each call ran while the trainer said its weights were stable."""

    def __init__(self):
        self.stable = False
        self.calls: list[bool] = []

    async def agenerate(self, requests):
        self.calls.append(self.stable)
        await asyncio.sleep(0.05)
        self.calls.append(self.stable)
        return [InferenceResponse(text="x", token_ids=[1, 2], prompt_length=1, logprobs=[-0.1], finish_reason="stop")
                for _ in requests]


def test_requests_wait_for_a_rollout_phase_and_the_phase_waits_for_them():
    backend, gate = _Recorder(), PolicyGate(wait_s=30)
    served = _GatedBackend(backend, gate)
    req = [InferenceRequest(prompt="hi", generation_args=GenerationArgs(max_tokens=2))]
    results = []
    client = threading.Thread(target=lambda: results.append(asyncio.run(served.agenerate(req))))
    client.start()
    time.sleep(0.2)
    assert backend.calls == [] and not results  # between phases: held, not run against changing weights
    backend.stable = True  # the trainer enters a rollout phase
    gate.open()
    deadline = time.monotonic() + 10
    while not backend.calls and time.monotonic() < deadline:  # admitted (it is mid-generation now)
        time.sleep(0.001)
    gate.close()  # the phase ends: returns only after the admitted request has finished
    backend.stable = False  # ... so the "update" starts after it
    client.join(timeout=10)
    assert backend.calls == [True, True] and results[0][0].text == "x"
    assert gate.phases == 1


def test_a_request_that_never_sees_a_phase_fails_with_the_flag_named():
    served = _GatedBackend(_Recorder(), PolicyGate(wait_s=0.1))
    with pytest.raises(PolicyServingError, match="--rl-serve-inference-wait-s"):
        asyncio.run(served.agenerate([InferenceRequest(prompt="hi")]))


class _ModalRecorder(_Recorder):
    """A backend with an inference mode, as the in-process engine has."""

    @contextlib.contextmanager
    def rollout_phase(self):
        self.stable = True
        try:
            yield self
        finally:
            self.stable = False


def test_served_policy_over_http_between_and_inside_phases():
    import httpx

    from megatron.rl.server.policy_server import serve_policy

    backend = _ModalRecorder()
    served = serve_policy(backend, str(free_port()), wait_s=30)
    try:
        assert served.url.startswith("http://127.0.0.1:") and httpx.get(served.url + "/health").json()["status"] == "ok"
        answers = []
        client = threading.Thread(target=lambda: answers.append(httpx.post(
            served.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=60)))
        client.start()
        time.sleep(0.3)
        assert not answers and backend.calls == []  # no phase yet: the request waits
        with served.rollout_phase():  # what a rollout source does around a rollout phase
            deadline = time.monotonic() + 10
            while not backend.calls and time.monotonic() < deadline:
                time.sleep(0.01)
        client.join(timeout=10)
        assert answers[0].status_code == 200 and answers[0].json()["choices"][0]["text"] == "x"
        assert backend.calls == [True, True]  # ran entirely inside the phase
        # the address is taken now: a second server names the flag
        with pytest.raises(PolicyServingError, match="--rl-serve-inference: .*could not listen"):
            serve_policy(_ModalRecorder(), served.url.rsplit(":", 1)[1])
    finally:
        served.close()


def test_the_served_policy_validates_subnormal_values_as_sent_under_the_runs_flush_to_zero():
    """train_rl serves from a thread started inside the run's flush-to-zero scope (flush_denormals), where
    ``5e-324 == 0.0``: the server thread must validate the client's value, as the standalone server does."""
    import httpx

    from megatron.rl.runtime import flush_denormals
    from megatron.rl.server.policy_server import serve_policy

    with flush_denormals():  # as run_rl does around the whole run
        served = serve_policy(_ModalRecorder(), str(free_port()), wait_s=1)
    try:
        for value in (5e-324, 1e-310):
            r = httpx.post(served.url + "/v1/completions", json={"prompt": "Q1:", "temperature": value}, timeout=60)
            assert r.status_code == 422 and r.json()["error"]["param"] == "temperature", (value, r.text)
    finally:
        served.close()


@pytest.mark.parametrize("extra,needle", [
    (["--inference-backend", "openai", "--inference-server-url", "http://127.0.0.1:1/v1"], "--inference-backend"),
    (["--tensor-model-parallel-size", "2"], "TP=PP=EP=1"),
    (["--rl-serve-inference-wait-s", "0"], "--rl-serve-inference-wait-s"),
], ids=["not-in-process", "tensor-parallel", "wait"])
def test_serving_flags_are_checked_up_front(tmp_path, extra, needle):
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.training.config import ConfigError, parse_args

    env = tmp_path / "env.yaml"
    env.write_text("environments:\n  - type: arithmetic\n")
    argv = ["--num-layers", "2", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "32",
            "--micro-batch-size", "8", "--global-batch-size", "64", "--rl-max-new-tokens", "8",
            "--langrl-env-config", str(env),
            "--rl-serve-inference", "8000", *extra]
    world = 2 if "--tensor-model-parallel-size" in extra else 1
    with pytest.raises(ConfigError, match=needle):
        rl_config_from_args(parse_args(argv, extra_args_providers=[add_rl_args], world_size=world))


def test_policy_gap_check():
    from megatron.rl.observe.policy_gap import OffPolicyServerError, check_policy_gap

    check_policy_gap({"logprob_gap_mean": 1e-6}, 3, 0.1, False, "megatron")  # the trainer's own policy
    check_policy_gap({}, 1, 0.1, False, "openai", first=True)  # no log-probs: nothing to judge
    with pytest.raises(OffPolicyServerError, match=r"0\.7 per token.*--rl-off-policy-server"):
        check_policy_gap({"logprob_gap_mean": 0.7}, 5, 0.1, False, "openai")
    check_policy_gap({"logprob_gap_mean": 0.7}, 5, 0.1, True, "openai")  # off-policy by design


def _start_env_server(policy_url: str, log: Path) -> tuple[subprocess.Popen, str]:
    """The environment server at its default log level, its output in ``log``."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": f"{E2E}{os.pathsep}{REPO_ROOT}", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron.rl.server.agent", "--agent-type", "digits_please",
           "--imports", "digit_agents", "--allow-imports", "--inference-backend", "openai",
           "--inference-kwargs", json.dumps({"base_url": policy_url + "/v1", "timeout": 300}),
           "--port", str(port)]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, text=True)
    import httpx

    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            raise AssertionError(f"environment server exited: {log.read_text()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, "environment server did not start"
        time.sleep(0.2)


@pytest.mark.slow  # two processes: the environment server and train_rl.py (about a minute on 2 cores)
def test_remote_environment_trains_against_the_served_policy(tmp_path):
    """`type: remote` with the in-process engine, as users run it: an environment server that generates through
    the trainer's --rl-serve-inference URL; the reward rises as in the local quick test
    (tests/unit_tests/rl/e2e/test_reward_rises.py), and the served log-probs are the trainer's."""
    policy_port = free_port()
    policy_url = f"http://127.0.0.1:{policy_port}"
    server_log = tmp_path / "env_server.log"
    server, env_url = _start_env_server(policy_url, server_log)
    try:
        env = tmp_path / "remote.yaml"
        env.write_text(f"environments:\n  - type: remote\n    weight: 1\n    args:\n      url: {env_url}\n")
        metrics = tmp_path / "metrics.jsonl"
        cmd = [sys.executable, str(REPO_ROOT / "train_rl.py"),
               "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
               "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "64",
               "--train-iters", "12", "--lr", "2e-2", "--lr-decay-style", "constant", "--clip-grad", "1.0",
               "--seed", "3", "--langrl-env-config", str(env), "--grpo-prompts-per-step", "8",
               "--grpo-group-size", "8", "--rl-max-new-tokens", "6", "--rl-use-sequence-packing",
               "--log-interval", "1", "--rl-metrics-jsonl", str(metrics),
               "--rl-serve-inference", f"127.0.0.1:{policy_port}"]
        run_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
        proc = subprocess.run(cmd, cwd=REPO_ROOT, env=run_env, capture_output=True, text=True, timeout=900)
        assert proc.returncode == 0, proc.stderr[-5000:]
    finally:
        server.terminate()
        server.wait(timeout=30)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rewards = [r["reward_mean"] for r in records if "reward_mean" in r]
    assert len(rewards) == 12 and not any(r.get("failed_rollouts") for r in records)
    # the rollouts came through HTTP from the trainer's engine: its log-probs are the trainer's own (fp32)
    assert max(r["logprob_gap_max"] for r in records if "logprob_gap_max" in r) < 1e-4  # (not sample lines)
    first, last = statistics.fmean(rewards[:3]), statistics.fmean(rewards[-3:])
    assert last > first + 0.2 and last > 2 * first, f"reward did not rise: {rewards}"
    # quiet at INFO, both sides: no line per HTTP request (httpx's client lines, uvicorn's access lines; there were
    # 96 requests to each server here), the iteration lines and a start-up that does not grow with the run
    for name, text in (("trainer", proc.stdout + proc.stderr), ("environment server", server_log.read_text())):
        per_request = [line for line in text.splitlines() if "HTTP Request:" in line or '" 200' in line]
        assert not per_request, (name, per_request[:3])
    trainer = (proc.stdout + proc.stderr).splitlines()
    assert sum(bool(re.search(r" iteration +\d+/ *12 \|", line)) for line in trainer) == 12
    assert len(trainer) < 12 + 40, "\n".join(trainer)
    assert len(server_log.read_text().splitlines()) < 20, server_log.read_text()


@pytest.mark.slow  # an environment server and two train_rl.py ranks (a few minutes on 2 cores)
def test_asynchronous_rollouts_generate_through_the_served_policy(tmp_path):
    """--rl-serve-inference with asynchronous rollouts (lag 1, partial rollouts) on two data-parallel ranks: both
    ranks' remote environments generate through rank 0's engine, which pauses across every update only once
    both ranks have their batch (a pause under the other rank's requests would deadlock the run); every rollout
    succeeds, the trained tokens are at most one update old, and some are off-policy."""
    from tests.conftest import run_torchrun

    policy_port = free_port()
    server, env_url = _start_env_server(f"http://127.0.0.1:{policy_port}", tmp_path / "env_server.log")
    try:
        env = tmp_path / "remote.yaml"
        env.write_text(f"environments:\n  - type: remote\n    weight: 1\n    args:\n      url: {env_url}\n")
        metrics = tmp_path / "metrics.jsonl"
        run_torchrun(REPO_ROOT / "train_rl.py", [
            "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
            "--max-position-embeddings", "32", "--micro-batch-size", "8", "--global-batch-size", "32",
            "--train-iters", "6", "--lr", "2e-2", "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--seed", "3", "--langrl-env-config", env, "--grpo-prompts-per-step", "8", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "6", "--log-interval", "1", "--rl-metrics-jsonl", metrics,
            "--rl-generation-lag", "1", "--rl-partial-rollouts", "--rl-prompts-per-eval", "0",
            "--rl-serve-inference", f"127.0.0.1:{policy_port}"], timeout=900)
    finally:
        server.terminate()
        server.wait(timeout=30)
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    iterations = [r for r in records if "reward_mean" in r]
    assert len(iterations) == 6 and not any(r.get("failed_rollouts") for r in iterations)
    assert max(r["staleness_max"] for r in iterations) <= 1.0
    assert any(r["off_policy_token_share"] > 0 for r in iterations)
