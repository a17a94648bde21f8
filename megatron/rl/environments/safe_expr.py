"""A small, bounded arithmetic-expression parser and exact evaluator for reward functions.

Model outputs are untrusted: never passed to ``eval``, ``ast`` evaluation or ``sympy.sympify``. Accepts numbers,
``+ - * /``, optional ``^``/``**``, parentheses and (when enabled) whitelisted names. Input length, literal
length, nesting depth, exponents and result bits are bounded, so adversarial input fails fast with
:class:`ExprError`.

Grammar and bounds: docs/environments.md.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Callable

from megatron.rl.base.errors import RLError

__all__ = ["ExprError", "ParseOptions", "parse", "evaluate_exact", "evaluate_float", "leaf_numbers", "Node"]


class ExprError(RLError, ValueError):
    """The text is not a valid, bounded expression (the reward function scores it 0)."""


@dataclass(frozen=True)
class ParseOptions:
    allow_power: bool = False
    allow_unary: bool = True
    allow_decimal: bool = True
    allow_implicit_mul: bool = False
    functions: frozenset[str] = frozenset()
    constants: frozenset[str] = frozenset()
    variables: frozenset[str] = frozenset()
    max_length: int = 512
    max_digits: int = 30
    max_depth: int = 64
    max_nodes: int = 256
    max_exponent: int = 64
    max_bits: int = 4096


# Nodes are tuples: ("num", Fraction) | ("name", str) | ("neg", node) | ("bin", op, a, b) | ("call", f, node)
Node = tuple

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d+)?)|(\*\*|[-+*/^()])|([A-Za-z]+))")


def _tokenize(text: str, opts: ParseOptions) -> list[tuple[str, str]]:
    if len(text) > opts.max_length:
        raise ExprError(f"expression longer than {opts.max_length} characters")
    tokens, pos = [], 0
    text = text.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExprError(f"unexpected character {text[pos]!r} at {pos}")
        num, op, name = m.groups()
        if num is not None:
            if len(num) > opts.max_digits:
                raise ExprError(f"number literal longer than {opts.max_digits} digits")
            if "." in num and not opts.allow_decimal:
                raise ExprError("decimal numbers are not allowed")
            tokens.append(("num", num))
        elif op is not None:
            if op in ("^", "**") and not opts.allow_power:
                raise ExprError("powers are not allowed")
            tokens.append(("op", "^" if op == "**" else op))
        else:
            tokens.append(("name", name))
        pos = m.end()
    return tokens


class _Parser:
    def __init__(self, tokens: list[tuple[str, str]], opts: ParseOptions):
        self.toks, self.i, self.opts, self.depth, self.nodes = tokens, 0, opts, 0, 0

    def peek(self) -> tuple[str, str] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self) -> tuple[str, str]:
        tok = self.peek()
        if tok is None:
            raise ExprError("unexpected end of expression")
        self.i += 1
        return tok

    def node(self, *parts: Any) -> Node:
        self.nodes += 1
        if self.nodes > self.opts.max_nodes:
            raise ExprError(f"expression has more than {self.opts.max_nodes} nodes")
        return tuple(parts)

    def enter(self) -> None:
        self.depth += 1
        if self.depth > self.opts.max_depth:
            raise ExprError(f"expression nested deeper than {self.opts.max_depth}")

    def expr(self) -> Node:
        self.enter()
        left = self.term()
        while (tok := self.peek()) is not None and tok in (("op", "+"), ("op", "-")):
            self.take()
            left = self.node("bin", tok[1], left, self.term())
        self.depth -= 1
        return left

    def _starts_atom(self, tok: tuple[str, str] | None) -> bool:
        return tok is not None and (tok[0] in ("num", "name") or tok == ("op", "("))

    def term(self) -> Node:
        left = self.unary()
        while True:
            tok = self.peek()
            if tok in (("op", "*"), ("op", "/")):
                self.take()
                left = self.node("bin", tok[1], left, self.unary())
            elif self.opts.allow_implicit_mul and self._starts_atom(tok):
                left = self.node("bin", "*", left, self.power())
            else:
                return left

    def unary(self) -> Node:
        tok = self.peek()
        if tok in (("op", "-"), ("op", "+")):
            if not self.opts.allow_unary:
                raise ExprError("unary signs are not allowed")
            self.take()
            self.enter()
            operand = self.unary()
            self.depth -= 1
            return operand if tok[1] == "+" else self.node("neg", operand)
        return self.power()

    def power(self) -> Node:
        base = self.atom()
        if self.peek() == ("op", "^"):
            self.take()
            self.enter()
            exponent = self.unary()
            self.depth -= 1
            return self.node("bin", "^", base, exponent)
        return base

    def atom(self) -> Node:
        kind, value = self.take()
        if kind == "num":
            return self.node("num", Fraction(value))
        if kind == "name":
            if value in self.opts.functions:
                if self.take() != ("op", "("):
                    raise ExprError(f"{value} needs parentheses")
                arg = self.expr()
                if self.take() != ("op", ")"):
                    raise ExprError("missing ')'")
                return self.node("call", value, arg)
            if value in self.opts.constants or value in self.opts.variables:
                return self.node("name", value)
            raise ExprError(f"unknown name {value!r}")
        if value == "(":
            inner = self.expr()
            if self.take() != ("op", ")"):
                raise ExprError("missing ')'")
            return inner
        raise ExprError(f"unexpected {value!r}")


def parse(text: str, opts: ParseOptions = ParseOptions()) -> Node:
    """Parse ``text`` into a tuple tree; raises :class:`ExprError` on anything invalid or too large."""
    parser = _Parser(_tokenize(text, opts), opts)
    if not parser.toks:
        raise ExprError("empty expression")
    tree = parser.expr()
    if parser.peek() is not None:
        raise ExprError(f"unexpected {parser.peek()[1]!r} after the expression")
    return tree


def leaf_numbers(tree: Node) -> list[Fraction]:
    """The number literals in ``tree``, left to right."""
    if tree[0] == "num":
        return [tree[1]]
    if tree[0] == "name":
        return []
    return [n for child in tree[1:] if isinstance(child, tuple) for n in leaf_numbers(child)]


def _check_power(base_bits: float, exponent: int, opts: ParseOptions) -> None:
    if abs(exponent) > opts.max_exponent:
        raise ExprError(f"exponent {exponent} exceeds {opts.max_exponent}")
    if base_bits * abs(exponent) > opts.max_bits:
        raise ExprError(f"power result would exceed {opts.max_bits} bits")


def evaluate_exact(tree: Node, opts: ParseOptions = ParseOptions()) -> Fraction:
    """Exact rational value of a tree without names; raises :class:`ExprError` (incl. division by zero)."""
    kind = tree[0]
    if kind == "num":
        return tree[1]
    if kind == "neg":
        return -evaluate_exact(tree[1], opts)
    if kind == "bin":
        op, a, b = tree[1], evaluate_exact(tree[2], opts), evaluate_exact(tree[3], opts)
        if op == "+":
            out = a + b
        elif op == "-":
            out = a - b
        elif op == "*":
            out = a * b
        elif op == "/":
            if b == 0:
                raise ExprError("division by zero")
            out = a / b
        else:
            if b.denominator != 1:
                raise ExprError("non-integer exponents have no exact rational value")
            e = int(b)
            _check_power(max(a.numerator.bit_length(), a.denominator.bit_length()), e, opts)
            if a == 0 and e < 0:
                raise ExprError("division by zero")
            out = a ** e
        if max(out.numerator.bit_length(), out.denominator.bit_length()) > opts.max_bits:
            raise ExprError(f"intermediate value exceeds {opts.max_bits} bits")
        return out
    raise ExprError(f"{tree[1]!r} has no exact rational value")


_FLOAT_FUNCS: dict[str, Callable[[float], float]] = {"sqrt": math.sqrt, "exp": math.exp, "ln": math.log,
                                                     "log": math.log, "sin": math.sin, "cos": math.cos,
                                                     "tan": math.tan}
_FLOAT_CONSTS = {"pi": math.pi, "e": math.e}


def evaluate_float(tree: Node, env: dict[str, float] | None = None, opts: ParseOptions = ParseOptions()) -> float:
    """Floating-point value (for names/functions); variables come from ``env``; bounded like the exact one."""
    env = env or {}
    kind = tree[0]
    try:
        if kind == "num":
            return float(tree[1])
        if kind == "name":
            if tree[1] in env:
                return env[tree[1]]
            return _FLOAT_CONSTS[tree[1]]
        if kind == "neg":
            return -evaluate_float(tree[1], env, opts)
        if kind == "call":
            return _FLOAT_FUNCS[tree[1]](evaluate_float(tree[2], env, opts))
        op, a, b = tree[1], evaluate_float(tree[2], env, opts), evaluate_float(tree[3], env, opts)
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b
        if abs(b) > opts.max_exponent:
            raise ExprError(f"exponent {b} exceeds {opts.max_exponent}")
        out = a ** b
        if isinstance(out, complex) or not math.isfinite(out):
            raise ExprError("power has no finite real value")
        return out
    except (ArithmeticError, ValueError, KeyError) as e:
        if isinstance(e, ExprError):
            raise
        raise ExprError(f"cannot evaluate: {e}") from None
