"""The one name -> object registry behind every pluggable piece, filled by decorator.

Registering the same object (or the same definition re-executed) again is a no-op; a different object under a
taken name raises :class:`DuplicateNameError`. Unknown names raise :class:`UnknownNameError` naming the flag,
the value and the valid choices. ``builtins={"name": "package.module"}`` lists names whose modules are imported
on first use, so optional dependencies load only when needed.

What registers here: docs/base.md.
"""
from __future__ import annotations

import functools
import importlib
import logging
from typing import Callable, Generic, Iterator, Mapping, TypeVar

from megatron.rl.base.errors import RLError

logger = logging.getLogger(__name__)

__all__ = ["Registry", "RegistryError", "DuplicateNameError", "UnknownNameError"]

T = TypeVar("T")


class RegistryError(RLError, LookupError, ValueError):
    """A registry name problem (base of :class:`DuplicateNameError` and :class:`UnknownNameError`)."""


class DuplicateNameError(RegistryError):
    """A different object was registered under a name that is already taken."""


class UnknownNameError(RegistryError):
    """A name nothing is registered under."""


@functools.cache
def _error_class(kind: type[RegistryError], domain: type[Exception]) -> type[Exception]:
    # An error that is both the registry's kind and the owner's own exception type, so callers that
    # catch e.g. TokenizerError keep working while every registry raises DuplicateNameError.
    if issubclass(kind, domain):
        return kind
    return type(kind.__name__, (kind, domain), {"__module__": kind.__module__, "__qualname__": kind.__qualname__})


def _same_definition(a: object, b: object) -> bool:
    """True for one object, or one definition executed twice (lambdas all share a qualname, so never)."""
    if a is b:
        return True
    key_a = (getattr(a, "__module__", None), getattr(a, "__qualname__", None))
    key_b = (getattr(b, "__module__", None), getattr(b, "__qualname__", None))
    return None not in key_a and key_a == key_b and "<lambda>" not in key_a[1]


class Registry(Generic[T]):
    """Maps names to objects. ``@REG.register("name")`` adds one; ``REG.get("name")`` looks it up.

    kind: what the entries are, for messages ("policy loss"). flag: the command-line flag that selects
    from this registry, named in unknown-name errors. builtins: ``{name: module}`` imported on first use
    of ``name``. error: the owner's exception type; the errors raised are also instances of it.
    """

    def __init__(self, kind: str, flag: str | None = None, *, builtins: Mapping[str, str] | None = None,
                 error: type[Exception] | None = None):
        self.kind = kind
        self.flag = flag
        self.builtins: dict[str, str] = dict(builtins or {})
        self.error = error
        self._entries: dict[str, T] = {}

    def _raise(self, kind: type[RegistryError], message: str) -> None:
        raise (_error_class(kind, self.error) if self.error else kind)(message)

    # -- registration -----------------------------------------------------------------------------------
    def add(self, name: str, obj: T) -> T:
        """Register ``obj`` under ``name`` (the rule for duplicates is in the module docstring)."""
        existing = self._entries.get(name)
        if existing is not None and not _same_definition(existing, obj):
            self._raise(DuplicateNameError,
                        f"{self.kind} {name!r} is already registered (by {_describe(existing)}); cannot also "
                        f"register {_describe(obj)} under that name: choose another name")
        self._entries[name] = obj
        return obj

    def register(self, name: str) -> Callable[[T], T]:
        """Decorator form of :meth:`add`."""
        return functools.partial(self.add, name)

    def pop(self, name: str, *default: T) -> T:
        """Remove and return the entry (tests register temporary entries and clean up with this)."""
        return self._entries.pop(name, *default)

    # -- queries ----------------------------------------------------------------------------------------
    def get(self, name: str) -> T:
        """The object registered as ``name``, importing a built-in's module on first use.

        Raises :class:`UnknownNameError` naming the flag, the value and the choices; an ImportError of a
        built-in's module propagates (it says what is missing).
        """
        if name not in self._entries and name in self.builtins:
            importlib.import_module(self.builtins[name])
        try:
            return self._entries[name]
        except KeyError:
            flag = f" (flag {self.flag})" if self.flag else ""
            self._raise(UnknownNameError, f"unknown {self.kind} {name!r}{flag}; registered {_plural(self.kind)}: "
                                          f"{', '.join(self.names()) or '(none)'}")
            raise  # pragma: no cover - _raise always raises

    def names(self) -> list[str]:
        """Registered and built-in names, sorted (use as argparse ``choices``); imports nothing."""
        return sorted(set(self._entries) | set(self.builtins))

    def registered(self) -> dict[str, T]:
        """The entries registered so far (built-ins only once imported), sorted by name."""
        return dict(sorted(self._entries.items()))

    def load_builtins(self) -> dict[str, str]:
        """Import every built-in not yet registered; returns ``{name: error}`` for those that failed."""
        failed = {}
        for name, module in self.builtins.items():
            if name in self._entries:
                continue
            try:
                importlib.import_module(module)
            except ImportError as e:  # an optional dependency that is not installed
                failed[name] = f"{type(e).__name__}: {e}"
                logger.debug("built-in %s %r unavailable: %s", self.kind, name, e)
        return failed

    def __contains__(self, name: object) -> bool:
        """Whether ``name`` is registered now (a built-in counts once its module was imported)."""
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, flag={self.flag!r}, names={self.names()})"


def _plural(kind: str) -> str:
    """The last word of ``kind``, plural: "policy loss" -> "losses", "Agent type" -> "types"."""
    word = kind.rsplit(" ", 1)[-1]
    return word + ("es" if word.endswith("s") else "s")


def _describe(obj: object) -> str:
    if hasattr(obj, "__qualname__"):
        return f"{obj.__module__}.{obj.__qualname__}"
    return f"{type(obj).__module__}.{type(obj).__qualname__} instance"
