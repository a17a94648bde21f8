"""An optional guard that acts on a sustained collapse of one environment (``--rl-env-collapse-action``).

The per-environment checks (:mod:`megatron.rl.observe.env_health`) only warn. With the guard on, an
``answer_collapse/<env>`` finding that holds for ``--rl-env-collapse-patience`` consecutive iterations acts:

* ``downweight``: the environment's weight in the :class:`~megatron.rl.agent.weighted_multi_task.WeightedMultiTaskAgent`
  is multiplied by ``--rl-env-collapse-weight-factor``, so it gets that much less of each step's groups from the
  next request on (down to the one group per step every positive weight keeps when a step has enough groups).
  The count starts again: if the collapse still holds ``patience`` iterations later, the weight falls again.
  The lowered weight is part of the agent's checkpointed state, so a resumed run keeps it.
* ``stop``: the run stops after the iteration (a checkpoint is saved when ``--save`` is set, so it resumes
  from there), logging a one-line reason; ``train_rl.py`` exits with status 3.

Only ``answer_collapse`` acts: a same-reward share near 1 is also what a task far too hard (or already solved)
shows from the first iteration, which is no collapse. Every rank sees the same findings (the observations are
gathered over data-parallel ranks), so every rank takes the same action at the same iteration.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Sequence

from megatron.rl.base.errors import ConfigError
from megatron.rl.observe.env_health import MIXTURE
from megatron.rl.observe.findings import GUARD_ACTIONS, Finding

__all__ = ["GUARD_ACTIONS", "GuardAction", "CollapseGuard", "apply_guard_actions", "check_guard_target"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class GuardAction:
    kind: str  # "downweight" | "stop"
    env: str
    streak: int  # consecutive iterations the collapse held
    reason: str  # one line


class CollapseGuard:
    """Counts, per environment, the consecutive iterations with an ``answer_collapse/<env>`` finding, and
    returns the action once a count reaches ``patience`` (then starts it again)."""

    def __init__(self, action: str, patience: int) -> None:
        if action not in GUARD_ACTIONS:
            raise ValueError(f"guard action {action!r}: choose one of {GUARD_ACTIONS}")
        self.action = action
        self.patience = patience
        self._streak: dict[str, int] = {}

    def update(self, findings: Sequence[Finding], iteration: int) -> list[GuardAction]:
        if self.action == "off":
            return []
        collapsed = {f.env: f for f in findings if f.kind.startswith("answer_collapse/") and f.env != MIXTURE}
        self._streak = {env: self._streak.get(env, 0) + 1 for env in collapsed}  # a healthy iteration resets
        out = []
        for env in sorted(collapsed):
            if self._streak[env] < self.patience:
                continue
            self._streak[env] = 0
            f = collapsed[env]
            out.append(GuardAction(self.action, env, self.patience, (
                f"environment {env!r} collapsed to one answer ({f.value:.0%} of its rollouts) for {self.patience} "
                f"iterations in a row up to iteration {iteration} (--rl-env-collapse-action {self.action}, "
                f"--rl-env-collapse-patience {self.patience})")))
        return out


def apply_guard_actions(actions: Sequence[GuardAction], agent: Any, factor: float,
                        report: bool = True) -> tuple[dict[str, float], str | None]:
    """Carry out ``actions`` on ``agent``: returns the metrics to record (``guard/weight/<env>``: the new weight,
    ``guard/stop``: 1) and the one-line reason to stop (None: go on). ``report``: log them (rank 0)."""
    metrics: dict[str, float] = {}
    stop = None
    for a in actions:
        if a.kind == "downweight":
            old, new = agent.scale_weight(a.env, factor)
            metrics[f"guard/weight/{a.env}"] = new
            if report:
                log.warning("%s: lowered its weight %g -> %g (--rl-env-collapse-weight-factor %g)", a.reason, old, new,
                            factor)
        elif a.kind == "stop":
            metrics["guard/stop"] = 1.0
            stop = stop or a.reason
    return metrics, stop


def check_guard_target(action: str, agent: Any) -> None:
    """``downweight`` needs a mixture to reweight: an agent with ``scale_weight`` and two or more training
    environments (a :class:`~megatron.rl.agent.weighted_multi_task.WeightedMultiTaskAgent` from the env config)."""
    if action != "downweight":
        return
    entries = getattr(agent, "training_entries", None)
    if not hasattr(agent, "scale_weight") or entries is None or len(entries) < 2:
        names = [e.name for e in entries] if entries is not None else []
        raise ConfigError(f"--rl-env-collapse-action downweight needs a mixture of at least two training "
                          f"environments to reweight; the env config has {names or 'one agent'}. Use "
                          f"--rl-env-collapse-action stop (or off) for a single environment.")
