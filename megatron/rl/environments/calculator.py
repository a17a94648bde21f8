"""Multi-turn tool use: the policy may call a calculator (``CALC <expr>``) before answering (``ANSWER <n>``).

One line per model turn (the stop string is the newline); the environment answers each ``CALC`` with
``= <value>`` (mask 0), evaluated by the bounded :mod:`safe_expr` parser. Reward 1.0 when the final answer is
right, plus ``tool_bonus`` when a calculator call succeeded. Malformed lines end the episode.

Protocol example: docs/environments.md.
"""
from __future__ import annotations

import random
import re

from pydantic import Field

from megatron.rl.agent.answers import committed_answer
from megatron.rl.environments.arithmetic import make_problem
from megatron.rl.environments.safe_expr import ExprError, ParseOptions, evaluate_exact, parse
from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent
from megatron.rl.agent.reward_only_agent import Turn

__all__ = ["CalculatorAgent", "calculator_observation", "calculator_reward"]

_OPTS = ParseOptions(allow_power=False, allow_unary=True, allow_decimal=False, max_length=100, max_digits=12,
                     max_depth=16, max_nodes=64)
_CALL = re.compile(r"\s*CALC\s+(.{1,100})")
_ANSWER = re.compile(r"\s*ANSWER\s+(-?\d{1,30})\s*")


def calculator_observation(line: str) -> str | None:
    """The observation for one generated line (None: not a tool call, the episode ends)."""
    m = _CALL.fullmatch(line.split("\n", 1)[0])
    if m is None:
        return None
    try:
        value = evaluate_exact(parse(m.group(1), _OPTS), _OPTS)
        shown = str(value.numerator) if value.denominator == 1 else f"{value.numerator}/{value.denominator}"
    except ExprError as e:
        shown = f"error: {e}"
    return f"\n= {shown}\n"


def calculator_reward(turns: list[Turn], answer: int, tool_bonus: float = 0.0) -> float:
    if not turns:
        return 0.0
    got = committed_answer(turns[-1].text, _ANSWER, ("\n",), strip=False)
    correct = 1.0 if got is not None and int(got) == answer else 0.0
    used = any(t.observation and not t.observation.startswith("\n= error") for t in turns)
    return correct + (tool_bonus if used else 0.0)


@Agent.register_subclass("calculator")
class CalculatorAgent(PassAtEvaluationAgent):
    """Arithmetic with a calculator tool over up to ``max_turns`` turns (see the module docstring)."""

    max_turns: int = Field(default=4, ge=1)
    min_operands: int = Field(default=2, ge=2)
    max_operands: int = Field(default=3, ge=2)
    max_digits: int = Field(default=3, ge=1, le=9)
    operators: str = "+-*"
    tool_bonus: float = Field(default=0.0, ge=0.0)
    validation_size: int = Field(default=100, ge=1)
    stop: list[str] = Field(default_factory=lambda: ["\n"])
    max_tokens: int | None = 32

    def dataset_size(self, validation: bool) -> int | None:
        return self.validation_size if validation else None

    def get_problem(self, index: int, validation: bool) -> dict:
        split = "val" if validation else "train"
        rng = random.Random(f"calculator:{self.seed}:{split}:{index}")
        p = make_problem(rng, self.min_operands, self.max_operands, 1, self.max_digits, self.operators)
        p["prompt"] = f"Q: What is {p['expression']}? Tools: CALC <expr>. Finish: ANSWER <number>.\n"
        p["id"] = f"{split}-{index}"
        return p

    def observe(self, problem: dict, turns: list[Turn]) -> str | None:
        return calculator_observation(turns[-1].text)

    def compute_episode_reward(self, problem: dict, turns: list[Turn]) -> float:
        return calculator_reward(turns, int(problem["answer"]), self.tool_bonus)
