"""What the run's checks ask of a backend is an ability its class declares, read through the class registered under
``--inference-backend``; no module of the package compares backend names. A backend of the user's, registered by an
import the environment config lists, is accepted by the flags and gets the checks its abilities call for."""
from __future__ import annotations

import ast
import textwrap

import pytest

from megatron.rl.base.errors import ConfigError
from megatron.rl.inference.api import InferenceInterface, backend_class, backend_names
from megatron.rl.routing.config import RouterReplayConfigError, validate_router_replay
from tests.conftest import REPO_ROOT
from tests.unit_tests.rl.test_rl_config import _rl, env_yaml  # noqa: F401 (fixture)

PACKAGE = REPO_ROOT / "megatron" / "rl"
ABILITIES = ("in_process_engine", "records_routes", "captures_decode_graphs", "needs_server_url", "serves_checkpoint")


def _backend_name_comparisons(source: str, names: set[str]) -> list[tuple[int, str]]:
    """(line, code) of every ``==`` / ``!=`` / ``in`` / ``not in`` / ``is`` comparison, or ``match`` case, in
    ``source`` with a backend name as a string constant on either side (alone or in a tuple, list or set)."""

    def names_in(node: ast.AST) -> bool:
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(isinstance(e, ast.Constant) and e.value in names for e in node.elts)
        return False

    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(names_in(side) for side in (node.left, *node.comparators)):
            out.append((node.lineno, ast.unparse(node)))
        elif isinstance(node, ast.MatchValue) and names_in(node.value):
            out.append((node.lineno, f"case {ast.unparse(node.value)}"))
    return out


def test_the_scan_finds_every_form_of_a_name_comparison():
    code = textwrap.dedent("""
        a = name == "megatron"
        b = "openai" != backend
        c = rl.inference_backend in ("huggingface", "x")
        d = name not in ["fake"]
        e = name == "megatron_core"        # not a backend name
        match name:
            case "megatron": pass
    """)
    found = [line for line, _ in _backend_name_comparisons(code, {"megatron", "openai", "huggingface", "fake"})]
    assert found == [2, 3, 4, 5, 8]


def test_no_module_compares_backend_names():
    names = set(backend_names())
    assert {"megatron", "openai", "huggingface", "fake"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        # the registry (inference/api.py) names backends as keys and registrations name them as arguments; neither
        # compares a name, so no module is exempt
        rel = str(path.relative_to(REPO_ROOT))
        found += [f"{rel}:{line}: {code}" for line, code in _backend_name_comparisons(path.read_text(), names)]
    assert not found, ("backend names compared (declare the ability on the backend class, InferenceInterface, and "
                       "read it through backend_class(name)):\n" + "\n".join(found))


def test_the_built_in_backends_declare_what_they_can_do():
    declared = {name: {a for a in ABILITIES if getattr(backend_class(name), a)}
                for name in ("megatron", "openai", "huggingface", "fake")}
    assert declared == {"megatron": {"in_process_engine", "records_routes", "captures_decode_graphs",
                                     "serves_checkpoint"},
                        "openai": {"needs_server_url"}, "huggingface": set(), "fake": set()}
    for ability in ABILITIES:
        assert getattr(InferenceInterface, ability) is False, f"{ability} is not off by default"


@pytest.fixture
def engine_like():
    """A backend registered as "test-engine" that declares the in-process engine's abilities."""

    @InferenceInterface.register("test-engine")
    class EngineLike(InferenceInterface):
        in_process_engine = records_routes = captures_decode_graphs = True

        async def agenerate(self, requests):
            return []

    yield EngineLike
    InferenceInterface._registry.pop("test-engine")


def test_checks_follow_the_declared_abilities_not_the_name(engine_like):
    def check(mode, name):  # as validate_rl_config calls it: the ability of the class registered under the name
        validate_router_replay(mode, inference_backend=name, records_routes=backend_class(name).records_routes,
                               num_experts=4, recompute_granularity=None, load_balancing="aux_loss")

    check("off", "fake")
    with pytest.raises(RouterReplayConfigError, match="--inference-backend=fake returns none"):
        check("rollout", "fake")
    try:
        check("rollout", "test-engine")
    except RouterReplayConfigError as e:  # only the megatron-core version may refuse, never the backend
        assert "--inference-backend" not in str(e), str(e)
    engine_like.records_routes = False
    with pytest.raises(RouterReplayConfigError, match="--inference-backend=test-engine returns none"):
        check("rollout", "test-engine")


def test_a_backend_registered_by_the_env_config_s_imports_is_accepted(tmp_path, monkeypatch):
    module = tmp_path / "my_backends.py"
    module.write_text(textwrap.dedent("""
        from megatron.rl.inference.api import InferenceInterface

        @InferenceInterface.register("my-server")
        class MyServer(InferenceInterface):
            needs_server_url = True

            async def agenerate(self, requests):
                return []
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    env = tmp_path / "env.yaml"
    env.write_text("imports: [my_backends]\nenvironments: [{type: arithmetic, weight: 1}]\n")
    try:
        with pytest.raises(ConfigError, match="--inference-backend my-server needs --inference-server-url"):
            _rl(env, "--langrl-allow-imports", "--inference-backend", "my-server")
        rl = _rl(env, "--langrl-allow-imports", "--inference-backend", "my-server", "--inference-server-url", "http://x")
        assert rl.inference_backend == "my-server"
    finally:
        InferenceInterface._registry.pop("my-server", None)


def test_an_unregistered_backend_names_the_flag_the_choices_and_what_to_do(env_yaml):  # noqa: F811
    with pytest.raises(ConfigError) as e:
        _rl(env_yaml, "--inference-backend", "nope")
    msg = str(e.value)
    for words in ("--inference-backend=nope", "registered backends: fake, huggingface, megatron, openai",
                  "@InferenceInterface.register('nope')", "imports:", "--langrl-allow-imports"):
        assert words in msg, msg
