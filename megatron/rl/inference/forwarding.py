"""The one base of every backend wrapper: generation and the trainer's controls go to the wrapped backend.

A wrapper (a request cap, a policy-version recorder, an inference copy's refit, the policy server's gate) changes
one or two members of a backend and must pass every other one on, or a hook of asynchronous rollouts is lost
silently behind it (the base-class default answers first). :class:`ForwardingInference` forwards each member of
:class:`~megatron.rl.inference.api.InferenceInterface` (``agenerate``, ``rollout_phase``, ``aclose``, ``name``,
``continuous_batching``) and of :class:`~megatron.rl.inference.control.TrainerControl` (through
:func:`~megatron.rl.inference.control.control_of`, so a wrapped backend without trainer controls keeps their
defaults); a subclass overrides what it changes and calls ``self.inner`` for the rest. Other attributes (the
engine's ``tokenizer``, ``model``, ...) are looked up on the wrapped backend.
"""
from __future__ import annotations

from typing import Any

from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.inference.control import RolloutShard, TrainerControl, control_of

__all__ = ["ForwardingInference"]


def _controls(name: str) -> property:
    """A read-only property answering the wrapped backend's trainer-control data member ``name``."""
    return property(lambda self: getattr(control_of(self.inner), name), doc=f"The wrapped backend's ``{name}``.")


class ForwardingInference(InferenceInterface, TrainerControl):
    """A backend around another backend, ``inner``, forwarding every member to it (see the module docstring)."""

    def __init__(self, inner: InferenceInterface):
        self.inner = inner

    # ------------------------------------------------------------------ InferenceInterface

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        return await self.inner.agenerate(requests)

    def rollout_phase(self):
        return self.inner.rollout_phase()

    async def aclose(self) -> None:
        await self.inner.aclose()

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name

    @property
    def continuous_batching(self) -> bool:  # type: ignore[override]
        return self.inner.continuous_batching

    # ------------------------------------------------------------------ TrainerControl

    supports_weight_updates = _controls("supports_weight_updates")  # type: ignore[assignment]
    rollout_shard = _controls("rollout_shard")  # type: ignore[assignment]
    lockstep_size = _controls("lockstep_size")  # type: ignore[assignment]
    engine_steps = _controls("engine_steps")  # type: ignore[assignment]
    active = _controls("active")  # type: ignore[assignment]

    def set_policy_version(self, version: int) -> None:
        control_of(self.inner).set_policy_version(version)

    def pause_generation(self) -> None:
        control_of(self.inner).pause_generation()

    def resume_generation(self, version: int) -> None:
        control_of(self.inner).resume_generation(version)

    def refit_for_update(self) -> float | None:
        return control_of(self.inner).refit_for_update()

    # ------------------------------------------------------------------ anything else

    def __getattr__(self, name: str) -> Any:
        if name == "inner":  # not set yet (copy / pickle probes): no recursion
            raise AttributeError(name)
        return getattr(self.inner, name)
