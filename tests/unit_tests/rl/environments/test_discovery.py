"""Built-in environments are found in megatron/rl/environments/ itself: a module there that registers an agent type
is a built-in type, with no entry anywhere else, and finding it imports nothing."""
from __future__ import annotations

import importlib
import pkgutil
import subprocess
import sys

import pytest

from megatron.rl.agent.api import BUILTIN_AGENT_MODULES, ENVIRONMENTS_PACKAGE, Agent, discover_agent_modules
from megatron.rl.base.registry import DuplicateNameError
from tests.conftest import REPO_ROOT


def _package(tmp_path, monkeypatch, files: dict[str, str]) -> str:
    root = tmp_path / "discovery_pkg_for_test"
    root.mkdir()
    (root / "__init__.py").write_text("raise RuntimeError('discovery must not import the package')\n")
    for name, text in files.items():
        (root / name).write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    return root.name


def test_a_module_placed_in_the_package_is_discovered_without_import(tmp_path, monkeypatch):
    pkg = _package(tmp_path, monkeypatch, {
        "new_env.py": 'import no_such_dependency\n\n@Agent.register_subclass("new_env_type")\nclass X: ...\n',
        "helpers.py": "def f():\n    return 1  # mentions @Agent.register_subclass only in a comment\n"})
    assert discover_agent_modules(pkg) == {"new_env_type": f"{pkg}.new_env"}
    assert pkg not in sys.modules and f"{pkg}.new_env" not in sys.modules


def test_one_name_in_two_modules_is_an_error(tmp_path, monkeypatch):
    line = '@Agent.register_subclass("twice")\nclass X: ...\n'
    pkg = _package(tmp_path, monkeypatch, {"a.py": line, "b.py": line})
    with pytest.raises(DuplicateNameError, match="twice"):
        discover_agent_modules(pkg)


def test_every_environment_module_that_registers_a_type_is_a_builtin():
    """Import each module of the package and compare what it registered with the discovered table."""
    package = importlib.import_module(ENVIRONMENTS_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{ENVIRONMENTS_PACKAGE}.{info.name}")  # optional libraries load lazily
    registered = {name: cls.__module__ for name, cls in Agent._type_registry.registered().items()
                  if cls.__module__.startswith(ENVIRONMENTS_PACKAGE + ".")}
    discovered = {k: v for k, v in BUILTIN_AGENT_MODULES.items() if v.startswith(ENVIRONMENTS_PACKAGE + ".")}
    assert discovered == registered
    assert {"arithmetic", "countdown", "math", "calculator", "reasoning_gym", "openenv"} <= set(discovered)


def test_discovery_imports_no_environment():
    code = ("import sys, megatron.rl.agent.api as api; "
            "assert 'arithmetic' in api.BUILTIN_AGENT_MODULES; "
            "print([m for m in sys.modules if m.startswith('megatron.rl.environments')])")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
