"""The one registry: one rule for duplicate names in every registry, unknown names, lazy built-ins, layering."""
from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from megatron.rl.base.registry import DuplicateNameError, Registry, RegistryError, UnknownNameError
from tests.conftest import REPO_ROOT


def _define(source: str, module: str = "fake_user_module"):
    """Execute ``source`` as if it were module ``module`` (what importing or reloading it does)."""
    ns = {"__name__": module}
    exec(source, ns)  # noqa: S102 - test-only, fixed source
    return ns


def test_same_object_again_is_a_no_op():
    reg = Registry("widget", "--widget")
    f = _define("def f():\n    return 1\n")["f"]
    assert reg.register("a")(f) is f
    assert reg.add("a", f) is f
    assert reg.get("a") is f and reg.names() == ["a"] and len(reg) == 1


def test_same_definition_executed_again_keeps_the_newest():
    reg = Registry("widget")
    old = _define("def f():\n    return 1\n")["f"]
    new = _define("def f():\n    return 2\n")["f"]  # e.g. the module was reloaded
    reg.add("a", old)
    reg.add("a", new)
    assert reg.get("a")() == 2


def test_different_object_under_a_taken_name_raises_and_keeps_the_first():
    reg = Registry("widget")
    first = _define("def f():\n    return 1\n")["f"]
    other = _define("def f():\n    return 2\n", module="another_module")["f"]
    reg.add("a", first)
    with pytest.raises(DuplicateNameError, match=r"widget 'a' is already registered \(by fake_user_module\.f\); "
                                                 r"cannot also register another_module\.f"):
        reg.add("a", other)
    assert reg.get("a") is first
    with pytest.raises(DuplicateNameError):  # lambdas share one qualname; they are never the same definition
        reg.add("b", lambda: 1) and reg.add("b", lambda: 2)


def test_unknown_name_names_flag_value_and_choices_and_owner_error():
    class WidgetError(RuntimeError):
        pass

    reg = Registry("widget", "--widget", builtins={"zeta": "no_such_module_for_this_test"}, error=WidgetError)
    reg.add("alpha", 1)
    with pytest.raises(UnknownNameError, match=r"unknown widget 'nope' \(flag --widget\); registered widgets: "
                                               r"alpha, zeta") as info:
        reg.get("nope")
    assert isinstance(info.value, WidgetError) and isinstance(info.value, ValueError)
    with pytest.raises(DuplicateNameError) as info:
        reg.add("alpha", 2)
    assert isinstance(info.value, WidgetError)
    assert reg.pop("alpha") == 1 and "alpha" not in reg


def test_builtins_are_listed_without_import_and_imported_on_first_use(tmp_path, monkeypatch):
    reg = Registry("widget", builtins={"lazy": "widget_builtin_for_test", "broken": "widget_missing_for_test"})
    holder = types.ModuleType("widget_holder_for_test")
    holder.REG = reg
    monkeypatch.setitem(sys.modules, "widget_holder_for_test", holder)
    (tmp_path / "widget_builtin_for_test.py").write_text(
        "import widget_holder_for_test\nwidget_holder_for_test.REG.add('lazy', 'loaded')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "widget_builtin_for_test", raising=False)

    assert reg.names() == ["broken", "lazy"] and "lazy" not in reg and reg.registered() == {}
    assert reg.get("lazy") == "loaded" and "lazy" in reg
    failed = reg.load_builtins()
    assert list(failed) == ["broken"] and "ModuleNotFoundError" in failed["broken"]
    with pytest.raises(ModuleNotFoundError):  # get() lets a built-in's real import error surface
        reg.get("broken")


def test_every_registry_follows_the_one_rule():
    """Algorithms, packing, tokenizers, inference backends, TypeLookupable roots and converter families."""
    from megatron.rl.agent.api import Agent
    from megatron.rl.algorithms import POLICY_LOSSES, ppo_clip_loss
    from megatron.rl.base.type_lookupable import TypeLookupError
    from megatron.rl.inference.api import InferenceError, InferenceInterface, backend_class
    from megatron.rl.sequence_packing_utils import PACKING_ALGOS
    from megatron.rl.training.tokenizer import (ByteLevelTokenizer, HuggingFaceTokenizer, TokenizerError,
                                                register_tokenizer)
    from tools.checkpoint_conversion.families import _FAMILIES, family_by_name, register_family

    arithmetic, fake = Agent.lookup("arithmetic"), backend_class("fake")  # import the built-ins
    fifo = PACKING_ALGOS.get("fifo")
    cases = [  # (register the same object again, register another object under its name, extra error type)
        (lambda: POLICY_LOSSES.register("ppo_clip")(ppo_clip_loss), lambda: POLICY_LOSSES.register("ppo_clip")(fifo),
         ValueError),
        (lambda: PACKING_ALGOS.register("fifo")(fifo), lambda: PACKING_ALGOS.register("fifo")(ppo_clip_loss),
         ValueError),
        (lambda: register_tokenizer("ByteLevelTokenizer")(ByteLevelTokenizer),
         lambda: register_tokenizer("ByteLevelTokenizer")(HuggingFaceTokenizer), TokenizerError),
        (lambda: InferenceInterface.register("fake")(fake),
         lambda: InferenceInterface.register("fake")(type("OtherFake", (fake,), {})), InferenceError),
        (lambda: Agent.register_subclass("arithmetic")(arithmetic),
         lambda: Agent.register_subclass("arithmetic")(type("OtherArithmetic", (arithmetic,), {})), TypeLookupError),
    ]
    for same, other, domain in cases:
        same()  # no-op
        with pytest.raises(DuplicateNameError, match="already registered") as info:
            other()
        assert isinstance(info.value, domain) and isinstance(info.value, RegistryError)
    assert Agent.lookup("arithmetic") is arithmetic and backend_class("fake") is fake

    llama = family_by_name("llama")
    with pytest.raises(DuplicateNameError, match="'llama' is already registered"):
        register_family(type("OtherLlama", (type(llama),), {"model_types": ("llama",)}))
    assert _FAMILIES.get("llama") is llama


@pytest.mark.parametrize("module,forbidden", [
    ("megatron.rl.base.types", ["megatron.rl.agent", "megatron.rl.inference", "megatron.rl.algorithms",
                                "megatron.rl.training", "torch"]),
    ("megatron.rl.base.registry", ["megatron.rl.agent", "pydantic", "torch"]),
    ("megatron.rl.sequence_packing_utils", ["megatron.rl.algorithms"]),
    ("megatron.rl.inference.chat_template", ["megatron.rl.training"]),
    ("megatron.rl.algorithms", ["megatron.rl.agent", "megatron.rl.inference"]),
])
def test_layering(module, forbidden):
    """The base package imports nothing above it; packing and the chat template do not reach sideways."""
    code = f"import json, sys, {module}; print(json.dumps(sorted(sys.modules)))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = json.loads(proc.stdout.strip().splitlines()[-1])
    assert [m for m in loaded if any(m == f or m.startswith(f + ".") for f in forbidden)] == []
