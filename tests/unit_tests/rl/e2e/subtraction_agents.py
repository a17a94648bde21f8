"""A user-defined environment for the asynchronous-mixture tests: subtraction with non-negative results.

``Q: 7-3=? A: 4``: an operator the quickstart's pretraining corpus never shows (it holds single-digit
additions), so a pretrained policy starts near zero here and learns it only from RL, beside the arithmetic
task it half knows. Registered by decorator and imported through the env config's ``imports:``, as users do.
"""
from __future__ import annotations

import random

from megatron.rl.agent import Agent
from megatron.rl.environments.arithmetic import ArithmeticAgent, format_prompt


@Agent.register_subclass("subtraction")
class SubtractionAgent(ArithmeticAgent):
    """``a-b`` with ``b <= a``, operands of ``min_digits``..``max_digits`` digits (two operands only)."""

    operators: str = "-"

    def get_problem(self, index: int, validation: bool) -> dict:
        rng = random.Random(f"subtraction:{self.seed}:{'val' if validation else 'train'}:{index}")
        digits = rng.randint(self.min_digits, self.max_digits)
        a = rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10 ** digits - 1)
        b = rng.randint(0, a)
        expression = f"{a}-{b}"
        return {"expression": expression, "answer": a - b, "prompt": format_prompt(expression),
                "id": f"{'val' if validation else 'train'}-{index}"}
