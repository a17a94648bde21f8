"""Countdown: combine the given numbers with + - * / (each exactly once) to reach a target.

Prompt (text, byte-tokenizer friendly)::

    "Use 3 5 7 once each with + - * / to make 22. Answer:"

The model's answer is the text inside the last ``<answer>...</answer>`` tag if there is one, else the first
line of the completion. It is parsed with the bounded parser of :mod:`safe_expr` (never ``eval``):
no powers, no unary signs, integers only, limited length and nesting. Reward 1.0 when the expression
uses exactly the given numbers (as a multiset) and evaluates exactly (rationals) to the target;
``format_reward`` (default 0) when it is a valid expression of the numbers that misses the target;
0.0 otherwise, including anything malformed or adversarial.
"""
from __future__ import annotations

import random
from collections import Counter
from fractions import Fraction

from pydantic import Field

from megatron.rl.agent.answers import committed_text, last_tag
from megatron.rl.environments.safe_expr import ExprError, ParseOptions, evaluate_exact, leaf_numbers, parse
from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent

__all__ = ["CountdownAgent", "countdown_reward", "extract_expression", "make_countdown_problem"]

_OPTS = ParseOptions(allow_power=False, allow_unary=False, allow_decimal=False, max_length=200, max_digits=6,
                     max_depth=32, max_nodes=64)


def extract_expression(completion: str) -> str:
    """The last ``<answer>`` tag's content, else the completion's first non-blank line."""
    tagged = last_tag(completion)
    if tagged is not None:
        return tagged
    return committed_text(completion.strip(), ("\n",)).strip()


def countdown_reward(completion: str, numbers: list[int], target: int, format_reward: float = 0.0) -> float:
    """Score a completion; never raises (see the module docstring)."""
    expr = extract_expression(completion)
    if expr.endswith("=" + str(target)) or expr.endswith("= " + str(target)):
        expr = expr.rsplit("=", 1)[0]  # "3*5+7 = 22" is a common, harmless form
    try:
        tree = parse(expr, _OPTS)
        if Counter(leaf_numbers(tree)) != Counter(Fraction(n) for n in numbers):
            return 0.0
        value = evaluate_exact(tree, _OPTS)
    except ExprError:
        return 0.0
    return 1.0 if value == target else float(format_reward)


def make_countdown_problem(rng: random.Random, num_numbers: int = 3, max_number: int = 20,
                           max_target: int = 200) -> dict:
    """Numbers and a reachable positive integer target (built from a random expression over the numbers)."""
    for _ in range(1000):
        numbers = [rng.randint(1, max_number) for _ in range(num_numbers)]
        order = numbers[:]
        rng.shuffle(order)
        expr = str(order[0])
        for x in order[1:]:
            op = rng.choice("+-*/")
            expr = f"({expr}){op}{x}" if rng.random() < 0.5 else f"{x}{op}({expr})"
        try:
            value = evaluate_exact(parse(expr, _OPTS), _OPTS)
        except ExprError:
            continue
        if value.denominator == 1 and 1 <= value <= max_target:
            return {"numbers": numbers, "target": int(value), "solution": expr}
    raise RuntimeError("could not generate a countdown problem; loosen max_target / max_number")


@Agent.register_subclass("countdown")
class CountdownAgent(PassAtEvaluationAgent):
    """Generated countdown problems. num_numbers: how many numbers; max_number; max_target."""

    num_numbers: int = Field(default=3, ge=2, le=6)
    max_number: int = Field(default=20, ge=1, le=1000)
    max_target: int = Field(default=200, ge=1)
    format_reward: float = Field(default=0.0, ge=0.0, le=1.0)
    validation_size: int = Field(default=200, ge=1)
    stop: list[str] = Field(default_factory=lambda: ["\n"])
    max_tokens: int | None = 48

    def dataset_size(self, validation: bool) -> int | None:
        return self.validation_size if validation else None

    def get_problem(self, index: int, validation: bool) -> dict:
        split = "val" if validation else "train"
        rng = random.Random(f"countdown:{self.seed}:{split}:{index}")
        p = make_countdown_problem(rng, self.num_numbers, self.max_number, self.max_target)
        nums = " ".join(map(str, p["numbers"]))
        p["prompt"] = f"Use {nums} once each with + - * / to make {p['target']}. Answer:"
        p["id"] = f"{split}-{index}"
        return p

    def compute_reward(self, problem: dict, completion: str) -> float:
        return countdown_reward(completion, problem["numbers"], problem["target"], self.format_reward)
