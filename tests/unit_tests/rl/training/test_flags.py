"""Every flag is declared once, on a config dataclass field, and the parsers are generated from the fields."""
from __future__ import annotations

import argparse
import dataclasses
import re
from pathlib import Path

import pytest

from megatron.rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from megatron.rl.base.registry import Registry
from megatron.rl.rl_config import RLConfig, add_rl_args
from megatron.rl.sequence_packing_utils import PACKING_ALGOS
from megatron.rl.training.config import TrainingConfig, build_parser, parse_args
from megatron.rl.base.flags import (add_flags, flag, flag_fields, from_namespace, option_of, registry_choices,
                                        section)

REPO = Path(__file__).resolve().parents[4]
CONFIGS = (TrainingConfig, RLConfig)

# Programs other than pretrain_gpt.py / train_rl.py, with flags of their own (some with the same names).
OTHER_PROGRAMS = ("megatron/rl/server/",)
# add_argument calls that may repeat a config flag, with why.
ALLOWED_REDECLARATIONS = {
    # env_config.add_env_config_args: the environment flags for other programs, defaulting to the arithmetic task
    ("megatron/rl/agent/env_config.py", "--langrl-env-config"),
    ("megatron/rl/agent/env_config.py", "--langrl-allow-imports"),
}


def _config_flags() -> dict[str, list[str]]:
    """option -> the fields declaring it (``Class.field``)."""
    out: dict[str, list[str]] = {}
    for cls in CONFIGS:
        for owner, f, kind in flag_fields(cls):
            assert kind == "flag", f"{owner.__name__}.{f.name} has no flag: declare it with flag() or derived()"
            out.setdefault(option_of(f), []).append(f"{owner.__name__}.{f.name}")
    return out


def test_every_field_has_one_flag_and_every_flag_one_field():
    declared = _config_flags()
    twice = {opt: where for opt, where in declared.items() if len(where) > 1}
    assert not twice, f"flags declared by more than one field: {twice}"
    parser = build_parser([add_rl_args])
    options = [s for a in parser._actions for s in a.option_strings if s not in ("-h", "--help")]
    assert len(options) == len(set(options))
    assert set(options) == set(declared), (set(options) ^ set(declared))


def test_no_flag_is_declared_again_with_add_argument():
    """A config flag added by hand anywhere in megatron/rl (besides the generator) is a second declaration."""
    declared = set(_config_flags())
    call = re.compile(r"add_argument\(\s*[\"'](--[a-z0-9-]+)[\"']")
    again = []
    for path in sorted((REPO / "megatron" / "rl").rglob("*.py")):
        rel = path.relative_to(REPO).as_posix()
        if rel.startswith(OTHER_PROGRAMS):
            continue
        for option in call.findall(path.read_text(encoding="utf-8")):
            if option in declared and (rel, option) not in ALLOWED_REDECLARATIONS:
                again.append((rel, option))
    assert not again, f"flags declared again with add_argument (declare them only on the config field): {again}"


def test_choices_come_from_the_registries():
    by_option = {a.option_strings[0]: a for a in build_parser([add_rl_args])._actions if a.option_strings}
    for option, registry in (("--grpo-advantage-estimator", ADVANTAGE_ESTIMATORS),
                             ("--grpo-loss-aggregation", AGGREGATIONS), ("--grpo-kl-estimator", KL_ESTIMATORS),
                             ("--grpo-policy-loss", POLICY_LOSSES), ("--rl-sequence-packing-algo", PACKING_ALGOS)):
        assert list(by_option[option].choices) == registry.names(), option


def test_resolved_config_is_frozen():
    cfg = parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--mock-data"],
                     world_size=1)
    assert cfg.model.ffn_hidden_size == 256  # resolved into the new object, not left None
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.model.seq_length = 8  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.train = cfg.train  # type: ignore[misc]


_THINGS = Registry("thing", "--thing")


@dataclasses.dataclass(frozen=True)
class _Inner:
    thing: str = flag("a", name="--thing", choices=registry_choices(_THINGS))


@dataclasses.dataclass(frozen=True)
class _Demo:
    size: int = flag()
    rate: float | None = flag(None, help="a rate")
    on: bool = flag(False)
    ks: tuple[int, ...] | None = flag(None, name="--k-list", nargs="+")
    inner: _Inner = section(_Inner)


# Registered after the classes: choices are read from the registry when the parser is built.
_THINGS.register("a")(len)
_THINGS.register("b")(len)


def test_generated_parser_follows_the_field():
    parser = add_flags(argparse.ArgumentParser(), _Demo)
    demo = from_namespace(_Demo, parser.parse_args(["--size", "3", "--on", "--k-list", "4", "1", "--thing", "b"]))
    assert demo == _Demo(size=3, rate=None, on=True, ks=(4, 1), inner=_Inner("b"))
    with pytest.raises(SystemExit):
        parser.parse_args(["--size", "3", "--thing", "c"])  # not a registered name
    with pytest.raises(SystemExit):
        parser.parse_args([])  # a field without a default is a required flag


def test_a_field_without_flag_metadata_is_refused():
    @dataclasses.dataclass(frozen=True)
    class Bad:
        size: int = flag(1)
        forgotten: int = 2

    with pytest.raises(TypeError, match="Bad.forgotten has no flag metadata"):
        from_namespace(Bad, argparse.Namespace(size=1))
    assert [kind for _, _, kind in flag_fields(Bad)] == ["flag", ""]  # what the walk above fails on
