"""TypeLookupable: pydantic models that know their registered subclass, for polymorphic JSON and YAML.

A registry root (e.g. :class:`~megatron.rl.agent.api.Agent`, :class:`~megatron.rl.base.types.Rollout`) owns a
name -> class table that subclasses join with ``@Root.register_subclass(name)``. Every instance carries its
``type_name``, so validating its JSON against the root dispatches to the subclass (nested fields too).
:meth:`TypeLookupable.unwrap` turns an object built as the base type into its registered subclass.

Examples: docs/base.md.
"""
from __future__ import annotations

import contextvars
import logging
from typing import Any, Callable, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from megatron.rl.base.registry import Registry, RegistryError

logger = logging.getLogger(__name__)

__all__ = ["TypeLookupable", "TypeLookupError"]

_T = TypeVar("_T", bound=type)

# True while pydantic validates the arguments of a direct ``Cls(...)`` call: __init__ must produce an
# instance of ``Cls`` itself, so dispatching to another class is deferred to unwrap().
_IN_INIT: contextvars.ContextVar[bool] = contextvars.ContextVar("type_lookupable_in_init", default=False)


class TypeLookupError(RegistryError):
    """Unknown or duplicate registered type name."""


class TypeLookupable(BaseModel):
    """Base of registry-backed pydantic models; see the module docstring.

    A subclass becomes a *registry root* (with its own, separate name table) by declaring
    ``_type_registry: ClassVar[dict[str, type]] = {}`` in its body (or a
    :class:`~megatron.rl.base.registry.Registry`, e.g. one with built-in names imported on first use);
    the table becomes a :class:`~megatron.rl.base.registry.Registry` with its rule for duplicate names.
    """

    # Extras are allowed so an object parsed as its base type keeps the subclass's fields until unwrap().
    model_config = ConfigDict(extra="allow", arbitrary_types_allowed=True)

    _type_registry: ClassVar[Registry[type]] = Registry("TypeLookupable type", error=TypeLookupError)

    type_name: str | None = None

    # -- registry ---------------------------------------------------------------------------------------
    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        declared = vars(cls).get("_type_registry")
        if isinstance(declared, dict):  # a new root: its name table becomes a Registry
            registry: Registry[type] = Registry(f"{cls.__name__} type", error=TypeLookupError)
            for key, sub in declared.items():
                registry.add(key, sub)
            cls._type_registry = registry
        elif isinstance(declared, Registry) and declared.error is None:
            declared.error = TypeLookupError

    @classmethod
    def _registry_owner(cls) -> type:
        for klass in cls.__mro__:
            if "_type_registry" in vars(klass):
                return klass
        return TypeLookupable  # pragma: no cover - TypeLookupable itself declares one

    @classmethod
    def register_subclass(cls, name: str | None = None) -> Callable[[_T], _T]:
        """Class decorator adding a subclass to this class's registry under ``name``.

        ``name`` defaults to the subclass's ``type_name`` field default, else its class name. Duplicate names
        follow the :class:`~megatron.rl.base.registry.Registry` rule: a different class under a taken name
        raises :class:`TypeLookupError` (re-registering the same class, e.g. when its module is re-imported,
        keeps the newest).
        """

        def deco(sub: _T) -> _T:
            if not (isinstance(sub, type) and issubclass(sub, cls)):
                raise TypeError(f"{cls.__name__}.register_subclass() decorates subclasses of {cls.__name__}, "
                                f"got {sub!r}")
            default = sub.model_fields["type_name"].default
            key = name or (default if isinstance(default, str) and default else sub.__name__)
            cls._registry_owner()._type_registry.add(key, sub)
            sub.__registered_type_name__ = key
            return sub

        return deco

    @classmethod
    def registered_types(cls) -> dict[str, type]:
        """Registered name -> class for this class's registry root (only subclasses of ``cls``)."""
        return {k: v for k, v in cls._registry_owner()._type_registry.registered().items() if issubclass(v, cls)}

    @classmethod
    def lookup(cls, name: str) -> type:
        """The registered subclass called ``name``; unknown names raise an error listing the known ones."""
        sub = cls._registry_owner()._type_registry.get(name)
        if not issubclass(sub, cls):
            raise TypeLookupError(f"type {name!r} is a {sub.__name__}, which is not a {cls.__name__}")
        return sub

    @classmethod
    def registered_name(cls) -> str | None:
        """The name this exact class was registered under (None when it is not registered)."""
        return vars(cls).get("__registered_type_name__")

    # -- polymorphic validation -------------------------------------------------------------------------
    def __init__(self, **data: Any) -> None:
        token = _IN_INIT.set(True)
        try:
            super().__init__(**data)
        finally:
            _IN_INIT.reset(token)

    @model_validator(mode="wrap")
    @classmethod
    def _dispatch_on_type_name(cls, data: Any, handler: Any) -> Any:
        in_init = _IN_INIT.get()
        _IN_INIT.set(False)  # nested fields validated below are not part of the __init__ call
        if isinstance(data, dict):
            name = data.get("type_name")
            if name is not None and not isinstance(name, str):  # JSON from a client can be anything
                raise ValueError(f"type_name must be a string, got a {type(name).__name__}")
            own = cls.registered_name()
            if name is not None and name != own:
                if in_init:
                    if own is not None:
                        raise ValueError(f"type_name={name!r} does not match {cls.__name__}, which is registered "
                                         f"as {own!r}")
                else:
                    target = cls.lookup(name)
                    if target is not cls:
                        return target.model_validate(data)
        obj = handler(data)
        if isinstance(obj, TypeLookupable):
            own = type(obj).registered_name()
            if own is not None and obj.model_extra:
                # Only an unregistered base may hold unknown fields (until unwrap()); on a registered class
                # they are typos, e.g. a misspelt agent argument in a YAML config.
                raise ValueError(f"{type(obj).__name__} ({own!r}) got unknown field(s) {sorted(obj.model_extra)}; "
                                 f"its fields are: {', '.join(sorted(type(obj).model_fields))}")
            if obj.type_name is None:
                obj.type_name = own
        return obj

    def unwrap(self) -> "TypeLookupable":
        """This object as its registered subclass (itself when it already is one).

        Fields the subclass does not declare are an error, so a typo in an argument name is not ignored.
        """
        if self.type_name is None:
            raise TypeLookupError(f"{type(self).__name__} has no type_name to unwrap; expected one of: "
                                  f"{', '.join(self.registered_types())}")
        target = type(self).lookup(self.type_name)
        if type(self) is target:
            return self
        try:
            return target.model_validate(self.model_dump(round_trip=True))
        except ValidationError as e:
            raise TypeLookupError(f"cannot unwrap into {target.__name__} ({self.type_name!r}): {e}") from None

    # Serialise fields typed as a base class with the fields of their actual (sub)class, so JSON written
    # by one process validates back into the same subclasses in another.
    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        kwargs.setdefault("serialize_as_any", True)
        return super().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        kwargs.setdefault("serialize_as_any", True)
        return super().model_dump_json(**kwargs)
