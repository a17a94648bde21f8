"""A judge's API key planted in the served configuration appears in no response of any GET route."""
from __future__ import annotations

import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient

from megatron.rl.agent.model_reward import ModelRewardAgent
from megatron.rl.inference.fake import FakeInference
from megatron.rl.server.agent import create_app

SECRET = "sk-planted-judge-key-0123456789"
TOKEN = "t0ken"


def _agent() -> ModelRewardAgent:
    judge = {"inference": {"backend": "openai", "kwargs": {"base_url": "http://judge.invalid/v1", "api_key": SECRET,
                                                             "extra_headers": {"X-Auth-Token": SECRET}}},
             "weight": 1.0}
    return ModelRewardAgent(env={"type": "arithmetic", "args": {"max_tokens": 3}}, judge=judge, env_id="judged")


def _get_paths(app) -> list[str]:
    paths = {"/openapi.json", "/docs"}
    for route in app.routes:
        if isinstance(route, APIRoute) and "GET" in route.methods:
            paths.add(route.path)
    return sorted(paths)


@pytest.mark.parametrize("token", [None, TOKEN])
def test_planted_judge_key_is_in_no_get_response(token):
    app = create_app(_agent(), token=token, inference=FakeInference())
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    paths = _get_paths(app)
    assert {"/agent", "/state", "/health"} <= set(paths)
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in paths:
            r = client.get(path, headers=headers)
            assert r.status_code == 200, (path, r.status_code, r.text[:200])
            assert SECRET not in r.text, path
        described = client.get("/agent", headers=headers).json()
    kwargs = described["judge"]["inference"]["kwargs"]
    assert kwargs["api_key"] == "<redacted>" and kwargs["extra_headers"]["X-Auth-Token"] == "<redacted>"
    assert kwargs["base_url"] == "http://judge.invalid/v1"  # the rest is still described


def test_descriptive_routes_need_the_token_when_one_is_set():
    app = create_app(_agent(), token=TOKEN, inference=FakeInference())
    with TestClient(app, raise_server_exceptions=False) as client:
        for path in _get_paths(app):
            if path == "/health":
                continue
            r = client.get(path)
            assert r.status_code == 401, path
            assert SECRET not in r.text
        assert client.get("/health").status_code == 200
