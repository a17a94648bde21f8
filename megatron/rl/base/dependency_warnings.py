"""Known warnings of our dependencies, said once in one line instead of a screenful on every start.

megatron-core's "Apex / Transformer Engine not installed" notices are summarised in one INFO line; known
deprecation notices of megatron-core and torch are logged at DEBUG only (:func:`is_known_notice`). Must not:
hide any other warning. :func:`summarize_dependency_warnings` installs the filter (idempotent).

The list and the reasons: docs/base.md.
"""
from __future__ import annotations

import logging
import re
import warnings

__all__ = ["summarize_dependency_warnings", "MISSING_KERNELS_NOTE", "classify", "is_known_notice"]

logger = logging.getLogger("megatron.rl.dependencies")

MISSING_KERNELS_NOTE = (
    "Apex and TransformerEngine are not installed: megatron-core uses torch for fused norms, Adam and multi-tensor "
    "ops (same results; slower on GPU, no difference on CPU). On GPU: pip install transformer-engine (and apex) "
    "for speed.")

_MISSING = re.compile(r"\b(Apex|Transformer Engine and Apex) (is|are) not installed")
_INTERNAL = re.compile(r"full scope is deprecated|deprecating ShardedTensor|`load_state_dict` is deprecated|"
                       r"custom_layers\.transformer_engine.*deprecated|GPTModel IS DEPRECATED|"
                       r"MimoModelConfig is experimental|MCore's async save is deprecated|"
                       r"load_common is deprecated|assuming the intent is to load in a single process|"
                       r"The argument order of load has been changed", re.S)

_state = {"installed": False, "noted": False}


def classify(message: str) -> str | None:
    """``"missing"`` (Apex/TransformerEngine fallbacks), ``"internal"`` (a dependency's own deprecation) or None
    (not a known warning: shown as usual). Pure."""
    if _MISSING.search(message):
        return "missing"
    if _INTERNAL.search(message):
        return "internal"
    return None


def is_known_notice(record: logging.LogRecord) -> bool:
    """Whether a megatron-core log record is one of the known notices of :func:`classify` (shown at DEBUG only)."""
    return record.name.startswith("megatron.core") and classify(record.getMessage()) == "internal"


def summarize_dependency_warnings() -> None:
    """Route the known warnings through :func:`classify` from now on (idempotent, process-wide)."""
    if _state["installed"]:
        return
    _state["installed"] = True
    shown = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        kind = classify(str(message))
        if kind is None:
            return shown(message, category, filename, lineno, file, line)
        if kind == "missing" and not _state["noted"]:
            _state["noted"] = True
            logger.info(MISSING_KERNELS_NOTE)
        logger.debug("%s: %s (%s:%s)", category.__name__, message, filename, lineno)
        return None

    warnings.showwarning = showwarning
