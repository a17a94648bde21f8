"""Per-token KL estimators between the current policy and a frozen reference policy.

With log-ratio ``d = ref_logprobs - logprobs`` evaluated on tokens sampled from the policy
(Schulman, "Approximating KL divergence"):

* ``k1`` = -d                     unbiased, can be negative per token, high variance
* ``k2`` = d**2 / 2               biased, always >= 0, low variance
* ``k3`` = exp(d) - 1 - d         unbiased, always >= 0, low variance (the usual GRPO choice)

:func:`kl_penalty` returns ``beta * k`` per token. With ``beta == 0`` the reference model is not
needed at all: ``ref_logprobs`` may be None (the caller must then not build or run it).
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from megatron.rl.base.registry import Registry

KLFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]

KL_ESTIMATORS: Registry[KLFn] = Registry("KL estimator", "--grpo-kl-estimator")

# exp(d) overflows float32 for d > ~88; a token whose reference log-prob is this far above the
# policy's is an outlier whose KL gradient would explode anyway. Clamping d only for k3 keeps it finite.
K3_LOG_RATIO_CLAMP = 20.0


@KL_ESTIMATORS.register("k1")
def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = log pi(x) - log pi_ref(x). Shapes [N] -> [N]."""
    return logprobs - ref_logprobs


@KL_ESTIMATORS.register("k2")
def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = (log pi_ref(x) - log pi(x))**2 / 2. Shapes [N] -> [N]."""
    return 0.5 * (ref_logprobs - logprobs) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(d) - 1 - d with d = log pi_ref(x) - log pi(x), d clamped to +-20. Shapes [N] -> [N]."""
    d = (ref_logprobs - logprobs).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    # expm1 keeps precision for small d, where exp(d) - 1 would cancel
    return torch.expm1(d) - d


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: Optional[torch.Tensor], beta: float,
               estimator: str = "k3") -> torch.Tensor:
    """Per-token KL penalty ``beta * k(logprobs, ref_logprobs)``, shape [N] (like ``logprobs``).

    ``beta == 0`` returns zeros and accepts ``ref_logprobs=None``; ``beta > 0`` with no reference
    log-probs is a ValueError naming ``--grpo-kl-beta``. Gradients flow through ``logprobs`` only
    (the reference is frozen; pass it detached).
    """
    fn = KL_ESTIMATORS.get(estimator)
    if beta < 0:
        raise ValueError(f"--grpo-kl-beta must be >= 0, got {beta}")
    if beta == 0:
        return torch.zeros_like(logprobs)
    if ref_logprobs is None:
        raise ValueError(f"--grpo-kl-beta={beta} > 0 needs reference log-probs, but ref_logprobs is None; "
                         f"build the reference model, or set --grpo-kl-beta 0")
    if ref_logprobs.shape != logprobs.shape:
        raise ValueError(f"ref_logprobs shape {tuple(ref_logprobs.shape)} != logprobs shape {tuple(logprobs.shape)}")
    return beta * fn(logprobs, ref_logprobs.detach())
