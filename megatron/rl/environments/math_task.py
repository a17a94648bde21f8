"""Math word problems (GSM8K / MATH style) scored by final-answer equivalence.

Defaults to the small sample set shipped in ``data/math_sample.jsonl`` (``{"id", "question", "answer"}``;
written for this repository, not downloaded); point ``data_path`` at any local JSONL/Parquet/Arrow file
with the same (or mapped) fields for real data. Prompts are chat messages asking for a ``\\boxed{}`` answer;
scoring is :func:`math_answers.math_reward` (boxed / ``####`` / last-number extraction, then exact, symbolic
(sympy) or numeric equivalence; safe on adversarial output).
"""
from __future__ import annotations

from pathlib import Path

from megatron.rl.environments.math_answers import math_reward
from megatron.rl.agent.api import Agent
from megatron.rl.agent.huggingface_dataset_agent import HuggingFaceDatasetAgent

__all__ = ["MathAgent", "SAMPLE_DATA"]

SAMPLE_DATA = str(Path(__file__).resolve().parent / "data" / "math_sample.jsonl")


@Agent.register_subclass("math")
class MathAgent(HuggingFaceDatasetAgent):
    """A :class:`HuggingFaceDatasetAgent` with math-aware scoring and the shipped sample set as default."""

    data_path: str = SAMPLE_DATA
    prompt_field: str = "question"
    answer_field: str = "answer"
    id_field: str | None = "id"
    chat: bool = True
    prompt_template: str | None = "{question}\nPut your final answer in \\boxed{{}}."
    max_tokens: int | None = 512

    def compute_reward(self, problem: dict, completion: str) -> float:
        return math_reward(completion, str(problem["answer"]))
