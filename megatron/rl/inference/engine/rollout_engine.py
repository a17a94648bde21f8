"""megatron-core's dynamic inference engine with a cheaper admission of token-id prompts.

``DynamicInferenceEngine.add_request`` builds a ``DynamicInferenceRequest``, whose ``__post_init__`` deep-copies
the prompt tensor into ``remaining_prompt_tokens``. ``copy.deepcopy`` of a tensor walks Python's copy protocol and
the tensor's storage (under the CPU layer's device mode, every torch call of it through the mode too), many times
the cost of ``clone()``, which makes the same copy. A rollout phase admits all its requests before its first step,
and waits for their copies (figures: docs/benchmarks.md). :class:`RolloutEngine`
admits a token-id list with the same request, tokens and copy, made directly; other prompts go to megatron-core's
``add_request``. A registered change (:mod:`megatron.rl.runtime.subclasses`).
"""
from __future__ import annotations

from typing import Any

import torch
from megatron.core.inference.engines import DynamicInferenceEngine
from megatron.core.inference.inference_request import DynamicInferenceRequest

__all__ = ["RolloutEngine"]


class RolloutEngine(DynamicInferenceEngine):
    """``DynamicInferenceEngine`` whose ``add_request`` of a token-id list skips the prompt's deep copy."""

    def add_request(self, request_id: int, prompt: Any, sampling_params: Any = None) -> Any:
        if not isinstance(prompt, list):
            return super().add_request(request_id, prompt, sampling_params)
        tokens = torch.tensor(prompt, dtype=torch.int64, device=self.context.request_ids.device)
        # prompt_tokens=None: __post_init__ copies the sampling parameters only; the prompt's copy is made here
        request = DynamicInferenceRequest(request_id=request_id, prompt=None, prompt_tokens=None,
                                          sampling_params=sampling_params)
        request.prompt_tokens, request.remaining_prompt_tokens = tokens, tokens.clone()
        return self._add_request(request)
