"""The inference copy's start and its parity check (``--rl-verify-model-weights-swap``).

The check compares the copy's log-probs on a small probe batch with the trainer's teacher-forced ones. The
trainer's side comes in as a function (``trainer_gap``: responses -> the trainer's log-prob gap metrics), so this
module never imports the trainer.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch

from megatron.rl.base.errors import RLError
from megatron.rl.inference.api import GenerationArgs, InferenceRequest, InferenceResponse
from megatron.rl.layout.refit import LayoutInference

log = logging.getLogger(__name__)

# The trainer's scoring of generated responses: their log-prob gap metrics (``logprob_gap_max``, ``_mean``).
TrainerGap = Callable[[list[InferenceResponse]], dict[str, float]]


class RefitVerificationError(RLError, RuntimeError):
    """--rl-verify-model-weights-swap found the inference copy disagreeing with the trainer."""


def start_inference_copy(inference: LayoutInference, verify: bool, trainer_gap: TrainerGap, max_new_tokens: int,
                         temperature: float) -> None:
    """RL loop start: refit the copy from the trainer's (loaded) weights; ``verify``
    (--rl-verify-model-weights-swap) checks it."""
    log.info("refit of the inference copy from the trainer's weights took %.3fs", inference.refit_if_stale())
    if verify:
        verify_weights_swap(inference, trainer_gap, max_new_tokens, temperature)


def probe_requests(tokenizer, max_new_tokens: int, temperature: float) -> list[InferenceRequest]:
    """A small fixed probe batch (the same on every rank)."""

    prompts = ["The weights were refit; ", "1 2 3 4 5 6", "probe: abcdefghij"]
    return [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=temperature,
                                                                      max_tokens=max_new_tokens, seed=17 + i))
            for i, p in enumerate(prompts)]


def verify_weights_swap(inference: LayoutInference, trainer_gap: TrainerGap, max_new_tokens: int,
                        temperature: float, tolerance: float | None = None) -> float:
    """--rl-verify-model-weights-swap: the copy's log-probs on a probe batch equal the trainer's.

    The copy generates the probe batch (its log-probs come from its logits at the sampling temperature);
    ``trainer_gap`` scores the same tokens teacher-forced through the trainer's usual scoring path. Collective over
    the world. Returns the largest |difference|; raises :class:`RefitVerificationError` above ``tolerance``
    (default 1e-3 in fp32, 5e-2 in bf16/fp16).
    """

    if tolerance is None:
        half = any(p.dtype in (torch.bfloat16, torch.float16) for p in inference.copy.model[0].parameters())
        tolerance = 5e-2 if half else 1e-3
    requests = probe_requests(inference.inner.tokenizer, min(16, max_new_tokens), temperature)
    with inference.rollout_phase():
        responses = inference.generate(requests)
    bad = [r.error for r in responses if r.finish_reason == "error"]
    if bad:
        raise RefitVerificationError(f"--rl-verify-model-weights-swap: the inference copy failed to generate the "
                                     f"probe batch: {bad[0]}")
    gap = trainer_gap([resp for r in inference.rollout_shard.gather(responses) for resp in r])
    worst = float(gap.get("logprob_gap_max", float("nan")))
    if not worst <= tolerance:
        raise RefitVerificationError(
            f"--rl-verify-model-weights-swap: after the refit the inference copy's log-probs differ from the "
            f"trainer's by up to {worst:.3g} (mean {gap.get('logprob_gap_mean', float('nan')):.3g}) on the probe "
            f"batch, above the tolerance {tolerance:g}: the refit (--refit-method {inference.copy.refit_method}) "
            f"or the inference layout is broken; drop --rl-inference-*-model-parallel-size to generate with the "
            f"training model itself.")
    log.info("--rl-verify-model-weights-swap: inference copy equals the trainer on the probe batch "
             "(max |log-prob difference| %.2e <= %g)", worst, tolerance)
    return worst
