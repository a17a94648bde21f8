"""The trainer's controls over the backend an RL run generates with, declared apart from generation.

Agents and servers see an :class:`~megatron.rl.inference.api.InferenceInterface`; the trainer also needs
:class:`TrainerControl`: building from the run's configs, splitting prompts over lockstep groups, holding
requests across an update, labelling policy versions, refitting weights. Its defaults describe a backend apart
from the trainer's weights (a remote server). The trainer reaches any backend's controls through
:func:`control_of`, never by probing attributes; wrappers forward every member through
:class:`~megatron.rl.inference.forwarding.ForwardingInference`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import torch.distributed as dist

from megatron.rl.inference.api import InferenceInterface, backend_class
from megatron.rl.inference.engine.lockstep import lockstep_rank_groups

__all__ = ["TrainerControl", "RolloutShard", "control_of", "build_training_inference", "sees_weight_updates"]


@dataclasses.dataclass
class RolloutShard:
    """How rollout and evaluation prompts are split when an in-process engine serves them: by lockstep group.

    Every rank of lockstep group ``rank`` (of ``size``) asks for the same prompts (its engine serves them in
    lockstep); :meth:`gather` collects one result per group, in group order, on every rank. With a separate
    inference layout the groups are its replicas; at the training layout they are the model-parallel groups,
    which with expert parallelism span several training data-parallel ranks.
    """

    rank: int
    size: int
    sources: list[int]  # the lowest global rank of each lockstep group, in group order

    @classmethod
    def for_lockstep(cls, lockstep: list[list[int]], rank: int) -> "RolloutShard":
        """The share of global ``rank`` given every lockstep group (:func:`lockstep_rank_groups`; pure). Groups
        are ordered by their lowest rank, which in megatron-core's rank order is their data-parallel order."""
        ordered = sorted(lockstep)
        index = next(i for i, members in enumerate(ordered) if rank in members)
        return cls(rank=index, size=len(ordered), sources=[members[0] for members in ordered])

    @classmethod
    def for_groups(cls, groups: Any) -> "RolloutShard":
        """The share of this rank's replica of an inference layout (a
        :class:`~megatron.rl.layout.groups.InferenceGroups`: its ``sizes`` and ``lockstep_source``)."""
        s = groups.sizes
        return cls.for_lockstep(lockstep_rank_groups(s.world, s.tp, s.pp, s.ep, s.expert_tp), groups.lockstep_source)

    def gather(self, obj: Any) -> list[Any]:
        """``obj`` of every replica (from its source rank), in replica order; collective over the world."""
        everyone: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, obj)
        return [everyone[src] for src in self.sources]

    def regroup_for_training(self, groups: list, dp_rank: int, dp_size: int) -> list:
        """This training data-parallel rank's share of all replicas' groups (collective over the world)."""
        everything = [g for part in self.gather(list(groups)) for g in part]
        per_rank, extra = divmod(len(everything), dp_size)
        if extra:
            raise RuntimeError(f"{len(everything)} rollout groups cannot be split evenly over {dp_size} "
                               f"training data-parallel ranks")
        return everything[dp_rank * per_rank:(dp_rank + 1) * per_rank]


class TrainerControl:
    """What the trainer asks of the backend it generates with, besides generation (see the module docstring).

    Data members (class attributes or properties of an implementation): ``supports_weight_updates``,
    ``rollout_shard``, ``lockstep_size``, ``engine_steps``, ``active``. Methods: ``set_policy_version``,
    ``pause_generation``, ``resume_generation``, ``refit_for_update``; and the class method
    ``build_for_training``. Wrappers forward all but the last (they are built around a backend, not from flags).
    """

    #: True when the trainer's weight updates reach this backend (it generates with the trainer's weights, in
    #: place or refitted), so that requests in flight at an update can continue with the new weights
    #: (``--rl-partial-rollouts``). False for a server the trainer cannot update.
    supports_weight_updates: ClassVar[bool] = False
    #: How the trainer splits prompts over this backend's lockstep groups when not one per training
    #: data-parallel rank (a separate inference layout's replicas, or expert parallelism); None: by DP rank.
    rollout_shard: RolloutShard | None = None
    #: Ranks that run one engine in lockstep (tensor/pipeline/expert-parallel ranks); 1 for a single rank.
    lockstep_size: int = 1
    #: Engine steps run since construction (a batching diagnostic); None where there is no engine to count.
    engine_steps: int | None = None
    #: Whether the backend's engine is running (an evaluation's rollout phase may have stopped it).
    active: bool = True

    @classmethod
    def build_for_training(cls, cfg: Any, rl: Any, model: list, tokenizer: Any) -> InferenceInterface:
        """Build the backend an RL run generates with (``--inference-backend NAME``).

        cfg / rl: the run's ``TrainingConfig`` and ``RLConfig`` (validated); model: the trainer's model
        chunks; tokenizer: the run's tokenizer. The default calls the constructor without arguments; a
        backend that serves the trainer's model or reads flags overrides this.
        """
        return cls()

    def set_policy_version(self, version: int) -> None:
        """The policy version (trainer iteration) of the weights generating from now on; a backend that records
        it per token returns it in ``InferenceResponse.policy_versions``. Default: not recorded."""

    def pause_generation(self) -> None:
        """Hold the requests in flight (keeping their state) so that the trainer may update the weights; returns
        once held. Default: nothing to hold (the backend does not generate with the trainer's weights)."""

    def resume_generation(self, version: int) -> None:
        """Continue the held requests with the updated weights, as policy ``version``. Default: nothing held."""

    def refit_for_update(self) -> float | None:
        """The trainer's weights changed (called on every rank, while generation is stopped or held): bring them
        into the model that generates. Returns the seconds a refit took, or None when there is nothing to refit
        (the backend generates with the trainer's parameters in place, or never sees them)."""
        return None


_DETACHED = TrainerControl()


def control_of(backend: Any) -> TrainerControl:
    """``backend``'s controls: itself when it implements :class:`TrainerControl`, else the defaults of a
    backend apart from the trainer's weights."""
    return backend if isinstance(backend, TrainerControl) else _DETACHED


def build_training_inference(cfg: Any, rl: Any, model: list, tokenizer: Any) -> InferenceInterface:
    """The backend named by ``rl.inference_backend``, built by its :meth:`TrainerControl.build_for_training`
    (a backend without trainer controls: its constructor without arguments)."""
    cls = backend_class(rl.inference_backend)
    if issubclass(cls, TrainerControl):
        return cls.build_for_training(cfg, rl, model, tokenizer)
    return cls()


def sees_weight_updates(name: str) -> bool:
    """Whether the backend registered as ``name`` sees the trainer's weight updates (``--rl-partial-rollouts``)."""
    cls = backend_class(name)
    return issubclass(cls, TrainerControl) and bool(cls.supports_weight_updates)
