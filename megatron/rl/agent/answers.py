"""Answer extraction shared by the built-in environments, the reasoning-gym adapter and the dataset agent.

It sits beside the agents because the environments build on them (never the other way round).

The answer is what the model committed to, never a string found somewhere in the completion (that is gamed by
constant completions). :func:`committed_text` is the completion up to its first stop string; an answer format
(``text``, ``number``, ``tag`` or a regular expression matching the whole committed text) says what it must be.
:func:`committed_answer` is the one matching step every user goes through. GSM8K / MATH answers:
:mod:`megatron.rl.environments.math_answers`.

Formats and reasons: docs/environments.md.
"""
from __future__ import annotations

import re
from typing import Literal, Sequence

__all__ = ["AnswerFormat", "ANSWER_FORMATS", "NUMBER", "committed_text", "committed_answer", "last_tag",
           "last_number", "extract_answer"]

AnswerFormat = Literal["text", "number", "tag"]
ANSWER_FORMATS: tuple[str, ...] = ("text", "number", "tag")
NUMBER = re.compile(r"[-+]?\d{1,3}(?:,\d{3})+(?:\.\d+)?|[-+]?\d{1,60}(?:\.\d+)?")
_ANY = re.compile(r"(?s).*")
_TAG = re.compile(r"<answer>(.{0,400}?)</answer>", re.DOTALL)
_TAG_SCAN_CHARS = 10_000  # a longer completion's tail is not read for tags (bounded work on hostile text)
_LAST_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")


def committed_text(completion: str, stop: Sequence[str] = ()) -> str:
    """``completion`` up to the earliest occurrence of any of ``stop`` (all of it without one)."""
    end = len(completion)
    for s in stop:
        if s:
            i = completion.find(s, 0, end)
            if i >= 0:
                end = i
    return completion[:end]


def committed_answer(completion: str, pattern: re.Pattern, stop: Sequence[str] = (), *, strip: bool = True,
                     max_chars: int | None = None) -> str | None:
    """The answer ``pattern`` finds in the committed text, matching all of it (group 1, else the whole match,
    stripped); None when it does not match or the committed text is longer than ``max_chars``. ``strip``:
    trim whitespace around the committed text before matching (off: the pattern says which spaces it allows)."""
    text = committed_text(completion, stop)
    if max_chars is not None and len(text) > max_chars:
        return None
    m = pattern.fullmatch(text.strip() if strip else text)
    if m is None:
        return None
    found = m.group(1) if pattern.groups else m.group(0)
    return None if found is None else found.strip()


def last_tag(completion: str) -> str | None:
    """The stripped content of the last ``<answer>...</answer>`` (up to 400 characters) in the first
    10,000 characters of ``completion``, or None."""
    tags = _TAG.findall(completion[:_TAG_SCAN_CHARS])
    return tags[-1].strip() if tags else None


def last_number(text: str) -> str | None:
    """The last number in the last 2,000 characters of ``text`` (thousands commas dropped), or None: the
    convention of free-form answers that end with their result (a dataset's reference answer, too)."""
    found = _LAST_NUMBER.findall(text[-2000:])
    return found[-1].replace(",", "") if found else None


def extract_answer(completion: str, answer_format: str = "text", pattern: re.Pattern | None = None,
                   stop: Sequence[str] = ()) -> str | None:
    """The answer the completion committed to (see the module docstring): by ``pattern`` when given, else by
    ``answer_format``; None when the completion does not have the required form."""
    if pattern is not None:
        return committed_answer(completion, pattern, stop)
    if answer_format == "text":
        return committed_answer(completion, _ANY, stop)
    if answer_format == "number":
        return committed_answer(completion, NUMBER, stop)
    if answer_format == "tag":
        return last_tag(completion)
    raise ValueError(f"answer format {answer_format!r}: choose one of {ANSWER_FORMATS}")
