"""No module docstring of ``megatron/rl`` or ``tools/checkpoint_conversion`` runs over 12 lines: it says what the
module does, what it must not do and the one fact a maintainer needs; the reasoning, formats and history live on
a page of ``docs/`` that the docstring names.

A docstring's length is its lines from the first to the last non-empty one (``ast.get_docstring`` unindented).
"""
from __future__ import annotations

import ast

from tests.conftest import REPO_ROOT

PACKAGES = (REPO_ROOT / "megatron" / "rl", REPO_ROOT / "tools" / "checkpoint_conversion")
MAX_LINES = 12


def _modules() -> list:
    return sorted(path for package in PACKAGES for path in package.rglob("*.py"))


def docstring_lengths() -> dict[str, int]:
    """``path`` -> lines of its module docstring, for every module of the packages that has one."""
    out = {}
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text()))
        if doc is not None:
            out[str(path.relative_to(REPO_ROOT))] = len(doc.strip("\n").splitlines())
    return out


def test_the_reader_finds_module_docstrings():
    lengths = docstring_lengths()
    assert len(lengths) > 100, "the scan found too few module docstrings: it is broken"
    doc = ast.get_docstring(ast.parse('"""One.\n\n    Three.\n"""\nx = 1\n'))
    assert len(doc.strip("\n").splitlines()) == 3


def test_no_module_docstring_is_over_12_lines():
    long = {k: n for k, n in docstring_lengths().items() if n > MAX_LINES}
    assert not long, (f"module docstrings over {MAX_LINES} lines (keep what the module does and must not do; move "
                      f"the reasoning to a page of docs/ and name it):\n" +
                      "\n".join(f"  {k}: {n} lines" for k, n in sorted(long.items(), key=lambda kv: -kv[1])))


def test_docs_pages_named_by_docstrings_exist():
    missing = {}
    for path in _modules():
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        for word in doc.replace(",", " ").replace(";", " ").replace(")", " ").split():
            page = word.rstrip(".:")
            if page.startswith("docs/") and page.endswith(".md") and not (REPO_ROOT / page).is_file():
                missing[str(path.relative_to(REPO_ROOT))] = page
    assert not missing, f"module docstrings name docs pages that do not exist: {missing}"
