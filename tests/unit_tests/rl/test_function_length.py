"""No function of ``megatron/rl`` runs over 60 lines: one a reader takes in at once. A long function is split by
what its parts do; only a table of data may run longer, listed here with its reason.

A function's length is its whole definition, decorators excluded: ``end_lineno - lineno + 1`` of each
``def`` / ``async def`` (a nested function counts inside its enclosing one, and on its own).
"""
from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron" / "rl"
MAX_LINES = 60

# "module path:function name" -> why it is a table of data rather than logic
ALLOWED: dict[str, str] = {}


def function_lengths() -> dict[str, int]:
    """``"path:line name"`` -> lines, for every function and method of the package."""
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out[f"{path.relative_to(REPO_ROOT)}:{node.lineno} {node.name}"] = node.end_lineno - node.lineno + 1
    return out


def _allowed(key: str) -> bool:
    path, _, rest = key.partition(":")
    return f"{path}:{rest.split(' ', 1)[1]}" in ALLOWED


def test_the_reader_measures_whole_definitions():
    lengths = function_lengths()
    assert len(lengths) > 500, "the scan found too few functions: it is broken"
    tree = ast.parse("def f():\n    x = 1\n\n    return x\n")
    assert tree.body[0].end_lineno - tree.body[0].lineno + 1 == 4


def test_no_function_is_over_60_lines():
    long = {k: n for k, n in function_lengths().items() if n > MAX_LINES and not _allowed(k)}
    assert not long, (f"functions over {MAX_LINES} lines (split them by what their parts do; a table of data goes "
                      f"in ALLOWED with its reason):\n" + "\n".join(f"  {k}: {n} lines" for k, n in
                                                                  sorted(long.items(), key=lambda kv: -kv[1])))


def test_every_allowed_function_exists_and_is_still_long():
    lengths = function_lengths()
    for entry, reason in ALLOWED.items():
        path, _, name = entry.partition(":")
        found = [n for k, n in lengths.items() if k.startswith(f"{path}:") and k.split(" ", 1)[1] == name]
        assert found, f"ALLOWED names {entry}, which does not exist: drop it"
        assert max(found) > MAX_LINES, f"ALLOWED names {entry}, which is {max(found)} lines now: drop it"
        assert reason.strip(), f"ALLOWED entry {entry} gives no reason"
