"""The environment server against hostile clients: each test sends a hostile request to the in-process app."""
from __future__ import annotations

import gc
import http.server
import json
import threading
import weakref

import pytest
from fastapi.testclient import TestClient

from megatron.rl.inference import InferenceInterface
from megatron.rl.inference.fake import FakeInference
from megatron.rl.server.agent import create_app
from tests.unit_tests.rl.agent.user_agents_fixture import ReverseWordAgent

TOKEN = "t0ken"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def _client(config=None, agent=None) -> TestClient:
    kwargs = {} if config is None else {"config": config}
    app = create_app(agent or ReverseWordAgent(), token=TOKEN, inference=FakeInference(), **kwargs)
    return TestClient(app, raise_server_exceptions=False)


def _grouped(groups=1, size=1, **extra) -> dict:
    return {"type_name": "GroupedRolloutRequest", "num_groups": groups, "rollouts_per_group": size,
            "generation_args": {"max_tokens": 3, "seed": 1}, **extra}


# -- clients choosing backends, arguments and URLs ---------------------------------------------------
def test_request_cannot_make_the_server_run_code_from_a_directory(tmp_path):
    marker = tmp_path / "code_ran"
    model = tmp_path / "model"
    model.mkdir()
    (model / "evil_tok.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                       "from transformers import PreTrainedTokenizerFast as EvilTokenizer\n")
    (model / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": ["evil_tok.EvilTokenizer", None]}}))
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    spec = {"backend": "huggingface", "kwargs": {"model_path": str(model), "trust_remote_code": True}}
    r = _client().post("/request", json=_grouped(inference=spec), headers=AUTH)
    assert not marker.exists()
    assert r.status_code == 403
    # not even the operator can allowlist trust_remote_code for client-chosen specs
    from megatron.rl.server.agent.app import EnvServerConfig

    with pytest.raises(ValueError, match="trust_remote_code"):
        EnvServerConfig(allowed_inference=[spec])


class _Capture(http.server.BaseHTTPRequestHandler):
    seen: list[str] = []

    def _answer(self, body: dict, status: int = 200) -> None:
        _Capture.seen.append(self.headers.get("Authorization", ""))
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):  # noqa: N802 - http.server's naming
        self._answer({"object": "list", "data": [{"id": "m", "object": "model", "created": 0, "owned_by": "x"}]})

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self._answer({"error": {"message": "no", "type": "x", "code": 400}}, status=400)

    def log_message(self, *args):
        pass


@pytest.fixture
def capture_url():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Capture)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    _Capture.seen = []
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


def test_server_credentials_never_go_to_a_client_chosen_url(capture_url, monkeypatch):
    monkeypatch.setenv("OPENAI_API_KEY", "server-secret")
    spec = {"backend": "openai", "kwargs": {"base_url": capture_url, "max_retries": 0}}
    r = _client().post("/request", json=_grouped(inference=spec), headers=AUTH)
    assert _Capture.seen == []
    assert r.status_code == 403
    from megatron.rl.server.agent.app import EnvServerConfig

    # allowlisted by the operator: used, but never with the server's own key
    client = _client(EnvServerConfig(allowed_inference=[spec]))
    r = client.post("/request", json=_grouped(inference=spec), headers=AUTH)
    assert r.status_code == 200, r.text
    assert _Capture.seen and all(h == "Bearer EMPTY" for h in _Capture.seen), _Capture.seen
    other = {"backend": "openai", "kwargs": {"base_url": capture_url + "/", "max_retries": 0}}  # not exactly it
    assert client.post("/request", json=_grouped(inference=other), headers=AUTH).status_code == 403


@InferenceInterface.register("test-counting")
class _Counting(FakeInference):
    built = 0

    def __init__(self, **kw):
        super().__init__(**kw)
        type(self).built += 1


def test_caches_are_bounded(monkeypatch):
    from megatron.rl.server.agent.app import EnvServerConfig

    refs = []  # a weak reference to every agent instance the server makes for a (rank, world) pair
    hook = ReverseWordAgent._on_data_parallel_change

    def track(self):
        refs.append(weakref.ref(self))
        hook(self)

    monkeypatch.setattr(ReverseWordAgent, "_on_data_parallel_change", track)

    _Counting.built = 0
    client = _client()
    for i in range(30):  # distinct specs: none is built (not allowlisted)
        spec = {"backend": "test-counting", "kwargs": {"table_seed": i}}
        assert client.post("/request", json=_grouped(inference=spec), headers=AUTH).status_code == 403
    assert _Counting.built == 0
    allowed = [{"backend": "test-counting", "kwargs": {"table_seed": i}} for i in range(2)]
    client = _client(EnvServerConfig(allowed_inference=allowed, max_agents=8))
    for i in range(6):
        assert client.post("/request", json=_grouped(inference=allowed[i % 2]), headers=AUTH).status_code == 200
    assert _Counting.built == 2
    refs.clear()
    for world in range(1, 41):  # 40 distinct (rank, world) pairs
        headers = {**AUTH, "X-DP-Rank": str(world - 1), "X-DP-World-Size": str(world)}
        assert client.get("/state", headers=headers).status_code == 200
    gc.collect()
    assert len(refs) == 39 and sum(r() is not None for r in refs) <= 8  # (0, 1) existed already
    huge = {**AUTH, "X-DP-Rank": "0", "X-DP-World-Size": str(10**9)}
    assert client.get("/state", headers=huge).status_code == 400


# -- work per request ------------------------------------------------------------------------------
@pytest.mark.parametrize("body", [
    _grouped(5, 4), {"type_name": "RolloutRequest", "num_rollouts": 17},
    {"type_name": "EvaluationRequest", "num_prompts": 2, "num_samples": 8},
    {"type_name": "EvaluationRequest", "num_prompts": 1, "num_samples": 4, "ks": [1] * 100},
    _grouped(generation_args={"n": 1000}), _grouped(generation_args={"max_tokens": 10**6}),
    _grouped(generation_args={"stop": [f"s{i}" for i in range(100)]}),
], ids=["groups", "rollouts", "eval", "ks", "n", "max_tokens", "stop"])
def test_work_per_request_is_bounded(body):
    from megatron.rl.server.agent.app import EnvServerConfig

    r = _client(EnvServerConfig(max_rollouts=16, max_ks=8)).post("/request", json=body, headers=AUTH)
    assert r.status_code == 422, r.text
    assert len(r.text) < 600


# -- client mistakes: 4xx, no leaked exception text ------------------------------------------------
@pytest.mark.parametrize("body,status", [
    (_grouped(0), 422), (_grouped(generation_args={"seed": -1}), 422),
    (_grouped(generation_args={"seed": 2**64}), 422), (_grouped(generation_args={"temperature": 1e-308}), 422),
    (_grouped(inference={"backend": "nope"}), 403), (b"[" * 100_000, 422), (b"\xff\xfe", 422),
], ids=["num_groups=0", "seed=-1", "seed=2^64", "temperature", "unknown backend", "deep json", "not utf-8"])
def test_client_mistakes_are_4xx(body, status):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = _client().post("/request", content=raw, headers={**AUTH, "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    assert set(r.json()) == {"error", "detail"} and "Traceback" not in r.text


def test_path_probe_learns_nothing(tmp_path):
    probes = [{"backend": "huggingface", "kwargs": {"model_path": p}} for p in (str(tmp_path), "/no/such/dir")]
    client = _client()
    answers = [client.post("/request", json=_grouped(inference=s), headers=AUTH) for s in probes]
    assert answers[0].status_code == answers[1].status_code == 403
    assert answers[0].json() == answers[1].json()


@pytest.mark.parametrize("state", [{}, {"train_stream": {"consumed_global": -10, "seed": 1234, "size": 8}},
                                   {"train_stream": {"consumed_global": 10**30, "seed": 1234, "size": 8}},
                                   {"train_stream": {"consumed_global": "3", "seed": 1234, "size": 8}},
                                   {"train_stream": 5}, [1, 2]],
                         ids=["empty", "negative", "huge", "string", "wrong type", "not an object"])
def test_bad_state_is_refused_and_changes_nothing(state):
    client = _client()
    before = client.get("/state", headers=AUTH).json()
    r = client.post("/state", json=state, headers=AUTH)
    assert r.status_code == 422 and r.json()["error"] == "ValidationError", r.text  # as the schema says
    assert client.get("/state", headers=AUTH).json() == before
    ok = {"train_stream": {**before["train_stream"], "consumed_global": 5}}
    assert client.post("/state", json=ok, headers=AUTH).status_code == 200


def test_405_lists_every_method_of_the_path_and_the_schema_bounds_ks():
    client = _client()
    r = client.options("/state", headers=AUTH)
    assert r.status_code == 405 and r.headers["allow"] == "GET, POST"
    spec = client.get("/openapi.json", headers=AUTH).json()
    variants = spec["paths"]["/request"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    ks = next(v["properties"]["ks"] for v in variants if "ks" in v["properties"])
    assert next(o for o in ks["anyOf"] if o.get("type") == "array")["items"]["minimum"] == 1
    assert client.post("/request", headers=AUTH, json={"type_name": "EvaluationRequest", "num_prompts": 1,
                                                       "ks": [0]}).status_code == 422


def test_agent_failures_are_500_without_internals():
    class Broken(ReverseWordAgent):
        async def generate_grouped_rollouts(self, request):
            raise RuntimeError("db password is hunter2 at /srv/secret")

    r = _client(agent=Broken()).post("/request", json=_grouped(), headers=AUTH)
    assert r.status_code == 500 and "hunter2" not in r.text and "error id" in r.json()["detail"]


def test_an_agents_value_error_about_the_requests_values_is_422_with_its_message():
    """A schema-valid request the agent cannot serve as asked (a ValueError from the agent) was a 500."""
    class Picky(ReverseWordAgent):
        async def generate_grouped_rollouts(self, request):
            if request.num_groups % 2:
                raise ValueError(f"{request.num_groups} groups cannot be split between the 2 sub-environments")
            return await super().generate_grouped_rollouts(request)

    client = _client(agent=Picky())
    r = client.post("/request", json=_grouped(3), headers=AUTH)
    assert r.status_code == 422 and r.json() == {
        "error": "ValidationError", "detail": "GroupedRolloutRequest: 3 groups cannot be split between the 2 "
                                              "sub-environments"}
    assert client.post("/request", json=_grouped(2), headers=AUTH).status_code == 200
    r = client.post("/request", json={"type_name": "RolloutRequest", "num_rollouts": 1}, headers=AUTH)
    assert r.status_code == 422 and "1 groups cannot be split" in r.json()["detail"]


def test_a_weighted_mixture_that_cannot_serve_a_request_says_why_in_a_4xx():
    """The two-environment mixture of multi_task.yaml asked for one rollout: a 500 with the ValueError in the log."""
    from megatron.rl.agent.env_config import build_agent_from_config
    from tests.conftest import REPO_ROOT

    agent = build_agent_from_config(REPO_ROOT / "examples/rl/environment_configs/multi_task.yaml")
    r = _client(agent=agent).post("/request", json={"type_name": "RolloutRequest", "num_rollouts": 1}, headers=AUTH)
    assert r.status_code in (200, 422), r.text  # served, or refused naming the reason: never a 500
    if r.status_code == 422:
        assert "weighted environments" in r.json()["detail"]


def test_fastapis_own_errors_have_the_servers_error_shape():
    client = _client()
    for r in (client.get("/nope", headers=AUTH), client.get("/request", headers=AUTH)):
        assert r.status_code in (404, 405) and set(r.json()) == {"error", "detail"}


# -- schema, docs, auth ---------------------------------------------------------------------------
def test_openapi_declares_errors_and_limits_and_needs_the_token():
    from megatron.rl.server.agent.app import EnvServerConfig

    client = _client(EnvServerConfig(max_rollouts=77))
    assert client.get("/openapi.json").status_code == 401 and client.get("/docs").status_code == 401
    spec = client.get("/openapi.json", headers=AUTH).json()
    post = spec["paths"]["/request"]["post"]
    assert {"401", "403", "413", "422"} <= set(post["responses"])
    variants = post["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    grouped = [v for v in variants if v["properties"]["type_name"]["enum"] == ["GroupedRolloutRequest"]][0]
    assert grouped["properties"]["num_groups"]["maximum"] == 77 and grouped["properties"]["num_groups"]["minimum"] == 1
    # the schema states what the server enforces: no fields beyond the request type's own
    assert all(v["additionalProperties"] is False for v in variants)
    r = client.post("/request", json={**_grouped(1), "extra_field": 1}, headers=AUTH)
    assert r.status_code == 422 and "extra_field" in r.json()["detail"], r.text
    assert client.get("/docs", headers=AUTH).status_code == 200


class _UnsizedAgent(ReverseWordAgent):
    def dataset_size(self, validation):
        raise NotImplementedError  # a generated task: the server cannot tell its evaluation split's size


@pytest.mark.parametrize("sized", [True, False])
def test_evaluation_schema_requires_num_prompts_exactly_where_the_server_does(sized):
    client = _client(agent=ReverseWordAgent() if sized else _UnsizedAgent())
    spec = client.get("/openapi.json", headers=AUTH).json()
    variants = spec["paths"]["/request"]["post"]["requestBody"]["content"]["application/json"]["schema"]["oneOf"]
    [evaluation] = [v for v in variants if v["properties"]["type_name"]["enum"] == ["EvaluationRequest"]]
    r = client.post("/request", json={"type_name": "EvaluationRequest", "generation_args": {"max_tokens": 3}},
                    headers=AUTH)
    assert ("num_prompts" in evaluation["required"]) == (not sized) == (r.status_code == 422), r.text
    if not sized:
        assert evaluation["properties"]["num_prompts"]["type"] == "integer"  # null is no bound either
