"""The environment server in a real subprocess on loopback, used through RemoteAgent."""
import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from megatron.rl.agent.api import EvaluationRequest, GroupedRolloutRequest
from megatron.rl.agent.remote_agent import RemoteAgent, RemoteAgentError
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.fake import FakeInference
from megatron.rl.base.types import TokenRollout
from tests.conftest import REPO_ROOT, free_port
from tests.unit_tests.rl.agent.user_agents_fixture import ReverseWordAgent

TOKEN = "s3cret-token"


def start_server(*extra, token=TOKEN, delay_s=0.0):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "TEST_AGENT_TOKEN": token, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "megatron.rl.server.agent", "--agent-type", "reverse_word",
           "--imports", "tests.unit_tests.rl.agent.user_agents_fixture", "--allow-imports",
           "--inference-backend", "fake", "--inference-kwargs", json.dumps({"delay_s": delay_s}),
           "--port", str(port), "--token-env", "TEST_AGENT_TOKEN", "--log-level", "warning", *extra]
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"server exited early: {proc.stdout.read().decode()}")
        try:
            if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("server did not start within 120 s")


def stop(proc):
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    proc.stdout.close()


@pytest.fixture(scope="module")
def server():
    proc, url = start_server()
    yield url
    stop(proc)


def _req(groups=3, size=2, seed=5):
    return GroupedRolloutRequest(num_groups=groups, rollouts_per_group=size,
                                 generation_args=GenerationArgs(max_tokens=6, seed=seed, temperature=1.0))


def test_remote_rollouts_equal_local_ones(server):
    remote = RemoteAgent(url=server, token=TOKEN, seed=0)
    assert remote.health()["agent"] == "reverse_word"
    got = asyncio.run(remote.generate_grouped_rollouts(_req()))
    local = asyncio.run(ReverseWordAgent().generate_grouped_rollouts(
        _req().model_copy(update={"inference_interface": FakeInference()})))
    assert all(isinstance(r, TokenRollout) for g in got.groups for r in g.rollouts)
    assert [g.problem_id for g in got.groups] == [g.problem_id for g in local.groups]
    assert [[r.token_ids for r in g.rollouts] for g in got.groups] == \
        [[r.token_ids for r in g.rollouts] for g in local.groups]
    assert [[r.logprobs for r in g.rollouts] for g in got.groups] == \
        [[r.logprobs for r in g.rollouts] for g in local.groups]


def test_dp_ranks_state_and_evaluation(server):
    ranks = [RemoteAgent(url=server, token=TOKEN) for _ in range(2)]
    for r, agent in enumerate(ranks):
        agent.set_data_parallel(r, 2)
    ids = [[g.problem_id for g in asyncio.run(a.generate_grouped_rollouts(_req(groups=4, size=1))).groups]
           for a in ranks]
    assert not set(ids[0]) & set(ids[1]) and len(set(ids[0] + ids[1])) == 8  # one epoch of 8 words
    state = ranks[0].state_dict()
    nxt = [g.problem_id for g in asyncio.run(ranks[0].generate_grouped_rollouts(_req(groups=2, size=1))).groups]
    ranks[0].load_state_dict(state)
    again = [g.problem_id for g in asyncio.run(ranks[0].generate_grouped_rollouts(_req(groups=2, size=1))).groups]
    assert again == nxt
    ev = asyncio.run(RemoteAgent(url=server, token=TOKEN).evaluate(EvaluationRequest(
        num_samples=2, generation_args=GenerationArgs(max_tokens=4, seed=1))))
    assert ev.metrics["num_prompts"] == 8 and len(ev.results) == 8


def test_token_required_and_bad_requests_are_clear(server):
    with pytest.raises(RemoteAgentError, match="HTTP 401"):
        asyncio.run(RemoteAgent(url=server).generate_grouped_rollouts(_req()))
    with pytest.raises(RemoteAgentError, match="HTTP 401"):
        asyncio.run(RemoteAgent(url=server, token="wrong").generate_grouped_rollouts(_req()))
    r = httpx.post(server + "/request", json={"type_name": "NoSuchRequest"},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    assert r.status_code == 422 and "NoSuchRequest" in r.json()["detail"]
    r = httpx.post(server + "/request", json={"type_name": "GroupedRolloutRequest", "num_groups": 1,
                                              "rollouts_per_group": 1, "inference": {"backend": "nope"}},
                   headers={"Authorization": f"Bearer {TOKEN}"})
    # a client-chosen backend is refused (no allowlist), whether or not it exists: no registry probe
    assert r.status_code == 403 and "nope" not in r.text and "refused" in r.json()["detail"]


def test_unreachable_server_fails_after_retries():
    agent = RemoteAgent(url=f"http://127.0.0.1:{free_port()}", max_retries=2, retry_backoff_s=0.05)
    with pytest.raises(RemoteAgentError, match=r"cannot connect .*gave up after 3 attempts"):
        asyncio.run(agent.generate_grouped_rollouts(_req()))
    with pytest.raises(RemoteAgentError, match=r"cannot connect .*gave up after 3 attempts"):
        agent.health()  # the synchronous path retries the same way


def test_slow_server_times_out_and_killed_server_is_a_clear_error():
    proc, url = start_server(delay_s=60.0)  # every generation call sleeps 60 s
    try:
        with pytest.raises(RemoteAgentError, match="did not answer .* within timeout_s=1.0s"):
            asyncio.run(RemoteAgent(url=url, token=TOKEN, timeout_s=1.0).generate_grouped_rollouts(_req()))

        async def killed_mid_request():
            agent = RemoteAgent(url=url, token=TOKEN, timeout_s=120.0, max_retries=1, retry_backoff_s=0.05)
            task = asyncio.create_task(agent.generate_grouped_rollouts(_req()))
            await asyncio.sleep(2.0)  # the request is now being served (sleeping in the backend)
            os.killpg(proc.pid, signal.SIGKILL)
            # a hang would only end at timeout_s=120; the guard below turns that into a test failure
            return await asyncio.wait_for(task, timeout=60)

        with pytest.raises(RemoteAgentError, match="(dropped the connection|cannot connect)") as info:
            asyncio.run(killed_mid_request())
        assert url in str(info.value), str(info.value)
    finally:
        stop(proc)


def test_in_process_app_serves_a_multi_task_config():
    from fastapi.testclient import TestClient

    from megatron.rl.agent.api import AgentResponse
    from megatron.rl.agent.env_config import build_agent_from_config
    from megatron.rl.server.agent import create_app

    agent = build_agent_from_config(REPO_ROOT / "examples" / "rl" / "environment_configs" / "multi_task.yaml")
    client = TestClient(create_app(agent, inference=FakeInference()))
    assert client.get("/health").json()["agent"] == "weighted_multi_task"
    body = _req(groups=4, size=1).model_dump(mode="json")
    resp = AgentResponse.model_validate(client.post("/request", json=body).json())
    assert [g.env_id for g in resp.groups] == ["arithmetic"] * 3 + ["countdown"]
    state = client.get("/state").json()
    assert state["agents"]["arithmetic"]["train_stream"]["consumed_global"] == 3
    assert client.post("/state", json=state).json() == {"status": "ok"}
    bad = client.post("/request", content=b"{not json", headers={"Content-Type": "application/json"})
    assert bad.status_code == 422
