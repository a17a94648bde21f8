"""A tiny name -> function registry, filled by decorator, so flags and YAML select algorithm variants.

Each registry knows the command-line flag that selects from it, so an unknown name produces an error
that names the flag, the bad value and the valid choices.
"""
from __future__ import annotations

from typing import Callable, Generic, TypeVar

F = TypeVar("F", bound=Callable)


class Registry(Generic[F]):
    """Maps names to functions. ``@REG.register("name")`` adds one; ``REG.get("name")`` looks it up."""

    def __init__(self, kind: str, flag: str):
        self.kind = kind
        self.flag = flag
        self._entries: dict[str, F] = {}

    def register(self, name: str) -> Callable[[F], F]:
        """Decorator registering ``fn`` under ``name``; registering a name twice is a programming error."""

        def decorator(fn: F) -> F:
            if name in self._entries:
                raise ValueError(f"{self.kind} {name!r} is already registered (by {self._entries[name].__qualname__})")
            self._entries[name] = fn
            return fn

        return decorator

    def get(self, name: str) -> F:
        """The function registered as ``name``; ValueError naming the flag and the choices otherwise."""
        try:
            return self._entries[name]
        except KeyError:
            raise ValueError(f"unknown {self.kind} {name!r} (flag {self.flag}); choose one of "
                             f"{sorted(self._entries)}") from None

    def names(self) -> list[str]:
        """Registered names, sorted (use as argparse ``choices``)."""
        return sorted(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}, flag={self.flag!r}, names={self.names()})"
