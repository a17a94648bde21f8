"""The registry of changes to megatron-core: every entry says what, why and for which versions; what it names
exists in the installed megatron-core; and no code outside ``megatron/rl/runtime/`` patches megatron-core (or
torch), no code inside it patches outside a registered function, and every subclass of ours that overrides a
megatron-core private method is registered."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from megatron.rl.runtime import all_patches, cpu_patches, patches
from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron" / "rl"
RUNTIME = PACKAGE / "runtime"
PATCHED_ROOTS = ("megatron.core", "torch")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(target: str):
    """``module:attr.attr`` -> the object (AttributeError / ImportError when it does not exist)."""
    module, _, path = target.partition(":")
    obj = importlib.import_module(module)
    for name in filter(None, path.split(".")):
        obj = getattr(obj, name)
    return obj


def _named_targets(changes: str) -> list[str]:
    """The ``megatron.core.module:Name.member`` targets an entry's ``changes`` names (``, .member`` continues the
    previous target's owner), ignoring free text in parentheses."""
    out = []
    for group in re.sub(r"\([^)]*\)", "", changes).split(";"):
        owner = None
        for item in (i.strip() for i in group.split(",")):
            word = item.split(" ")[0] if item else ""
            if word.startswith("megatron.core") and ":" in word:
                out.append(word)
                module, _, path = word.partition(":")
                owner = f"{module}:{path.rpartition('.')[0]}" if "." in path else f"{module}:"
            elif word.startswith(".") and owner is not None:
                out.append(owner + (word if not owner.endswith(":") else word[1:]))
    return out


# ----------------------------------------------------------------------------------------------- the registry


def test_every_entry_says_what_why_and_which_versions():
    entries = all_patches()
    kinds = {w for p in entries for w in p.when}
    assert {"cpu", "cuda", "on use", "per call", "subclass"} <= kinds, kinds
    for p in entries:
        assert p.changes.strip() and len(p.why) > 40 and p.versions, p.name
        assert all(re.fullmatch(r"\d+\.\d+\.\d+\S*", v) for v in p.versions), (p.name, p.versions)
        _resolve(p.where)  # the code that makes the change exists where the entry says
    assert set(cpu_patches.PATCHES) == {p.name for p in patches.entries("cpu")}


def test_what_an_entry_names_exists_in_the_installed_megatron_core():
    from megatron.rl.runtime import versions

    checked = 0
    for p in all_patches():
        if not versions.written_for(p.versions):  # an entry of another release names that release's members
            continue
        for target in _named_targets(p.changes):
            try:
                _resolve(target)
            except (AttributeError, ImportError) as e:
                raise AssertionError(f"patch {p.name!r} names {target}, which megatron-core does not have: {e}")
            checked += 1
    assert checked >= 25, checked


def test_a_patch_is_registered_once_with_its_reasons():
    with pytest.raises(ValueError, match="duplicate"):
        patches.register("paged attention without flash-attn -> pure torch", when="cuda", changes="x",
                         why="y")(lambda: None)
    with pytest.raises(ValueError, match="say what it changes, why"):
        patches.register("an unexplained patch", when="cuda", changes="megatron.core.x:y", why="")(lambda: None)
    assert "an unexplained patch" not in patches.REGISTRY


# ----------------------------------------------------------------------------------------------- the scan


class _PatchFinder(ast.NodeVisitor):
    """Assignments to attributes of megatron-core / torch objects (imported names and their aliases), setattr on
    them, and ``<anything>.forward = ...`` (a module's forward shadowed), each with its enclosing top-level
    function or class (``module:qualname``)."""

    def __init__(self, module: str):
        self.module = module
        self.tainted: set[str] = set()
        self.scope: list[str] = []
        self.found: list[tuple[str, int, str]] = []  # (enclosing, line, what)

    def _enclosing(self) -> str:
        return f"{self.module}:{'.'.join(self.scope[:1]) or '<module>'}"

    def visit_Import(self, node):
        for a in node.names:
            if a.name.startswith(PATCHED_ROOTS):
                self.tainted.add((a.asname or a.name).split(".")[0])

    def visit_ImportFrom(self, node):
        if node.module and node.level == 0 and node.module.startswith(PATCHED_ROOTS):
            self.tainted.update(a.asname or a.name for a in node.names)

    def _scoped(self, node):
        self.scope.append(node.name)
        self.generic_visit(node)
        self.scope.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _scoped

    def _root(self, node) -> str | None:
        """The name a chain of attributes starts from (a module, a class); None through a call (an instance
        that a function returned, e.g. a model's config, is not megatron-core's code)."""
        while isinstance(node, (ast.Attribute, ast.Subscript)):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    def _check_target(self, target, line: int) -> None:
        if isinstance(target, ast.Tuple):
            for t in target.elts:
                self._check_target(t, line)
        elif isinstance(target, ast.Attribute):
            if self._root(target) in self.tainted:
                self.found.append((self._enclosing(), line, ast.unparse(target)))
            elif target.attr == "forward":
                self.found.append((self._enclosing(), line, ast.unparse(target)))

    def visit_Assign(self, node):
        for target in node.targets:
            self._check_target(target, node.lineno)
            if isinstance(target, ast.Name) and self._root(node.value) in self.tainted:
                self.tainted.add(target.id)  # an alias: cls = dynamic_context.DynamicInferenceContext
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._check_target(node.target, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node):
        if isinstance(node.func, ast.Name) and node.func.id == "setattr" and node.args:
            if self._root(node.args[0]) in self.tainted:
                self.found.append((self._enclosing(), node.lineno, ast.unparse(node)))
        self.generic_visit(node)


def find_patches(root: Path = PACKAGE) -> list[tuple[Path, str, int, str]]:
    out = []
    for path in sorted(root.rglob("*.py")):
        finder = _PatchFinder(_module_name(path))
        finder.visit(ast.parse(path.read_text()))
        out += [(path, enclosing, line, what) for enclosing, line, what in finder.found]
    return out


def test_only_registered_functions_of_the_runtime_package_patch_megatron_core():
    registered = {p.where for p in all_patches()}
    found = find_patches()
    assert any(path.parent == RUNTIME for path, *_ in found), "the scan finds none of the registered patches"
    outside = [f"{path.relative_to(REPO_ROOT)}:{line}: {what}" for path, _, line, what in found
               if RUNTIME not in path.parents]
    assert not outside, ("megatron-core / torch patched outside megatron/rl/runtime/ (register the change in "
                         "megatron.rl.runtime.patches and apply it from there):\n" + "\n".join(outside))
    unregistered = sorted({f"{enclosing} ({path.name}:{line}: {what})" for path, enclosing, line, what in found
                           if RUNTIME in path.parents and enclosing not in registered})
    assert not unregistered, "patches applied by functions the registry does not list:\n" + "\n".join(unregistered)


def _private_overrides(root: Path = PACKAGE) -> dict[str, list[str]]:
    """``module:Class`` -> the private (``_name``, not dunder) methods it defines, for every class in the package
    that derives from a class imported from megatron-core."""
    out = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text())
        imported = {a.asname or a.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module and node.module.startswith("megatron.core") for a in node.names}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef) and any(ast.unparse(b).split(".")[0] in imported for b in node.bases):
                private = [f.name for f in node.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                           and f.name.startswith("_") and not f.name.startswith("__")]
                if private:
                    out[f"{_module_name(path)}:{node.name}"] = private
    return out


def test_subclasses_overriding_megatron_core_internals_are_registered():
    overrides = _private_overrides()
    assert "megatron.rl.inference.engine.build:SamplingController" in overrides, "the scan is broken"
    declared = {p.where for p in patches.entries("subclass")}
    missing = sorted(set(overrides) - declared)
    assert not missing, f"register these subclasses in megatron.rl.runtime.subclasses: {missing}"


def test_an_on_call_entry_is_called_by_its_feature_not_applied():
    from megatron.rl.runtime import prefix_cache

    entry = patches.REGISTRY[prefix_cache.FORGET_CACHED_PREFIXES]
    assert entry.when == ("on call",) and entry.where.endswith(":forget_cached_prefixes")
    with pytest.raises(ValueError, match="not applied with apply"):
        patches.apply(prefix_cache.FORGET_CACHED_PREFIXES)
