"""Every change megatron-rl makes to megatron-core at run time, in one registry: what, why, which versions.

Each change is a :class:`Patch` with what it changes, why, the megatron-core versions it was written for and the
function or class that makes it; kinds by ``when``: ``cpu``, ``cuda``, ``on use``, ``per call``, ``on call``,
``subclass``. Changes are made in memory, never in site-packages, and only by ``megatron/rl/runtime/`` (a test
scans the package). A megatron-core upgrade starts here: every entry whose ``versions`` lack the new version is
to be checked.

The kinds in full: docs/runtime.md and docs/architecture.md.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Any, Callable, Iterable

from megatron.rl.runtime import versions

__all__ = ["Patch", "MCORE_0_16_1", "REGISTRY", "APPLIED", "register", "declare_subclass", "apply", "record", "entries",
           "covers_installed", "not_written_for"]

MCORE_0_16_1 = versions.MCORE_0_16  # the default of an entry: written for 0.16.1 only
WHEN = ("cpu", "cuda", "on use", "per call", "on call", "subclass")


@dataclasses.dataclass(frozen=True)
class Patch:
    """One registered change. ``changes``: the megatron-core (or torch) names it replaces, wraps or overrides;
    ``why``: what breaks or costs without it; ``versions``: the megatron-core versions it was written for;
    ``where``: our function (or class) that makes the change, ``module:qualname``."""

    name: str
    when: tuple[str, ...]
    changes: str
    why: str
    versions: tuple[str, ...]
    where: str
    apply: Callable[..., Any] | None = None


REGISTRY: dict[str, Patch] = {}
APPLIED: list[str] = []  # names applied in this process, in order (not "per call", "on call" or "subclass" entries)
_lock = threading.RLock()


def _add(patch: Patch) -> None:
    bad = [w for w in patch.when if w not in WHEN]
    if bad or not patch.when:
        raise ValueError(f"patch {patch.name!r}: when={patch.when!r}; each one of {WHEN}")
    if not (patch.changes.strip() and patch.why.strip() and patch.versions):
        raise ValueError(f"patch {patch.name!r}: say what it changes, why, and the megatron-core versions")
    if patch.name in REGISTRY:
        raise ValueError(f"duplicate patch name {patch.name!r}")
    REGISTRY[patch.name] = patch


def register(name: str, *, when: str | Iterable[str], changes: str, why: str,
             versions: tuple[str, ...] = MCORE_0_16_1) -> Callable[[Callable], Callable]:
    """Decorator registering the function that makes a change (or, ``when="per call"``, the context manager
    that makes it for one call). Registration order is application order within a kind."""
    kinds = (when,) if isinstance(when, str) else tuple(when)

    def deco(fn: Callable) -> Callable:
        _add(Patch(name, kinds, changes, why, tuple(versions), f"{fn.__module__}:{fn.__qualname__}", fn))
        return fn

    return deco


def declare_subclass(name: str, *, where: str, changes: str, why: str,
                     versions: tuple[str, ...] = MCORE_0_16_1) -> None:
    """Register a subclass of ours that overrides megatron-core internals (``where``: ``module:Class``;
    ``changes``: ``megatron.core.module:Class.member`` entries, comma-separated)."""
    _add(Patch(name, ("subclass",), changes, why, tuple(versions), where))


def apply(name: str) -> Any:
    """Apply the registered patch ``name`` once in this process (thread-safe); returns what its function
    returned the first time, None afterwards."""
    patch = REGISTRY[name]
    if patch.apply is None or {"per call", "on call"} & set(patch.when):
        raise ValueError(f"patch {name!r} ({'/'.join(patch.when)}) is not applied with apply()")
    with _lock:
        if name in APPLIED:
            return None
        result = patch.apply()
        APPLIED.append(name)
        return result


def record(name: str) -> None:
    """Note that patch ``name`` was applied by its own entry point (idempotent functions called directly)."""
    with _lock:
        if name not in APPLIED:
            APPLIED.append(name)


def entries(when: str | None = None) -> list[Patch]:
    """The registered patches (of one kind), in registration order."""
    return [p for p in REGISTRY.values() if when is None or when in p.when]


def covers_installed(name: str) -> bool:
    """Whether the registered entry ``name`` was written for the installed megatron-core (features built on an
    entry that was not are left off on that release)."""
    return versions.written_for(REGISTRY[name].versions)


def not_written_for(version: str, when: Iterable[str]) -> list[Patch]:
    """The patches of the given kinds whose ``versions`` do not include ``version``."""
    kinds = set(when)
    return [p for p in REGISTRY.values() if kinds & set(p.when) and not versions.written_for(p.versions, version)]
