"""The environment config file (``--langrl-env-config FILE.yaml``) and the agent it builds.

A list of entries (``type``, ``args``, ``weight``, ``evaluation_only``, ``name``), or a mapping with
``environments`` and ``imports``. Importing user code (``imports``, ``module:Class`` types) needs
``--langrl-allow-imports``. Every error names the file, the entry index and the key; YAML aliases are refused.
Relative ``*_path`` arguments resolve against the YAML file's directory.

Format and reasons: docs/agents.md.
"""
from __future__ import annotations

import importlib
import logging
import re
import reprlib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from megatron.rl.agent.api import BUILTIN_AGENT_MODULES, Agent
from megatron.rl.base.type_lookupable import TypeLookupError
from megatron.rl.agent.weighted_multi_task import TaskEntry, WeightedMultiTaskAgent
from megatron.rl.base.errors import UserError

logger = logging.getLogger(__name__)

__all__ = ["EnvConfigError", "load_env_config", "import_env_config_modules", "build_agent_from_config", "import_builtin_agents",
           "resolve_agent_type", "add_env_config_args", "BUILTIN_AGENT_MODULES", "DEFAULT_ENV_CONFIG"]

# The embedded default task (relative to the repository root).
DEFAULT_ENV_CONFIG = "examples/rl/environment_configs/arithmetic.yaml"

_ENTRY_KEYS = ("type", "args", "weight", "evaluation_only", "name")
_WEIGHT_HINT = " (a string: write a plain number such as 0.5 or 1e-3, without quotes)"
_IMPORT_HINT = "pass allow_imports=True (train_rl.py: --langrl-allow-imports) to allow importing user code"


class EnvConfigError(UserError, ValueError):
    """An invalid environment config; the message names the file, entry and key."""


#: An environment config names environments and their arguments (a few KB); data belongs in the files its agents
#: read. Larger files are refused before they are read whole.
MAX_ENV_CONFIG_BYTES = 4 << 20
#: Nesting deeper than this is refused (the YAML composer recurses once per level).
MAX_ENV_CONFIG_DEPTH = 64


class _EnvConfigLoader(yaml.SafeLoader):
    """SafeLoader that refuses aliases and nesting deeper than :data:`MAX_ENV_CONFIG_DEPTH`, and reads ``1e-3`` as a
    float."""

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise yaml.composer.ComposerError(
                None, None, f"alias *{event.anchor} is not allowed in an environment config (aliases can expand "
                            f"exponentially); write the value out", event.start_mark)
        if self._depth >= MAX_ENV_CONFIG_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"nested more than {MAX_ENV_CONFIG_DEPTH} levels deep", self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


_EnvConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))

_SHORT = reprlib.Repr()
_SHORT.maxstring, _SHORT.maxother, _SHORT.maxlevel = 80, 80, 3


def _short(value: Any) -> str:
    """A bounded repr for error messages (a config value may be huge)."""
    return _SHORT.repr(value)


def import_builtin_agents() -> dict[str, str]:
    """Import the built-in agent modules; returns ``{type: error}`` for those that could not be imported."""
    return Agent._type_registry.load_builtins()


def _import_module(name: str, where: str) -> Any:
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise EnvConfigError(f"{where}: cannot import module {name!r}: {e}") from e


def resolve_agent_type(type_name: str, allow_imports: bool = False, where: str = "agent type") -> type[Agent]:
    """The agent class for a registered name or (with ``allow_imports``) a ``module:Class`` path."""
    if ":" in type_name:
        if not allow_imports:
            raise EnvConfigError(f"{where}: {_short(type_name)} is an import path; {_IMPORT_HINT}")
        module_name, _, attr = type_name.partition(":")
        obj = getattr(_import_module(module_name, where), attr, None)
        if not (isinstance(obj, type) and issubclass(obj, Agent)):
            raise EnvConfigError(f"{where}: {_short(type_name)} is not an Agent subclass (got {_short(obj)})")
        return obj
    if type_name not in Agent._type_registry:
        failed = import_builtin_agents()
        if type_name in failed:
            raise EnvConfigError(f"{where}: built-in agent {_short(type_name)} could not be imported: "
                                 f"{failed[type_name]}")
    try:
        return Agent.lookup(type_name)
    except TypeLookupError as e:
        raise EnvConfigError(f"{where}: {e}") from None


def _load_yaml(path: Path) -> Any:
    if not path.is_file():
        raise EnvConfigError(f"environment config {path} does not exist (absolute: {path.resolve()})")
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_ENV_CONFIG_BYTES + 1)
    except OSError as e:
        raise EnvConfigError(f"environment config {path} cannot be read: {e.strerror or e}") from None
    if len(raw) > MAX_ENV_CONFIG_BYTES:
        raise EnvConfigError(f"environment config {path} is larger than {MAX_ENV_CONFIG_BYTES >> 20} MiB: it should "
                             f"name environments and their arguments; put data in files the agents read")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise EnvConfigError(f"environment config {path} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset "
                             f"{e.start})") from None
    try:
        return yaml.load(text, Loader=_EnvConfigLoader)  # noqa: S506 - safe subclass
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise EnvConfigError(f"{where}: invalid YAML: {problem}") from None


def _resolve_paths(args: dict[str, Any], base: Path | None) -> dict[str, Any]:
    if base is None:
        return args
    out = dict(args)
    for key, value in args.items():
        if key.endswith("_path") and isinstance(value, str) and value and not Path(value).is_absolute():
            candidate = base / value
            if candidate.exists() or not Path(value).exists():
                out[key] = str(candidate)
    return out


def _format_validation(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def _read_config(config: str | Path | dict | list) -> tuple[Any, str, Path | None]:
    """(data, where it came from for messages, the directory relative ``*_path`` arguments resolve against)."""
    if isinstance(config, (str, Path)):
        path = Path(config)
        return _load_yaml(path), str(path), path.resolve().parent
    return config, "<env config>", None


def _split_imports(data: Any, src: str) -> tuple[list, list[str]]:
    """(the environment entries, the modules listed under ``imports``), checking the top-level shape."""
    imports: list[str] = []
    if isinstance(data, dict):
        unknown = sorted(set(data) - {"environments", "imports"})
        if unknown:
            raise EnvConfigError(f"{src}: unknown top-level key(s) {_short(unknown)}; expected 'environments' and "
                                 "optionally 'imports'")
        imports = data.get("imports") or []
        if not isinstance(imports, list) or not all(isinstance(m, str) for m in imports):
            raise EnvConfigError(f"{src}: key 'imports' must be a list of module names, got {_short(imports)}")
        data = data.get("environments")
    if not isinstance(data, list) or not data:
        raise EnvConfigError(f"{src}: expected a non-empty list of environments (or a mapping with an "
                             f"'environments' list), got {type(data).__name__}")
    return data, imports


def _run_imports(imports: list[str], src: str, allow_imports: bool) -> None:
    if imports and not allow_imports:
        raise EnvConfigError(f"{src}: key 'imports' lists {_short(imports)}; {_IMPORT_HINT}")
    for module in imports:
        _import_module(module, f"{src}: key 'imports'")


def import_env_config_modules(config: str | Path | dict | list, allow_imports: bool = False) -> list[str]:
    """Import the modules the config lists under ``imports`` (what they register by decorator, agents or inference
    backends, can then be named); returns them. Errors are :func:`load_env_config`'s."""
    data, src, _ = _read_config(config)
    _, imports = _split_imports(data, src)
    _run_imports(imports, src, allow_imports)
    return imports


def load_env_config(config: str | Path | dict | list, allow_imports: bool = False) -> list[TaskEntry]:
    """Parse and validate a config (a YAML file path, or the already-loaded data) into task entries."""
    data, src, base = _read_config(config)
    data, imports = _split_imports(data, src)
    _run_imports(imports, src, allow_imports)
    type_counts: dict[str, int] = {}
    for raw in data:
        if isinstance(raw, dict):
            type_counts[str(raw.get("type"))] = type_counts.get(str(raw.get("type")), 0) + 1
    entries = [_entry(i, raw, src, base, type_counts, allow_imports) for i, raw in enumerate(data)]
    _check_entries(entries, src)
    return entries


def _entry(i: int, raw: Any, src: str, base: Path | None, type_counts: dict[str, int],
           allow_imports: bool) -> TaskEntry:
    """Environment entry ``i`` (``raw``, as read) as a task entry with its agent built."""
    where = f"{src}: environments[{i}]"
    if not isinstance(raw, dict):
        raise EnvConfigError(f"{where}: expected a mapping with keys {list(_ENTRY_KEYS)}, got {_short(raw)}")
    unknown = sorted(set(raw) - set(_ENTRY_KEYS))
    if unknown:
        raise EnvConfigError(f"{where}: unknown key(s) {_short(unknown)}; allowed keys: {list(_ENTRY_KEYS)}")
    type_name = raw.get("type")
    if not isinstance(type_name, str) or not type_name:
        raise EnvConfigError(f"{where}: key 'type' is required (a registered agent type or module:Class)")
    where = f"{where} (type {_short(type_name)})"
    weight = raw.get("weight", 1.0)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not weight >= 0 \
            or weight == float("inf"):
        hint = _WEIGHT_HINT if isinstance(weight, str) else ""
        raise EnvConfigError(f"{where}: key 'weight' must be a finite number >= 0, got {_short(weight)}{hint}")
    eval_only = raw.get("evaluation_only", False)
    if not isinstance(eval_only, bool):
        raise EnvConfigError(f"{where}: key 'evaluation_only' must be true or false, got {_short(eval_only)}")
    args = raw.get("args") or {}
    if not isinstance(args, dict):
        raise EnvConfigError(f"{where}: key 'args' must be a mapping of the agent's fields, got {_short(args)}")
    default_name = type_name.rsplit(":", 1)[-1]
    name = raw.get("name") or (default_name if type_counts[type_name] == 1 else f"{default_name}_{i}")
    if not isinstance(name, str):
        raise EnvConfigError(f"{where}: key 'name' must be a string, got {_short(name)}")
    cls = resolve_agent_type(type_name, allow_imports, f"{where}: key 'type'")
    try:
        agent = cls(**_resolve_paths(args, base))
    except ValidationError as e:
        raise EnvConfigError(f"{where}: key 'args': {_format_validation(e)[:2000]}") from None
    except (ValueError, TypeError, OSError) as e:
        raise EnvConfigError(f"{where}: key 'args': {str(e)[:2000]}") from e
    except ImportError as e:  # an optional package the agent type needs (the message names the extra)
        raise EnvConfigError(f"{where}: {str(e)[:2000]}") from e
    return TaskEntry(name=name, agent=agent, weight=float(weight), evaluation_only=eval_only)


def _check_entries(entries: list[TaskEntry], src: str) -> None:
    """Names unique, at least one environment that trains, a positive training weight."""
    names = [e.name for e in entries]
    for i, n in enumerate(names):
        if names.index(n) != i:
            raise EnvConfigError(f"{src}: environments[{i}]: key 'name': {_short(n)} is already used by "
                                 f"environments[{names.index(n)}]; names must be unique")
    train_weight = sum(e.weight for e in entries if not e.evaluation_only)
    if not any(not e.evaluation_only for e in entries):
        raise EnvConfigError(f"{src}: every environment is evaluation_only; at least one must train")
    if train_weight <= 0:
        raise EnvConfigError(f"{src}: key 'weight': the weights of the training environments sum to "
                             f"{train_weight}; give at least one a positive weight")


def build_agent_from_config(config: str | Path | dict | list, allow_imports: bool = False,
                            seed: int | None = None) -> WeightedMultiTaskAgent:
    """A :class:`WeightedMultiTaskAgent` over the config's environments (see the module docstring).

    seed: when given, overrides each environment's seed with ``seed + entry index`` (so one run flag
    controls every prompt order while environments still differ).
    """
    entries = load_env_config(config, allow_imports)
    if seed is not None:
        for i, e in enumerate(entries):
            e.agent.seed = seed + i
    return WeightedMultiTaskAgent(entries=entries)


def add_env_config_args(parser: Any) -> Any:
    """Add ``--langrl-env-config`` and ``--langrl-allow-imports`` to an argparse parser (an extra-args provider)."""
    group = parser.add_argument_group("environments")
    group.add_argument("--langrl-env-config", default=DEFAULT_ENV_CONFIG,
                       help="YAML file listing the environments (agents), their weights and arguments "
                            f"(default: {DEFAULT_ENV_CONFIG}, the arithmetic task)")
    group.add_argument("--langrl-allow-imports", action="store_true",
                       help="let the env config import user modules (`imports:` or `type: module:Class`)")
    return parser
