"""The import graph of ``megatron/rl``: no cycles, the layers' seams, and function-level imports only for heavy or
optional dependencies.

The graph is read from the source (``ast``), module-level and function-level imports alike (``TYPE_CHECKING``
blocks included): ``from package import name`` is an edge to ``package.name`` when that is a module, else to
``package``; the implicit import of a module's parent packages is not an edge.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron" / "rl"

# Third-party modules imported inside functions, each for one reason.
HEAVY_OR_OPTIONAL = {
    "megatron.core": "heavy: seconds to import; the CLI, config parsing and the pure modules must not pay it",
    "transformers": "optional (the hf extra) and heavy",
    "datasets": "optional (the data extra)",
    "wandb": "optional (the wandb extra)",
    "sympy": "optional (the math extra)",
    "matplotlib": "optional (the plot extra)",
    "uvicorn": "needed only by a process that serves HTTP",
    "fastapi": "needed only by a process that serves HTTP",
    "openai": "needed only by the openai backend's client",
    "torch.utils.tensorboard": "loads tensorboard: only when a run writes TensorBoard logs",
    "psutil": "needed only by the CPU layer's memory statistics",
    "xxhash": "optional (the gpu extra: faster checksums)",
    "reasoning_gym": "optional (the envs extra)",
    "openenv": "optional (the openenv extra)",
}
# Package modules that stay light (no torch at import): flags, configs, the CLI's first steps.
LIGHT = ("megatron.rl.base", "megatron.rl.logging", "megatron.rl.training.config",
         "megatron.rl.training.config_sections", "megatron.rl.training.cli_errors",
         "megatron.rl.training.checkpoint.args", "megatron.rl.training.checkpoint.paths", "megatron.rl.train_rl")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def _targets(module: str, path: Path, node: ast.AST) -> list[str]:
    """The modules an import statement imports (absolute names)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = module.split(".")[: len(module.split(".")) - node.level + (path.name == "__init__.py")]
        pkg = ".".join(base + ([node.module] if node.module else []))
    else:
        pkg = node.module or ""
    return [f"{pkg}.{a.name}" if f"{pkg}.{a.name}" in MODULES else pkg for a in node.names]


def imports(function_level: bool | None = None, probes: bool = True) -> list[tuple[str, str, int, bool]]:
    """(importer, imported, line, inside a function) for every import statement in the package (``probes``:
    with the module-level imports inside ``try:``, an optional dependency probed for)."""
    out = []
    for module, path in MODULES.items():
        def visit(node, in_function, in_try):
            for child in ast.iter_child_nodes(node):
                inner = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                if isinstance(child, (ast.Import, ast.ImportFrom)) and (probes or in_function or not in_try):
                    out.extend((module, t, child.lineno, in_function) for t in _targets(module, path, child))
                visit(child, inner, in_try or isinstance(child, ast.Try))

        visit(ast.parse(path.read_text()), False, False)
    return [r for r in out if function_level is None or r[3] == function_level]


def _inside(target: str) -> str | None:
    """The package module ``target`` names (itself or the closest enclosing one), None outside the package."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target if target.startswith("megatron.rl") else None


def graph(edges=None) -> dict[str, set[str]]:
    g: dict[str, set[str]] = {m: set() for m in MODULES}
    for importer, imported, _, _ in edges if edges is not None else imports():
        target = _inside(imported)
        if target and target != importer and target != "megatron.rl":
            g[importer].add(target)
    return g


def cycles(g: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, out, counter = {}, {}, set(), [], [], [0]
    for root in sorted(g):
        if root in index:
            continue
        work = [(root, iter(sorted(g[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            v, children = work[-1]
            for w in children:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(g[w]))))
                    break
                if w in on_stack:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    component = []
                    while True:
                        w = stack.pop()
                        on_stack.discard(w)
                        component.append(w)
                        if w == v:
                            break
                    if len(component) > 1:
                        out.append(sorted(component))
    return out


def test_the_graph_reader_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    g = graph()
    assert "megatron.rl.rollout.source" in g["megatron.rl.rl_utils"]  # the reader sees the package's imports


def test_no_import_cycles():
    found = cycles(graph())
    g = graph()
    details = [" -> ".join(c) + ":\n" + "\n".join(f"    {a} imports {b}" for a in c for b in sorted(g[a] & set(c)))
               for c in found]
    assert not found, "import cycles in megatron/rl:\n" + "\n".join(details)


def _reaches(importer_prefix: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[str]:
    out = []
    for importer, imported, line, _ in imports():
        if not (importer == importer_prefix or importer.startswith(importer_prefix + ".")):
            continue
        target = _inside(imported) or imported
        if any(target == f or target.startswith(f + ".") for f in forbidden) and not any(
                target == a or target.startswith(a + ".") for a in allowed):
            out.append(f"{importer}:{line} imports {imported}")
    return out


def test_the_layers_keep_their_seams():
    rl = "megatron.rl"
    above_base = tuple(f"{rl}.{m}" for m in {m.split(".")[2] for m in MODULES if m.count(".") >= 2} if m != "base")
    bad = _reaches(f"{rl}.base", above_base)
    # algorithms/: pure tensor math on base/ and torch
    package_modules = tuple(sorted({".".join(m.split(".")[:3]) for m in MODULES if m.count(".") >= 2}))
    bad += _reaches(f"{rl}.algorithms", package_modules, allowed=(f"{rl}.algorithms", f"{rl}.base"))
    bad += [f"{importer}:{line} imports {imported}" for importer, imported, line, _ in imports()
            if importer.startswith(f"{rl}.algorithms") and not imported.startswith(
                ("torch", "megatron.rl.algorithms", "megatron.rl.base", "__future__", "dataclasses", "typing",
                 "math", "functools"))]
    # inference/ never imports the trainer
    trainer = (f"{rl}.rl_utils", f"{rl}.rl_loop", f"{rl}.rl_loss", f"{rl}.rl_config", f"{rl}.rl_eval",
               f"{rl}.train_rl", f"{rl}.rollout", f"{rl}.layout")
    bad += _reaches(f"{rl}.inference", trainer)
    # layout/ (the inference copy, its refit and parity check) is below the trainer: the trainer hands it its scoring
    bad += _reaches(f"{rl}.layout", tuple(m for m in trainer if m != f"{rl}.layout"))
    # training/ (Megatron's training loop) knows nothing of agents, rollouts or the RL trainer
    bad += _reaches(f"{rl}.training", (f"{rl}.agent", f"{rl}.environments", *trainer))
    # rollout/ sits below the config module, which builds RLConfig with rollout's asynchronous section: it reads
    # the flags through the RolloutFlags protocol, and knows nothing of the trainer above it
    bad += _reaches(f"{rl}.rollout", tuple(m for m in trainer if m not in (f"{rl}.rollout", f"{rl}.layout")))
    # environments/ build on agent/, never the other way round (the answer extraction they share is in agent/)
    bad += _reaches(f"{rl}.agent", (f"{rl}.environments",))
    # routing/ is below inference/ (the engine records routes into its slots): a backend's ability arrives as a value
    bad += _reaches(f"{rl}.routing", (f"{rl}.inference",))
    # runtime/ (device choice and megatron-core patches) is the ground floor beside base/
    bad += _reaches(f"{rl}.runtime", tuple(m for m in package_modules if m not in (f"{rl}.runtime", f"{rl}.base")))
    assert not bad, "imports across the layers' seams:\n" + "\n".join(sorted(set(bad)))


def _loads_at_import(module: str) -> bool:
    """Whether ``module`` calls, at import time (a class base, a decorator, a module-level value), one of its own
    functions that imports a heavy or optional dependency (``class X(_base())`` with ``_base`` importing
    megatron-core)."""
    tree = ast.parse(MODULES[module].read_text())
    loaders = {f.name for f in tree.body if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) and any(
        isinstance(n, ast.ImportFrom) and (n.module or "").startswith(tuple(HEAVY_OR_OPTIONAL)) or
        isinstance(n, ast.Import) and any(a.name.startswith(tuple(HEAVY_OR_OPTIONAL)) for a in n.names)
        for n in ast.walk(f))}
    at_import = [n for stmt in tree.body if not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef))
                 for n in ast.walk(stmt) if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]
    return any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in loaders for n in at_import)


def _heavy_modules() -> set[str]:
    """Package modules whose import (module-level imports, followed) loads a heavy or optional dependency (not
    counting an optional dependency probed for inside ``try:``)."""
    module_level = imports(function_level=False, probes=False)
    heavy = {m for m, imported, _, _ in module_level if imported.startswith(tuple(HEAVY_OR_OPTIONAL))}
    heavy |= {m for m in MODULES if _loads_at_import(m)}
    g = graph(module_level)
    changed = True
    while changed:
        changed = False
        for m, targets in g.items():
            if m not in heavy and targets & heavy:
                heavy.add(m)
                changed = True
    return heavy


def test_function_level_imports_are_for_heavy_or_optional_dependencies_only():
    heavy = _heavy_modules()
    assert "megatron.rl.inference.engine.build" in heavy and "megatron.rl.rollout.sequences" not in heavy
    bad = []
    for importer, imported, line, _ in imports(function_level=True):
        if imported.startswith(tuple(HEAVY_OR_OPTIONAL)):
            continue
        target = _inside(imported)
        if target is not None and target in heavy:
            continue  # a package module that loads megatron-core (or an optional dependency) when imported
        if importer.startswith(LIGHT) and imported.split(".")[0] in ("torch", "numpy"):
            continue  # these modules stay importable without torch
        if target is not None and importer.startswith(LIGHT) and target not in LIGHT and not any(
                target.startswith(light + ".") for light in LIGHT):
            continue  # a light module reaching above itself only when asked
        bad.append(f"{importer}:{line} imports {imported} inside a function")
    assert not bad, ("function-level imports of light modules (move them to the top of the file, or say why in "
                     "HEAVY_OR_OPTIONAL):\n" + "\n".join(sorted(bad)))


def test_the_light_modules_import_without_torch():
    code = ("import sys\n" + "".join(f"import {m}\n" for m in LIGHT if m in MODULES) +
            "print(sorted(m for m in ('torch', 'numpy', 'megatron.core') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]


def test_the_trainer_modules_import_without_megatron_core():
    """The trainer's modules (and routing replay's bookkeeping) load megatron-core only when a run builds a model,
    so a tool or test that imports them for their functions does not pay its seconds and start-up warnings."""
    trainer = ("megatron.rl.rl_loss", "megatron.rl.rl_utils", "megatron.rl.rl_loop", "megatron.rl.routing.replay")
    code = "import sys\n" + "".join(f"import {m}\n" for m in trainer) + "print('megatron.core' in sys.modules)\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO_ROOT)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stdout + out.stderr[-2000:]
