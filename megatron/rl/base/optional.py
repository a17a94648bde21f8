"""Optional dependencies: import one, or fail with one line naming the pip extra that installs it."""
from __future__ import annotations

import importlib
from types import ModuleType

from megatron.rl.base.errors import RLError

__all__ = ["MissingExtraError", "import_optional"]


class MissingExtraError(RLError, ImportError):
    """An optional package a feature needs is not installed; the message names the extra to install."""


def import_optional(module: str, extra: str, feature: str) -> ModuleType:
    """``import module``, or raise :class:`MissingExtraError`: "<feature> needs <module>: pip install
    'megatron-rl[<extra>]'". An ImportError from inside an installed package says what it is instead."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        missing = getattr(e, "name", None)
        if missing is not None and missing != module and not module.startswith(missing + "."):
            raise MissingExtraError(f"{feature} needs {module!r}, which is installed but cannot be imported "
                                    f"({type(e).__name__}: {e}); reinstall it: pip install 'megatron-rl[{extra}]'") from e
        raise MissingExtraError(f"{feature} needs the {module.split('.')[0]!r} package, which is not installed: "
                                f"pip install 'megatron-rl[{extra}]'") from e
