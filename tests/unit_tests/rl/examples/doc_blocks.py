"""The code blocks of README.md, examples/rl/README.md and docs/architecture.md, by the marker in the HTML
comment before each one.

- ``<!-- file: NAME -->``: written to NAME (a module or config the page's commands use);
- ``<!-- run: GROUP -->``: run, in page order, by one ``bash`` per group (a ``python`` block is fed to ``python -``);
- ``<!-- excerpt -->``: shown, not runnable as written (placeholders, cluster launches); its first line says so
  to the reader (``# excerpt: ...``);
- ``<!-- text -->``: output or a listing, nothing to run.

The comments do not render; every block of the three pages carries one (a test checks), and every run group is
run by a test of this folder.
"""
from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT

PAGES = (REPO_ROOT / "README.md", REPO_ROOT / "examples/rl/README.md", REPO_ROOT / "docs/architecture.md")
_MARKED = re.compile(r"<!-- (file|run|excerpt|text)(?:: ([\w.-]+))? -->\n```(\w*)\n(.*?)^```", re.S | re.M)
_FENCE = re.compile(r"^```", re.M)


@dataclasses.dataclass(frozen=True)
class Block:
    kind: str       # file, run, excerpt, text
    name: str       # the file name or run group ("" for excerpt and text)
    language: str   # bash, python, yaml, ... ("" when the fence names none)
    body: str


def blocks(page: Path) -> list[Block]:
    """The marked blocks of ``page`` in order."""
    return [Block(kind, name or "", lang, body) for kind, name, lang, body in _MARKED.findall(page.read_text())]


def fence_count(page: Path) -> int:
    """How many code blocks ``page`` has (marked or not)."""
    return len(_FENCE.findall(page.read_text())) // 2


def group(page: Path, name: str) -> list[Block]:
    return [b for b in blocks(page) if b.kind == "run" and b.name == name]


def script(run_blocks: list[Block]) -> str:
    """One bash script running the blocks in order; background jobs a failing block leaves are killed."""
    parts = ["set -euo pipefail", "trap 'kill $(jobs -p) 2>/dev/null || true' EXIT"]
    for b in run_blocks:
        parts.append(f"python - <<'PY_BLOCK'\n{b.body}PY_BLOCK" if b.language == "python" else b.body)
    return "\n".join(parts) + "\n"


def run_group(run_blocks: list[Block], cwd: Path, env: dict | None = None, timeout: int = 1800):
    """Run the blocks in ``cwd`` with this interpreter first on PATH; returns the CompletedProcess."""
    path = cwd / "blocks.sh"
    path.write_text(script(run_blocks))
    full = {**os.environ, "OMP_NUM_THREADS": "1",
            "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}", **(env or {})}
    full.pop("PYTHONPATH", None)
    return subprocess.run(["bash", str(path)], cwd=cwd, env=full, capture_output=True, text=True, timeout=timeout)
