"""Secrets in configuration: read from the environment or a file, and never described back.

* **Names.** A key is secret when one of its ``_``/``-``-separated parts is ``key``, ``token``, ``secret``,
  ``password``, ``passwd``, ``apikey`` or ``credential(s)`` (``api_key``, ``auth_token``, ``client_secret``);
  ``max_tokens`` and ``tokenizer`` are not.
* **Sources** (:func:`resolve_secrets`). Instead of ``api_key: sk-...`` in a YAML file, write
  ``api_key_env: JUDGE_API_KEY`` (the variable's value is used) or ``api_key_file: /run/secrets/judge``
  (the file's text, trailing newline removed). The names of the variable and the file are what configuration
  dumps show; the secret itself is resolved only when the backend is built.
* **Redaction** (:func:`redact`). Every response that describes configuration passes it through here: the
  value of every secret-named key becomes ``"<redacted>"``, at any depth.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

from megatron.rl.base.errors import ConfigError

__all__ = ["REDACTED", "is_secret_name", "redact", "resolve_secrets"]

REDACTED = "<redacted>"
_SECRET_PARTS = frozenset({"key", "token", "secret", "password", "passwd", "apikey", "credential", "credentials"})
_SOURCE_SUFFIXES = ("_env", "_file")


def _parts(name: str) -> list[str]:
    spaced = re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", name)  # apiKey -> api_Key
    return [p for p in re.split(r"[_\-.\s]+", spaced.lower()) if p]


def is_secret_name(name: str) -> bool:
    """True when ``name`` names a secret value (not ``<secret>_env`` / ``<secret>_file``, which name its source)."""
    parts = _parts(name)
    if parts and parts[-1] in ("env", "file"):
        return False
    return any(p in _SECRET_PARTS for p in parts)


def redact(obj: Any) -> Any:
    """A copy of ``obj`` (JSON-like: dicts, lists, scalars) with every secret-named key's value replaced."""
    if isinstance(obj, dict):
        return {k: (REDACTED if isinstance(k, str) and is_secret_name(k) and obj[k] not in (None, "")
                    else redact(v)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v) for v in obj]
    return obj


def _read_source(key: str, source: str, where: str) -> str:
    if key.endswith("_env"):
        value = os.environ.get(source)
        if not value:
            raise ConfigError(f"{where}{key}: environment variable ${source} is unset or empty; export it or "
                              f"give {key[:-4]}_file")
        return value
    try:
        return Path(source).read_text().rstrip("\r\n")
    except OSError as e:
        raise ConfigError(f"{where}{key}: cannot read {source!r} ({e.strerror}); check the path") from None


def resolve_secrets(kwargs: dict[str, Any], where: str = "") -> dict[str, Any]:
    """``kwargs`` with every ``<secret>_env`` / ``<secret>_file`` replaced by ``<secret>`` read from its source.

    where: a prefix for error messages (e.g. ``"judge.inference.kwargs."``). Giving a secret both directly and
    through a source, or through both sources, is an error naming the keys.
    """
    out = dict(kwargs)
    for key in list(kwargs):
        if not isinstance(key, str) or not key.endswith(_SOURCE_SUFFIXES):
            continue
        name = key[: -len("_env")] if key.endswith("_env") else key[: -len("_file")]
        if not is_secret_name(name):
            continue
        given = [k for k in (name, f"{name}_env", f"{name}_file") if kwargs.get(k) not in (None, "")]
        if len(given) > 1:
            raise ConfigError(f"{where}{name}: given as {' and '.join(given)}; give exactly one")
        source = out.pop(key)
        if source in (None, ""):
            continue
        if not isinstance(source, str):
            raise ConfigError(f"{where}{key}: expected the name of an environment variable or a file, got "
                              f"{type(source).__name__}")
        out[name] = _read_source(key, source, where)
    return out
