"""Where an RL iteration's rollout groups come from: one :class:`RolloutSource` protocol, two sources.

:class:`SynchronousRollouts` (default) generates each iteration's groups now;
:class:`~megatron.rl.rollout.async_source.AsyncRollouts` (any asynchronous-rollout flag) takes them from a
pipeline that generates ahead within a bounded lag. The trainer never asks which one it has.
:meth:`RolloutSource.weights_updated` is the one place where updated weights reach the backend.

Details: docs/rollouts.md.
"""
from __future__ import annotations

from typing import Protocol

from megatron.rl.agent.api import Agent
from megatron.rl.base.types import RolloutGroup
from megatron.rl.inference.api import InferenceInterface, run_sync
from megatron.rl.inference.control import control_of
from megatron.rl.rollout.async_source import AsyncRollouts
from megatron.rl.rollout.collection import for_training, generation_split, rollout_request
from megatron.rl.rollout.flags import RolloutFlags

__all__ = ["RolloutSource", "SynchronousRollouts", "build_rollout_source"]


class RolloutSource(Protocol):
    """The trainer's rollout source (see the module docstring). Every method is called on every rank."""

    def collect(self, iteration: int) -> list[RolloutGroup]:
        """This training data-parallel rank's ``P / DP`` groups to train at ``iteration`` (deterministic given the
        seed; collective when prompts are split by lockstep group)."""

    def weights_updated(self, version: int, changed: bool = True) -> float | None:
        """After iteration ``version - 1``'s optimizer steps (``changed``) or its skipped update: bring the weights
        to the generating backend. Returns the seconds a refit took, None when nothing was refit."""

    def checkpoint_saved(self, iteration: int) -> None:
        """Checkpoint ``iteration`` is published (a durable rollout bank forgets the groups it trained)."""

    def ledger(self) -> dict | None:
        """The rollout-group uids since the last call (produced / consumed / restored), for audits; None: none."""

    def durable_groups(self) -> int | None:
        """Completed, untrained groups this rank holds on disk (a checkpoint records it); None: nothing durable."""

    def close(self) -> None:
        """Stop generating (groups generated ahead are dropped, or stay in the bank)."""

    def describe(self) -> str:
        """How this source generates, in words (the run's start-up summary)."""


class SynchronousRollouts:
    """Each iteration's groups generated in that iteration, by its weights, in one rollout phase."""

    def __init__(self, agent: Agent, inference: InferenceInterface, rl: RolloutFlags, seed: int):
        self.agent = agent
        self.inference = inference
        self.rl = rl
        self.seed = seed

    def collect(self, iteration: int) -> list[RolloutGroup]:
        shard, gen_rank, gen_size = generation_split(self.inference)
        request = rollout_request(self.rl, self.seed, iteration, gen_rank, self.rl.prompts_per_step // gen_size,
                                  self.inference)
        with self.inference.rollout_phase():
            response = run_sync(self.agent.generate_grouped_rollouts(request))
        return for_training(shard, response.groups)

    def weights_updated(self, version: int, changed: bool = True) -> float | None:
        return control_of(self.inference).refit_for_update() if changed else None

    def checkpoint_saved(self, iteration: int) -> None:
        pass

    def ledger(self) -> dict | None:
        return None

    def durable_groups(self) -> int | None:
        return None

    def close(self) -> None:
        pass

    def describe(self) -> str:
        return "synchronous (every iteration generates its own groups)"


def build_rollout_source(agent: Agent, inference: InferenceInterface, rl: RolloutFlags, seed: int, start_iteration: int,
                         save: str | None = None, resuming: bool = False,
                         recorded: list[int | None] | None = None) -> RolloutSource:
    """The run's rollout source: asynchronous when any asynchronous-rollout flag is set, else synchronous.

    start_iteration: the iteration the run starts (or resumes) at. save: ``--save`` (the rollout bank's default
    home). resuming: this run continues an earlier one (``--load``), so a durable rollout bank restores what it
    holds. recorded: every rank's durable groups as the loaded checkpoint counted them (a bank that lost some
    says so).
    """
    if rl.async_rollouts.enabled:
        return AsyncRollouts.build(agent, inference, rl, seed, start_iteration, save=save, resuming=resuming,
                                   recorded=recorded)
    return SynchronousRollouts(agent, inference, rl, seed)
