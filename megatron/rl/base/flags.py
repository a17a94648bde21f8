"""Command-line flags declared once, in dataclass field metadata; argparse parsers are generated from them.

:func:`flag`, :func:`section` and :func:`derived` mark a config dataclass's fields; :func:`add_flags` adds its
flags to a parser (option, destination, type, choices and --help text all follow from the field) and
:func:`from_namespace` builds the dataclass from the parsed namespace. ``choices`` may be a callable such as
:func:`registry_choices`, so choices come from a registry. A config's ``_removed_flags`` names the replacement of
a flag scripts may still pass. This module validates no values: the module that owns a config does. How to add a
flag, with an example: docs/architecture.md, "Adding a flag".
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from typing import Any, Callable, Iterator, Sequence

from megatron.rl.base.errors import ConfigError

__all__ = ["flag", "derived", "section", "registry_choices", "add_flags", "from_namespace", "flag_fields",
           "FlagField", "dest_of", "option_of", "refuse_removed_flags"]

_FLAG, _DERIVED, _SECTION = "flag", "derived", "section"
REMOVED_FLAGS = "megatron_rl_removed_flags"  # the parser attribute holding the configs' _removed_flags


def flag(default: Any = dataclasses.MISSING, *, name: str | None = None,
         help: str | Callable[[], str] | None = None,  # noqa: A002
         choices: Sequence | Callable[[], Sequence] | None = None, nargs: str | int | None = None,
         metavar: str | None = None, group: str | None = None) -> Any:
    """A dataclass field that is also a command-line flag (see the module docstring)."""
    meta = {"kind": _FLAG, "name": name, "help": help, "choices": choices, "nargs": nargs, "metavar": metavar,
            "group": group}
    return dataclasses.field(default=default, metadata={_FLAG: meta})


def derived(default: Any = None, *, default_factory: Callable[[], Any] | None = None) -> Any:
    """A field computed from other flags (or by the parser itself) when the config is resolved; no flag."""
    if default_factory is not None:
        return dataclasses.field(default_factory=default_factory, metadata={_FLAG: {"kind": _DERIVED}})
    return dataclasses.field(default=default, metadata={_FLAG: {"kind": _DERIVED}})


def section(cls: type) -> Any:
    """A nested config dataclass whose own fields are flags (defaults: ``cls()``)."""
    return dataclasses.field(default_factory=cls, metadata={_FLAG: {"kind": _SECTION, "cls": cls}})


def registry_choices(registry: Any) -> Callable[[], list[str]]:
    """Argparse choices read from a registry when the parser is built (plugins registered by then count).

    The one place that knows the registries' API: their public ``names()``.
    """
    return lambda: list(registry.names())


@dataclasses.dataclass(frozen=True)
class FlagField:
    """One flag: the dataclass and field declaring it, and its option string."""

    owner: type
    field: dataclasses.Field
    option: str

    @property
    def dest(self) -> str:
        return self.option.lstrip("-").replace("-", "_")


def _meta(f: dataclasses.Field) -> dict | None:
    return f.metadata.get(_FLAG)


def option_of(f: dataclasses.Field) -> str:
    meta = _meta(f) or {}
    return meta.get("name") or "--" + f.name.replace("_", "-")


def dest_of(f: dataclasses.Field) -> str:
    return option_of(f).lstrip("-").replace("-", "_")


def flag_fields(cls: type, *, with_derived: bool = False) -> Iterator[tuple[type, dataclasses.Field, str]]:
    """Every field of ``cls`` and its nested sections as ``(owner class, field, kind)``; ``kind`` is ``"flag"``,
    ``"derived"`` or ``""`` (a field declared without flag metadata: a mistake the tests look for)."""
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        kind = meta["kind"] if meta else ""
        if kind == _SECTION:
            yield from flag_fields(meta["cls"], with_derived=with_derived)
        elif kind != _DERIVED or with_derived:
            yield cls, f, kind


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _unwrap(annotation: Any) -> tuple[Any, Any]:
    """(base type, container) of an annotation: ``int | None`` -> (int, None); ``list[str]`` -> (str, list)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        return _unwrap(args[0])
    if origin in (list, tuple):
        return typing.get_args(annotation)[0], origin
    return annotation, None


def _argparse_kwargs(cls: type, f: dataclasses.Field) -> dict:
    meta = _meta(f)
    base, container = _unwrap(_hints(cls)[f.name])
    kw: dict[str, Any] = {"dest": dest_of(f)}
    if f.default is dataclasses.MISSING:
        kw["required"] = True
    else:
        kw["default"] = f.default
    if base is bool:
        kw["action"] = "store_true"
    else:
        kw["type"] = base
        if container is not None:
            kw["nargs"] = meta["nargs"] or "+"
        elif meta["nargs"] is not None:
            kw["nargs"] = meta["nargs"]
    choices = meta["choices"]
    if choices is not None:
        kw["choices"] = list(choices() if callable(choices) else choices)
    for key in ("help", "metavar"):
        if meta[key] is not None:  # help may be a callable, like choices: text that lists a registry's entries
            kw[key] = meta[key]() if callable(meta[key]) else meta[key]
    return kw


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str | None = None) -> argparse.ArgumentParser:
    """Add the flags of ``cls`` (and of its nested sections) to ``parser``, one argument group per section, and
    note their ``_removed_flags`` (see the module docstring and :func:`refuse_removed_flags`)."""
    groups: dict[str, Any] = {}
    removed = dict(getattr(parser, REMOVED_FLAGS, {}))

    def group(name: str):
        if name not in groups:
            groups[name] = parser.add_argument_group(name)
        return groups[name]

    def walk(c: type, default_title: str) -> None:
        default_title = getattr(c, "_flag_group", None) or default_title
        removed.update(getattr(c, "_removed_flags", {}))
        for f in dataclasses.fields(c):
            meta = _meta(f)
            if meta is None or meta["kind"] == _DERIVED:
                continue
            if meta["kind"] == _SECTION:
                walk(meta["cls"], default_title)
                continue
            group(meta["group"] or default_title).add_argument(option_of(f), **_argparse_kwargs(c, f))

    walk(cls, title or cls.__name__)
    setattr(parser, REMOVED_FLAGS, removed)
    return parser


def refuse_removed_flags(parser: argparse.ArgumentParser, argv: Sequence[str]) -> None:
    """ConfigError naming the replacement of the first flag in ``argv`` that a config of ``parser`` lists in its
    ``_removed_flags`` (they are not parser options: ``--help`` does not show them)."""
    removed = getattr(parser, REMOVED_FLAGS, {})
    for arg in argv:
        option = arg.split("=", 1)[0]
        if option in removed:
            raise ConfigError(f"{option} is not a flag of this version: use {removed[option]}.")


def from_namespace(cls: type, ns: argparse.Namespace, **derived_values: Any) -> Any:
    """``cls`` (frozen dataclass) built from the parsed flags in ``ns``; ``derived_values`` fills derived fields
    of ``cls`` itself (derived fields of nested sections keep their defaults; resolve them with
    ``dataclasses.replace``)."""
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        meta = _meta(f)
        if meta is None:
            raise TypeError(f"{cls.__name__}.{f.name} has no flag metadata: declare it with flag(), derived() "
                            f"or section() (megatron.rl.base.flags)")
        if meta["kind"] == _SECTION:
            kw[f.name] = from_namespace(meta["cls"], ns)
        elif meta["kind"] == _DERIVED:
            if f.name in derived_values:
                kw[f.name] = derived_values[f.name]
        else:
            value = getattr(ns, dest_of(f))
            if isinstance(value, list) and _unwrap(_hints(cls)[f.name])[1] is tuple:
                value = tuple(value)
            kw[f.name] = value
    return cls(**kw)


def dests(cls: type) -> set[str]:
    """Argparse destinations of every flag of ``cls`` and its sections."""
    return {dest_of(f) for _, f, _ in flag_fields(cls)}
