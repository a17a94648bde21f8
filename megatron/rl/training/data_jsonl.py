"""Reading JSONL text corpora: one JSON object per line, the document text under a configurable key.

Shared by the training data pipeline (:mod:`megatron.rl.training.data`, which tokenizes small JSONL files
in memory) and ``tools/preprocess_data.py`` (which writes Megatron ``.bin/.idx`` files for large ones), so
both read and tokenize documents identically: ``tokenizer.tokenize(text) + [tokenizer.eod]``.
"""
from __future__ import annotations

import json
from typing import Iterator, List, Tuple

from megatron.rl.base.errors import RLError

__all__ = ["JsonlFormatError", "parse_jsonl_line", "iter_jsonl_texts", "tokenize_document"]


class JsonlFormatError(RLError, ValueError):
    """A JSONL line that is not a JSON object with a string under the text key (names file and line)."""


def parse_jsonl_line(line: str, key: str, path: str, line_no: int) -> str | None:
    """Return the text under ``key`` in one JSONL line, or None for a blank line.

    Raises:
        JsonlFormatError: naming ``path:line_no`` when the line is not JSON, not an object, lacks ``key``,
            or its value is not a string.
    """
    if not line.strip():
        return None
    where = f"{path}:{line_no}"
    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise JsonlFormatError(f"{where}: not valid JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(record, dict):
        raise JsonlFormatError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if key not in record:
        raise JsonlFormatError(
            f"{where}: no {key!r} field (fields present: {sorted(record)}); choose the text field with the "
            "json key option (--json-keys for tools/preprocess_data.py)"
        )
    text = record[key]
    if not isinstance(text, str):
        raise JsonlFormatError(f"{where}: field {key!r} must be a string, got {type(text).__name__}")
    return text


def iter_jsonl_texts(path: str, key: str = "text") -> Iterator[Tuple[int, str]]:
    """Yield ``(line_number, text)`` for every non-blank line of the JSONL file ``path`` (1-based lines)."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            text = parse_jsonl_line(line, key, path, line_no)
            if text is not None:
                yield line_no, text


def tokenize_document(tokenizer, text: str, append_eod: bool = True) -> List[int]:
    """Token ids of one document: ``tokenizer.tokenize(text)`` followed by ``tokenizer.eod``."""
    ids = list(tokenizer.tokenize(text))
    if append_eod:
        ids.append(tokenizer.eod)
    return ids
