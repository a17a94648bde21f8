r"""Arithmetic: the embedded default task, small enough for a tiny byte-level GPT to learn on a CPU.

Problems are generated (no data files), e.g. prompt ``"Q: 12+7*3=? A:"``, completion ``" 33\n"`` (the newline
is the end marker and the stop string). Reward 1.0 when the text before the first end marker is exactly the
answer (one optional leading space), else 0.0. :func:`pretraining_text` / :func:`write_pretraining_corpus`
write the same format, optionally noised, to pretrain a partly-right policy.

Details: docs/environments.md.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import ClassVar, Iterator

from pydantic import Field, model_validator

from megatron.rl.agent.answers import committed_answer
from megatron.rl.environments.safe_expr import ParseOptions, evaluate_exact, parse
from megatron.rl.agent.api import Agent
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent

__all__ = ["ArithmeticAgent", "make_problem", "format_prompt", "format_example",
           "arithmetic_reward", "pretraining_text", "write_pretraining_corpus", "END_MARKER"]

END_MARKER = "\n"
_ANSWER = re.compile(r" ?(-?\d{1,40}) *")  # the committed text, all of it
_PARSE_OPTS = ParseOptions(allow_unary=False, allow_decimal=False)


def format_prompt(expression: str) -> str:
    return f"Q: {expression}=? A:"


def format_example(expression: str, answer: int | str) -> str:
    """One pretraining example: prompt, a space, the answer and the end marker."""
    return f"{format_prompt(expression)} {answer}{END_MARKER}"


def make_problem(rng: random.Random, min_operands: int = 2, max_operands: int = 2, min_digits: int = 1,
                 max_digits: int = 2, operators: str = "+-") -> dict:
    """A random problem ``{"expression", "answer", "prompt"}``; the answer is exact (integer arithmetic)."""
    n = rng.randint(min_operands, max_operands)
    parts = []
    for i in range(n):
        digits = rng.randint(min_digits, max_digits)
        lo = 0 if digits == 1 else 10 ** (digits - 1)
        parts.append(str(rng.randint(lo, 10 ** digits - 1)))
        if i < n - 1:
            parts.append(rng.choice(operators))
    expression = "".join(parts)
    answer = evaluate_exact(parse(expression, _PARSE_OPTS))
    return {"expression": expression, "answer": int(answer), "prompt": format_prompt(expression)}


def arithmetic_reward(completion: str, answer: int) -> float:
    """1.0 iff the text before the first end marker is exactly ``answer`` (one optional leading space,
    trailing spaces allowed, at most 64 characters)."""
    got = committed_answer(completion, _ANSWER, (END_MARKER,), strip=False, max_chars=64)
    return 1.0 if got is not None and got == str(int(answer)) else 0.0


def _wrong_answer(rng: random.Random, answer: int) -> int:
    """A plausible wrong answer: off by a little, a digit changed, or a random number of similar size."""
    kind = rng.random()
    if kind < 0.4:
        wrong = answer + rng.choice([-1, 1]) * rng.randint(1, 10)
    elif kind < 0.7 and abs(answer) >= 10:
        s = list(str(abs(answer)))
        i = rng.randrange(len(s))
        s[i] = str((int(s[i]) + rng.randint(1, 9)) % 10)
        wrong = int("".join(s)) * (1 if answer >= 0 else -1)
    else:
        wrong = rng.randint(-abs(answer) - 10, abs(answer) * 2 + 10)
    return wrong if wrong != answer else answer + 1


@Agent.register_subclass("arithmetic")
class ArithmeticAgent(PassAtEvaluationAgent):
    """Generated arithmetic problems with difficulty knobs (see the module docstring).

    min/max_operands: operands per problem. min/max_digits: digits per operand. operators: subset of "+-*".
    validation_size: number of fixed validation problems (drawn from a separate seed).
    """

    min_operands: int = Field(default=2, ge=2, le=8)
    max_operands: int = Field(default=2, ge=2, le=8)
    min_digits: int = Field(default=1, ge=1, le=9)
    max_digits: int = Field(default=2, ge=1, le=9)
    operators: str = "+-"
    validation_size: int = Field(default=200, ge=1)
    stop: list[str] = Field(default_factory=lambda: [END_MARKER])
    max_tokens: int | None = 16
    inline_rewards: ClassVar[bool] = True  # arithmetic_reward reads at most 64 characters

    @model_validator(mode="after")
    def _check_knobs(self) -> "ArithmeticAgent":
        if self.min_operands > self.max_operands:
            raise ValueError(f"min_operands={self.min_operands} > max_operands={self.max_operands}")
        if self.min_digits > self.max_digits:
            raise ValueError(f"min_digits={self.min_digits} > max_digits={self.max_digits}")
        if not self.operators or set(self.operators) - set("+-*"):
            raise ValueError(f"operators must be a non-empty subset of '+-*', got {self.operators!r}")
        return self

    def _knobs(self) -> dict:
        return dict(min_operands=self.min_operands, max_operands=self.max_operands, min_digits=self.min_digits,
                    max_digits=self.max_digits, operators=self.operators)

    def dataset_size(self, validation: bool) -> int | None:
        return self.validation_size if validation else None

    def get_problem(self, index: int, validation: bool) -> dict:
        # String seeds are hashed with sha512: the same problem on every machine and Python version.
        rng = random.Random(f"arithmetic:{self.seed}:{'val' if validation else 'train'}:{index}")
        problem = make_problem(rng, **self._knobs())
        problem["id"] = f"{'val' if validation else 'train'}-{index}"
        return problem

    def compute_reward(self, problem: dict, completion: str) -> float:
        return arithmetic_reward(completion, int(problem["answer"]))


def pretraining_text(num_examples: int, seed: int = 0, noise: float = 0.0, min_operands: int = 2,
                     max_operands: int = 2, min_digits: int = 1, max_digits: int = 2,
                     operators: str = "+-") -> Iterator[str]:
    """Pretraining examples ``"Q: 12+7=? A: 19\\n"``; with probability ``noise`` the answer is wrong.

    Use a seed different from the RL agent's so the model is not pretrained on the RL problems verbatim.
    """
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = random.Random(f"arithmetic-pretrain:{seed}")
    for _ in range(num_examples):
        p = make_problem(rng, min_operands, max_operands, min_digits, max_digits, operators)
        answer = _wrong_answer(rng, p["answer"]) if rng.random() < noise else p["answer"]
        yield format_example(p["expression"], answer)


def write_pretraining_corpus(path: str | Path, num_documents: int, examples_per_document: int = 16,
                             **kwargs) -> Path:
    """Write a JSONL corpus ``{"text": ...}`` (each document several examples) for ``tools/preprocess_data.py``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    examples = pretraining_text(num_documents * examples_per_document, **kwargs)
    with path.open("w", encoding="utf-8") as f:
        for _ in range(num_documents):
            text = "".join(next(examples) for _ in range(examples_per_document))
            f.write(json.dumps({"text": text}) + "\n")
    return path


if __name__ == "__main__":  # python -m megatron.rl.environments.arithmetic OUT.jsonl N [noise]
    import sys

    out, n = sys.argv[1], int(sys.argv[2])
    write_pretraining_corpus(out, n, noise=float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
