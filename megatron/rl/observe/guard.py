"""An optional guard that acts on a sustained collapse of one environment (``--rl-env-collapse-action``).

An ``answer_collapse/<env>`` finding held for ``--rl-env-collapse-patience`` iterations either multiplies the
environment's weight by ``--rl-env-collapse-weight-factor`` (``downweight``, checkpointed) or stops the run after
the iteration with a checkpoint (``stop``; ``train_rl.py`` exits with status 3). Only ``answer_collapse`` acts.
Every rank sees the same findings, so every rank acts alike.

Why only answer collapse: docs/observe.md.
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
