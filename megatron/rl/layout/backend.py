"""The backend an RL run generates with, chosen once: an inference copy at its own layout when
``--rl-inference-*-model-parallel-size`` asks for one, else ``--inference-backend``'s own build.

Training and ``--eval-only`` both ask here; nothing else chooses a backend.
"""
from __future__ import annotations

from typing import Any

from megatron.rl.inference.api import InferenceInterface
from megatron.rl.inference.control import build_training_inference
from megatron.rl.layout.refit import build_layout_inference
from megatron.rl.training.config import TrainingConfig


def build_run_inference(cfg: TrainingConfig, rl: Any, model: list, tokenizer) -> InferenceInterface:
    """The backend an RL run generates with: the inference copy at its own layout when ``--rl-inference-*``
    flags ask for one (not refit yet), else ``--inference-backend``'s ``build_for_training``."""
    if rl.inference_layout.enabled:
        return build_layout_inference(cfg, rl.inference_layout, model, tokenizer,
                                      record_routes=rl.router_replay == "rollout",  # MoE routing replay
                                      engine=rl.engine)
    return build_training_inference(cfg, rl, model, tokenizer)
