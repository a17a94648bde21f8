"""Is the inference server generating with the trainer's policy? A check on the train-inference log-prob gap.

An external server keeps the weights it started with, so after a few updates the run is silently off-policy.
:func:`check_policy_gap` turns a mean ``|trainer log-prob - inference log-prob|`` above
``--rl-max-policy-logprob-gap`` into :class:`OffPolicyServerError`, unless the run says
``--rl-off-policy-server`` (off-policy by design).

Why, and the expected gaps: docs/observe.md.
"""
from __future__ import annotations

import logging
import math

from megatron.rl.base.errors import RLError

log = logging.getLogger(__name__)

__all__ = ["OffPolicyServerError", "check_policy_gap"]


class OffPolicyServerError(RLError, RuntimeError):
    """The rollouts' log-probs show the inference server is not serving the trainer's policy."""


def check_policy_gap(metrics: dict[str, float], iteration: int, threshold: float, off_policy_ok: bool,
                     backend: str, first: bool = False) -> None:
    """Raise :class:`OffPolicyServerError` when ``metrics["logprob_gap_mean"]`` exceeds ``threshold``.

    No-op with ``off_policy_ok`` or when the backend returned no log-probs (no gap measured: with ``first``,
    the run's first iteration, a warning says that nothing then shows whether the server follows the trainer).
    """
    if off_policy_ok:
        return
    gap = metrics.get("logprob_gap_mean")
    if gap is None or not math.isfinite(gap):
        if first:
            log.warning("the inference backend (%s) returned no log-probs, so nothing checks that it serves the "
                        "trainer's policy", backend)
        return
    if gap > threshold:
        raise OffPolicyServerError(
            f"iteration {iteration}: the rollouts' inference log-probs differ from the trainer's by {gap:.3g} per "
            f"token on average (--rl-max-policy-logprob-gap={threshold}): the inference backend ({backend}) is not "
            f"generating with the policy being trained, e.g. an external server that never receives the "
            f"trainer's weights. Serve the trainer's own policy (--inference-backend megatron; for remote "
            f"environments --rl-serve-inference), or pass --rl-off-policy-server if training off-policy is "
            f"intended.")
