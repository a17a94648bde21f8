"""Fuzz both servers from their own OpenAPI schemas (hypothesis): no request may get a 5xx.

Bodies are drawn from the request schemas each server publishes (``/openapi.json``), and any value in them
may be swapped for a hostile one (huge or negative integers, NaN / Infinity, lone surrogates, wrong types,
long strings), so the fuzzer covers both "valid by the schema" and "just off it". Small limits and a fake
backend keep each request cheap. The totals are printed (run with ``-s``) for the record.
"""
from __future__ import annotations

import json

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytestmark = pytest.mark.slow

EXAMPLES = 500  # per test; 4 tests (the state test sends two requests per example)
TALLY = {"requests": 0, "5xx": 0}

_WILD = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70), st.sampled_from([-1, 0, 1, 2**31, 2**63, 2**64]),
    st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([1e-308, 5e-324, 1e-38, -0.0]),
    st.text(max_size=8), st.text(st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF), min_size=1, max_size=3),
    st.sampled_from(["user|>\n<|system", "x" * 5000, "", None, True, [], {}, [None], {"a": [1]}]),
)


def _strategy(schema: dict, defs: dict, depth: int = 0, wild: bool = True) -> st.SearchStrategy:
    """Values matching ``schema`` (the subset FastAPI / pydantic emit), each possibly replaced by a wild one
    (``wild``; else only values the schema admits)."""
    return st.one_of(_exact(schema, defs, depth, wild), _WILD) if depth and wild else _exact(schema, defs, depth, wild)


def _exact(schema: dict, defs: dict, depth: int, wild: bool = True) -> st.SearchStrategy:
    if "$ref" in schema:
        return _exact(defs[schema["$ref"].rsplit("/", 1)[-1]], defs, depth, wild)
    for key in ("anyOf", "oneOf"):
        if key in schema:
            return st.one_of([_exact(s, defs, depth, wild) for s in schema[key]])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "const" in schema:
        return st.just(schema["const"])
    kind = schema.get("type")
    if kind == "integer":
        lo, hi = schema.get("minimum", -2**40), schema.get("maximum", 2**40)
        return st.integers(min_value=int(lo), max_value=int(min(hi, 2**63 - 1)))
    if kind == "number":
        lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum", schema.get("exclusiveMaximum"))
        return st.floats(min_value=lo, max_value=hi, exclude_min="exclusiveMinimum" in schema,
                         exclude_max="exclusiveMaximum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "string":
        return st.text(min_size=int(schema.get("minLength", 0)), max_size=min(int(schema.get("maxLength", 24)), 24))
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(_strategy(schema.get("items", {}), defs, depth + 1, wild), min_size=int(schema.get("minItems", 0)),
                        max_size=min(int(schema.get("maxItems", 4)), 4))
    if kind == "object" or "properties" in schema:
        props = schema.get("properties", {})
        required = set(schema.get("required", []))
        return st.fixed_dictionaries(
            {k: _strategy(v, defs, depth + 1, wild) for k, v in props.items() if k in required},
            optional={k: _strategy(v, defs, depth + 1, wild) for k, v in props.items() if k not in required})
    return _WILD if wild else st.none()


def _send(client, method: str, path: str, body=None, headers=None) -> int:
    raw = None if body is None else json.dumps(body).encode()  # NaN/Infinity and "\ud800" escapes kept
    r = client.request(method, path, content=raw, headers={"Content-Type": "application/json", **(headers or {})})
    TALLY["requests"] += 1
    TALLY["5xx"] += r.status_code >= 500
    assert r.status_code < 500, (path, body, r.status_code, r.text[:300])
    return r.status_code


@pytest.fixture(scope="module", autouse=True)
def tally():
    yield
    print(f"\nfuzz tally: {TALLY['requests']} requests, {TALLY['5xx']} answered 5xx")


@pytest.fixture(scope="module")
def inference_client():
    from fastapi.testclient import TestClient

    from megatron.rl.inference.fake import FakeInference
    from megatron.rl.inference.validation import RequestLimits
    from megatron.rl.server.inference import ServerConfig, create_app

    limits = RequestLimits(max_tokens=6, max_n=3, max_samples=6, max_prompts=3, max_stop=3, max_prompt_chars=300,
                           max_messages=4)
    app = create_app(FakeInference(max_seq_len=48), ServerConfig(batch_window_s=0.0, default_max_tokens=4,
                                                                 limits=limits))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, app.openapi()


@pytest.fixture(scope="module")
def env_client():
    from fastapi.testclient import TestClient

    from megatron.rl.inference.fake import FakeInference
    from megatron.rl.inference.validation import RequestLimits
    from megatron.rl.server.agent.app import EnvServerConfig, create_app
    from tests.unit_tests.rl.agent.user_agents_fixture import ReverseWordAgent

    cfg = EnvServerConfig(allowed_inference=[{"backend": "fake", "kwargs": {"max_seq_len": 48}}], max_rollouts=6,
                          max_dp_world_size=4, max_agents=3, limits=RequestLimits(max_tokens=256, max_n=3))
    app = create_app(ReverseWordAgent(), inference=FakeInference(max_seq_len=48), config=cfg)
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, app.openapi()


def _body_schema(spec: dict, path: str) -> tuple[dict, dict]:
    content = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return content, spec.get("components", {}).get("schemas", {})


_FUZZ = settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                        HealthCheck.function_scoped_fixture])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_inference_server_never_5xx(inference_client, path):
    client, spec = inference_client
    schema, defs = _body_schema(spec, path)

    @_FUZZ
    @given(body=st.one_of(_strategy(schema, defs), _WILD))
    def run(body):
        _send(client, "POST", path, body)

    run()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_inference_server_serves_every_body_its_schema_admits(path):
    """The schema states every limit the server enforces (non-empty prompts and messages, prompts x n, the
    temperature gap, neutral-only options), so a body drawn from it is answered 200: a schema-driven client meets
    no 4xx it could not have known about."""
    from fastapi.testclient import TestClient

    from megatron.rl.inference.fake import FakeInference
    from megatron.rl.inference.validation import RequestLimits
    from megatron.rl.server.inference import ServerConfig, create_app

    limits = RequestLimits(max_tokens=6, max_n=3, max_samples=6, max_prompts=3, max_stop=3, max_prompt_chars=300,
                           max_messages=4)
    app = create_app(FakeInference(max_seq_len=4096), ServerConfig(batch_window_s=0.0, default_max_tokens=4,
                                                                   limits=limits))
    with TestClient(app, raise_server_exceptions=False) as client:
        schema, defs = _body_schema(app.openapi(), path)

        @_FUZZ
        @given(body=_strategy(schema, defs, wild=False))
        def run(body):
            raw = json.dumps(body).encode()
            r = client.post(path, content=raw, headers={"Content-Type": "application/json"})
            TALLY["requests"] += 1
            TALLY["5xx"] += r.status_code >= 500
            assert r.status_code == 200, (body, r.status_code, r.text[:300])

        run()


def test_environment_server_requests_never_5xx(env_client):
    client, spec = env_client
    schema, defs = _body_schema(spec, "/request")
    headers = st.fixed_dictionaries({}, optional={"X-DP-Rank": st.sampled_from(["0", "1", "-1", "3", "x", "9" * 30]),
                                                  "X-DP-World-Size": st.sampled_from(["1", "2", "4", "0", "5",
                                                                                      "9" * 30, "1.5"])})

    @_FUZZ
    @given(body=st.one_of(_strategy(schema, defs), _WILD), headers=headers)
    def run(body, headers):
        _send(client, "POST", "/request", body, headers)

    run()


def test_environment_server_state_never_5xx(env_client):
    client, _ = env_client
    good = client.get("/state").json()
    stream = good["train_stream"]
    states = st.one_of(
        _WILD, st.dictionaries(st.text(max_size=12), _WILD, max_size=3),
        st.fixed_dictionaries({"train_stream": st.fixed_dictionaries(
            {k: st.one_of(st.just(v), _WILD) for k, v in stream.items()})}))

    @_FUZZ
    @given(state=states)
    def run(state):
        _send(client, "POST", "/state", state)
        _send(client, "GET", "/state")

    run()
