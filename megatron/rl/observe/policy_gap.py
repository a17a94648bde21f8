"""Is the inference server generating with the trainer's policy? A check on the train-inference log-prob gap.

GRPO/PPO assume the rollouts were sampled from the policy being trained (up to the PPO clip). The in-process
engine (``--inference-backend megatron``, also behind ``--rl-serve-inference``) *is* that policy. An external
OpenAI-compatible server (``--inference-backend openai``, or whatever backend a remote environment server
uses) keeps the weights it was started with: once the trainer has taken a few steps the rollouts come from
another, fixed policy and the run is off-policy, silently.

Every iteration the trainer re-scores the rollouts under its current weights and measures
``logprob_gap_mean = mean |trainer log-prob - inference log-prob|`` over generated tokens (same weights:
about 1e-6 in fp32, about 1e-2 in bf16). :func:`check_policy_gap` turns a mean gap above
``--rl-max-policy-logprob-gap`` into :class:`OffPolicyServerError` unless the run says
``--rl-off-policy-server`` (off-policy by design: e.g. distillation from a fixed server, with
``--rl-inference-logprobs-is-correction`` to weight the loss).
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
