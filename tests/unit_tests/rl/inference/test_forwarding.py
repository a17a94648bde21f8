"""Every backend wrapper passes every member of the trainer's control protocol, and generation, to the backend it
wraps: a hook dropped behind a wrapper is lost silently (the protocol's default answers instead), so the members
are enumerated from the protocol itself and every wrapper in the package is checked against each of them."""
from __future__ import annotations

import ast
import contextlib
import importlib
import inspect

import pytest

from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse, run_sync
from megatron.rl.inference.control import TrainerControl, control_of
from megatron.rl.inference.forwarding import ForwardingInference
from tests.conftest import REPO_ROOT

PACKAGE = REPO_ROOT / "megatron" / "rl"


def control_members() -> dict[str, str]:
    """Name -> "data" or "method" for every member of TrainerControl a wrapper must forward (the class method
    that builds a backend from flags is not: a wrapper is built around a backend)."""
    out = {}
    for name, value in vars(TrainerControl).items():
        if name.startswith("_") or isinstance(value, classmethod):
            continue
        out[name] = "method" if inspect.isfunction(value) else "data"
    return out


class _Inner(InferenceInterface, TrainerControl):
    """A backend whose every control data member is an object of its own, and whose every control method (and
    generation) records its call."""

    def __init__(self):
        self.calls: list[tuple] = []
        for name, kind in control_members().items():
            if kind == "data":
                setattr(self, name, object())

    async def agenerate(self, requests):
        self.calls.append(("agenerate", len(requests)))
        return [InferenceResponse(text="x", token_ids=[1, 2], prompt_length=1, finish_reason="stop")
                for _ in requests]

    @contextlib.contextmanager
    def rollout_phase(self):
        self.calls.append(("rollout_phase",))
        yield self


def _recording(name: str):
    def method(self, *args):
        self.calls.append((name, *args))

    return method


for _name, _kind in control_members().items():
    if _kind == "method":  # every method of the protocol, present and future, records its calls
        setattr(_Inner, _name, _recording(_name))


class _FreshCopy:
    stale, refit_method = False, "gloo"

    def refit(self) -> float:
        self.stale = False
        return 0.0


def _wrappers():
    """Wrapper class name -> how to build it around ``inner``, ready to generate."""
    from megatron.rl.layout.refit import LayoutInference
    from megatron.rl.rollout.async_source import VersionRecorder
    from megatron.rl.rollout.pipeline import RequestGate
    from megatron.rl.server.policy_server import PolicyGate, ServedPolicy, _GatedBackend

    def gated(inner):
        gate = PolicyGate(wait_s=5)
        gate.open()
        return _GatedBackend(inner, gate)

    return {
        ForwardingInference: ForwardingInference,
        RequestGate: lambda inner: RequestGate(inner, max_requests=4),
        VersionRecorder: VersionRecorder,
        LayoutInference: lambda inner: LayoutInference(inner, _FreshCopy(), None),
        _GatedBackend: gated,
        ServedPolicy: lambda inner: ServedPolicy(inner, PolicyGate(wait_s=5), server=None),
    }


def _package_wrappers() -> set[str]:
    """Qualified names of the package's classes that wrap a backend: those deriving from a wrapper, and those
    deriving from InferenceInterface whose constructor takes another backend (``inner`` / ``backend``)."""
    found = set()
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts)
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            bases = {ast.unparse(b).rsplit(".", 1)[-1] for b in node.bases}
            init = next((f for f in node.body if isinstance(f, ast.FunctionDef) and f.name == "__init__"), None)
            takes_backend = init is not None and any(a.arg in ("inner", "backend") for a in init.args.args)
            if bases & {"ForwardingInference", "RequestGate", "VersionRecorder", "LayoutInference"} or (
                    "InferenceInterface" in bases and takes_backend):
                found.add(f"{module}.{node.name}")
    return found


def test_every_wrapper_in_the_package_derives_from_the_forwarding_base_and_is_checked_here():
    checked = {f"{cls.__module__}.{cls.__qualname__}" for cls in _wrappers()}
    wrappers = _package_wrappers()
    assert wrappers, "no wrapper found: the scan is broken"
    for name in sorted(wrappers):
        module, _, cls_name = name.rpartition(".")
        cls = getattr(importlib.import_module(module), cls_name)
        assert issubclass(cls, ForwardingInference), f"{name} wraps a backend without deriving ForwardingInference"
    assert wrappers <= checked, f"add these wrappers to _wrappers(): {sorted(wrappers - checked)}"


def test_the_protocol_lists_the_trainer_s_controls():
    assert control_members() == {
        "supports_weight_updates": "data", "rollout_shard": "data", "lockstep_size": "data", "engine_steps": "data",
        "active": "data", "set_policy_version": "method", "pause_generation": "method",
        "resume_generation": "method", "refit_for_update": "method"}


@pytest.mark.parametrize("wrapper", list(_wrappers()), ids=lambda cls: cls.__name__)
@pytest.mark.parametrize("member", sorted(control_members()))
def test_a_wrapper_forwards_every_control_member(wrapper, member):
    inner = _Inner()
    wrapped = _wrappers()[wrapper](inner)
    if control_members()[member] == "data":
        assert getattr(wrapped, member) is getattr(inner, member), f"{wrapper.__name__}.{member} is not the inner's"
        return
    args = (7,) if "version" in inspect.signature(getattr(TrainerControl, member)).parameters else ()
    getattr(control_of(wrapped), member)(*args)
    assert (member, *args) in inner.calls, f"{wrapper.__name__}.{member} did not reach the wrapped backend"


@pytest.mark.parametrize("wrapper", list(_wrappers()), ids=lambda cls: cls.__name__)
def test_a_wrapper_forwards_generation_and_the_rollout_phase(wrapper):
    inner = _Inner()
    wrapped = _wrappers()[wrapper](inner)
    with wrapped.rollout_phase():
        responses = run_sync(wrapped.agenerate([InferenceRequest(prompt="hi")]))
    assert [r.text for r in responses] == ["x"]
    assert inner.calls[:2] == [("rollout_phase",), ("agenerate", 1)]


def test_generation_alone_has_no_trainer_controls():
    # what a wrapper of an old-style backend would have missed: the controls are not InferenceInterface members
    assert not set(control_members()) & set(dir(InferenceInterface))
    assert control_of(object()).refit_for_update() is None and not control_of(object()).supports_weight_updates
