"""The run flags a checkpoint carries beside its model flags, and their return under ``--use-checkpoint-args``.

A trainer names the flags that shape what it generates and trains on; :func:`record_run_flags` stores them as
``model_args["run_flags"]`` with the content hash of any file a flag names. :func:`run_flags_argv` adds every
stored flag the command line does not give: an explicit flag always wins. A stored file that is gone is a
ConfigError; a changed one is used with a warning.

Record format: docs/training.md.
"""
from __future__ import annotations

import argparse
import hashlib
import logging
import os
from typing import Any, Iterable, Mapping

from megatron.rl.base.errors import ConfigError

log = logging.getLogger(__name__)

__all__ = ["RUN_FLAGS_KEY", "record_run_flags", "file_sha256", "run_flags_argv"]

RUN_FLAGS_KEY = "run_flags"  # the key under the checkpoint's model_args


def file_sha256(path: str | os.PathLike) -> str:
    """Hex SHA-256 of the file's bytes."""
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def record_run_flags(values: Mapping[str, Any], files: Iterable[str] = ()) -> dict[str, Any]:
    """The record stored in checkpoints: ``values`` (argparse destination -> value, JSON-able) with each
    destination in ``files`` made an absolute path and its content hashed (a file that does not exist is stored
    without a hash)."""
    flags = {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}
    digests: dict[str, str] = {}
    for dest in files:
        path = flags.get(dest)
        if path is None:
            continue
        flags[dest] = os.path.abspath(path)
        if os.path.isfile(path):
            digests[dest] = file_sha256(path)
    return {"flags": flags, "sha256": digests}


def _option(dest: str, actions: Mapping[str, argparse.Action]) -> str:
    return actions[dest].option_strings[0]


def _check_file(dest: str, path: str, digest: str, option: str, source: str) -> None:
    if not os.path.isfile(path):
        raise ConfigError(f"--use-checkpoint-args: the checkpoint in {source} was trained with {option}={path}, "
                          f"which no longer exists; pass {option} FILE (the same content, moved) or restore it.")
    now = file_sha256(path)
    if now != digest:
        log.warning("--use-checkpoint-args: %s=%s changed since the checkpoint in %s was saved (sha256 %s then, "
                    "%s now); using it as it is now", option, path, source, digest[:12], now[:12])


def run_flags_argv(record: Mapping[str, Any] | None, parser: argparse.ArgumentParser, explicit: set[str],
                   source: str) -> list[list[str]]:
    """The stored run flags as command-line flags, one ``[option, values...]`` list per flag, for every flag
    ``parser`` knows that ``explicit`` (the destinations the command line gave) does not hold. ``source``
    (``"--load=DIR"``) names the checkpoint in messages. Checks the stored files (see the module docstring)."""
    if not record:
        return []
    actions = {a.dest: a for a in parser._actions if a.option_strings}  # noqa: SLF001 - argparse has no public API
    out: list[list[str]] = []
    for dest, value in record.get("flags", {}).items():
        if dest in explicit or dest not in actions or value is None:
            continue
        digest = record.get("sha256", {}).get(dest)
        if digest is not None:
            _check_file(dest, value, digest, _option(dest, actions), source)
        action = actions[dest]
        if isinstance(action, argparse._StoreTrueAction):  # noqa: SLF001
            if value:
                out.append([_option(dest, actions)])
        elif isinstance(value, list):
            out.append([_option(dest, actions), *map(str, value)])
        else:
            out.append([_option(dest, actions), str(value)])
    return out
