"""HuggingFaceDatasetAgent: prompts and reference answers from a local dataset file.

Reads JSON lines directly, and JSON, Parquet or Arrow through ``datasets`` when installed; never from the
network. Columns are mapped by name (``prompt_field``, ``answer_field``, ``prompt_template``); rewards are
``exact``, ``contains`` or ``number``. Subclass it and override :meth:`compute_reward` for task-specific scoring.

YAML example: docs/agents.md.
"""
from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, PrivateAttr, model_validator

from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent
from megatron.rl.base.errors import RLError
from megatron.rl.agent.answers import last_number

logger = logging.getLogger(__name__)

__all__ = ["HuggingFaceDatasetAgent", "load_rows", "DatasetFileError"]

_SUFFIX_FORMAT = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}


class DatasetFileError(RLError, ValueError):
    """A dataset file is missing, unreadable, or lacks a mapped field."""


def _format_of(path: Path) -> str:
    fmt = _SUFFIX_FORMAT.get(path.suffix.lower())
    if fmt is None:
        raise DatasetFileError(f"dataset file {path}: unknown format {path.suffix!r}; use one of "
                               f"{', '.join(sorted(_SUFFIX_FORMAT))}")
    return fmt


def load_rows(path: str | Path, max_rows: int | None = None) -> list[dict[str, Any]]:
    """All rows of a local dataset file as dicts (``datasets`` if installed, else the JSONL reader)."""
    path = Path(path)
    if not path.is_file():
        raise DatasetFileError(f"dataset file {path} does not exist (absolute: {path.resolve()})")
    fmt = _format_of(path)
    datasets = None
    if path.suffix.lower() != ".jsonl":  # JSON lines are read directly: faster, and no HF cache directory
        try:
            import datasets  # optional
        except ImportError:
            pass
    if datasets is not None:
        bars = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()  # a per-file "Generating train split" bar is noise in a training log
        try:
            if fmt == "arrow":
                ds = datasets.Dataset.from_file(str(path))
            else:
                ds = datasets.load_dataset(fmt, data_files=str(path), split="train")
        except Exception as e:
            raise DatasetFileError(f"dataset file {path}: could not be read as {fmt}: {type(e).__name__}: {e}") from e
        finally:
            if bars:
                datasets.enable_progress_bars()
        n = len(ds) if max_rows is None else min(max_rows, len(ds))
        return [dict(ds[i]) for i in range(n)]
    if fmt != "json":
        raise DatasetFileError(f"dataset file {path}: reading {fmt} files needs the `datasets` package "
                               "(pip install datasets), or convert it to JSONL")
    # JSON lines (or, without `datasets`, a .json file holding JSON lines)
    rows = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise DatasetFileError(f"{path}:{lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
            if max_rows is not None and len(rows) >= max_rows:
                break
    return rows


@Agent.register_subclass("huggingface_dataset")
class HuggingFaceDatasetAgent(PassAtEvaluationAgent):
    """Prompts/answers from local files with field mapping (see the module docstring).

    data_path / validation_path: dataset files. prompt_field / answer_field / id_field: column names.
    prompt_template: ``str.format`` template over the row (default: the prompt field itself).
    chat: send ``[system?, user]`` chat messages instead of raw text. system_prompt: optional system message.
    reward_type: "exact" (stripped equality), "contains" (answer appears), "number" (last number equal).
    max_examples: only the first N rows of each file.
    """

    data_path: str
    validation_path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    id_field: str | None = None
    prompt_template: str | None = None
    chat: bool = False
    system_prompt: str | None = None
    reward_type: Literal["exact", "contains", "number"] = "exact"
    max_examples: int | None = Field(default=None, ge=1)

    _rows: dict[bool, list[dict[str, Any]]] = PrivateAttr(default_factory=dict)

    @model_validator(mode="after")
    def _check_files(self) -> "HuggingFaceDatasetAgent":
        for name in ("data_path", "validation_path"):
            value = getattr(self, name)
            if value is None:
                continue
            if not Path(value).is_file():
                raise ValueError(f"{name}: dataset file {value!r} does not exist (absolute: {Path(value).resolve()})")
            _format_of(Path(value))
        return self

    def rows(self, validation: bool) -> list[dict[str, Any]]:
        if validation not in self._rows:
            path = self.validation_path if validation and self.validation_path else self.data_path
            rows = load_rows(path, self.max_examples)
            if not rows:
                raise DatasetFileError(f"dataset file {path} has no rows")
            for field in (self.prompt_field, self.answer_field, self.id_field):
                if field is not None and field not in rows[0]:
                    raise DatasetFileError(f"dataset file {path} has no field {field!r}; its fields are: "
                                           f"{', '.join(sorted(rows[0]))} (set prompt_field/answer_field/id_field)")
            self._rows[validation] = rows
        return self._rows[validation]

    def dataset_size(self, validation: bool) -> int | None:
        return len(self.rows(validation))

    def get_problem(self, index: int, validation: bool) -> dict[str, Any]:
        row = self.rows(validation)[index]
        problem = dict(row)
        problem["prompt"] = (self.prompt_template.format(**row) if self.prompt_template
                             else str(row[self.prompt_field]))
        problem["answer"] = row[self.answer_field]
        problem["id"] = str(row[self.id_field]) if self.id_field else f"{'val' if validation else 'train'}-{index}"
        return problem

    def make_prompt(self, problem: dict[str, Any]) -> str | list[dict[str, str]]:
        if not self.chat:
            return problem["prompt"]
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return messages + [{"role": "user", "content": problem["prompt"]}]

    def compute_reward(self, problem: dict[str, Any], completion: str) -> float:
        answer = str(problem["answer"]).strip()
        if self.reward_type == "exact":
            return float(completion.strip() == answer)
        if self.reward_type == "contains":
            return float(answer in completion)
        got = last_number(completion)
        want = last_number(answer)
        if got is None or want is None:
            return 0.0
        try:
            return float(float(got) == float(want))
        except ValueError:
            return 0.0
