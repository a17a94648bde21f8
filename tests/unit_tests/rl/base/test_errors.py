"""Every error class of ``megatron/rl`` derives from :class:`RLError` (``except RLError`` catches whatever the package
raises on purpose), keeping the built-in bases its callers catch.

Every module of the package is imported and every exception class it defines is checked; a module that cannot be
imported here (an optional dependency missing) fails the test, since its errors would go unchecked.
"""
from __future__ import annotations

import ast
import importlib
import inspect

import pytest

from megatron.rl.base.errors import ConfigError, RLError, UserError
from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron" / "rl"
# Modules that refuse to be imported, by design: module -> why. They must define no class (checked from the source).
NEVER_IMPORTED = {"megatron.rl.rl_profiling": "megatron-core's trainer probes for it; its import always fails, naming "
                                              "train_rl.py"}


def _modules() -> list[str]:
    out = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
        out.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def _defined_exceptions(module) -> list[type]:
    return [obj for _, obj in inspect.getmembers(module, inspect.isclass)
            if obj.__module__ == module.__name__ and issubclass(obj, BaseException)]


def test_every_module_s_exceptions_derive_from_rl_error():
    found, bad, unimportable = [], [], []
    for name in _modules():
        if name in NEVER_IMPORTED:
            source = (REPO_ROOT / (name.replace(".", "/") + ".py")).read_text()
            assert not any(isinstance(n, ast.ClassDef) for n in ast.walk(ast.parse(source))), name
            continue
        try:
            module = importlib.import_module(name)
        except ImportError as e:
            unimportable.append(f"{name}: {e}")
            continue
        for cls in _defined_exceptions(module):
            found.append(cls)
            if not issubclass(cls, RLError):
                bad.append(f"{name}.{cls.__qualname__} (bases: {', '.join(b.__name__ for b in cls.__bases__)})")
    assert not unimportable, "modules that could not be imported, so their errors went unchecked:\n" + \
        "\n".join(unimportable)
    assert len(found) > 20, "the scan found too few exception classes: it is broken"
    assert not bad, ("exception classes not deriving from RLError (write `class X(RLError, TheBuiltinBase)` so "
                     "callers' `except TheBuiltinBase` still works):\n" + "\n".join(bad))


@pytest.mark.parametrize("module, name, builtin", [
    ("megatron.rl.routing.config", "RouterReplayError", RuntimeError),
    ("megatron.rl.base.optional", "MissingExtraError", ImportError),
    ("megatron.rl.inference.engine.graphs", "GraphReplayError", RuntimeError),
    ("megatron.rl.agent.token_episode", "TokenMismatchError", RuntimeError),
    ("megatron.rl.agent.reward_model", "RewardModelError", RuntimeError),
    ("megatron.rl.environments.safe_expr", "ExprError", ValueError),
    ("megatron.rl.server.inference.app", "BackendFailure", RuntimeError),
])
def test_errors_keep_the_builtin_base_their_callers_catch(module, name, builtin):
    cls = getattr(importlib.import_module(module), name)
    with pytest.raises(builtin) as caught:
        raise cls("why")
    assert isinstance(caught.value, RLError) and str(caught.value) == "why"


def test_bad_input_errors_are_user_errors():
    assert issubclass(ConfigError, UserError) and issubclass(ConfigError, ValueError)
    from megatron.rl.routing.config import RouterReplayConfigError

    assert issubclass(RouterReplayConfigError, ConfigError)
