"""The errors megatron-rl raises on purpose, under one base.

* :class:`RLError`: every named error of the package derives from it (``except RLError`` catches them all);
  each also keeps the built-in base its callers have always caught (``ValueError``, ``RuntimeError``, ...).
* :class:`UserError`: the input is wrong (a flag, a file, a checkpoint, a tokenizer, the megatron-core
  version) and the one-line message says what to fix. The entry points (``train_rl.py``, ``pretrain_gpt.py``)
  print it without a traceback and exit with status 2.
* :class:`ConfigError`: a flag value or combination that cannot work; the message names the flag.
"""
from __future__ import annotations

__all__ = ["RLError", "UserError", "ConfigError"]


class RLError(Exception):
    """Base of every error megatron-rl raises on purpose."""


class UserError(RLError):
    """Bad input: the message names what to fix; entry points report it as one line and exit with status 2."""


class ConfigError(UserError, ValueError):
    """A flag value (or combination) that cannot work; the message names the flag and what to do."""
