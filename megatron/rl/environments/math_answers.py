r"""GSM8K/MATH-style answer extraction and equivalence checking, safe on untrusted model output.

:func:`extract_answer`: the last ``\boxed{...}``, else after the last ``####``, else after "answer is", else
the last number. :func:`is_equivalent`: normalised LaTeX parsed by the bounded :mod:`safe_expr` parser (never
``eval``/``sympify``); exact rationals, sympy within :func:`expansion_budget`, else numeric comparison, else
normalised strings. Nothing raises.

Normalisation and budget: docs/environments.md.
"""
from __future__ import annotations

import logging
import math
import random
import re

from megatron.rl.environments.safe_expr import (ExprError, Node, ParseOptions, evaluate_exact, evaluate_float,
                                                parse)

logger = logging.getLogger(__name__)

__all__ = ["extract_answer", "normalize_answer", "latex_to_plain", "is_equivalent", "math_reward",
           "expansion_budget"]

_MAX_INPUT = 50_000  # longer completions are malformed (no answer); cutting them could change the answer
_MAX_ANSWER = 500  # longer final answers are not compared
_OPTS = ParseOptions(allow_power=True, allow_unary=True, allow_decimal=True, allow_implicit_mul=True,
                     functions=frozenset({"sqrt"}), constants=frozenset({"pi"}),
                     variables=frozenset("abcdefghjkmnpqrstuvwxyz"),  # not e, i, l, o (constants / look-alikes)
                     max_length=200, max_digits=40, max_depth=32, max_nodes=128, max_exponent=64, max_bits=2048)
# What sympy may be given: measured on 2 CPU cores, simplify() stays well under a second inside these bounds.
_SYMPY_MAX_DEGREE = 16
_SYMPY_MAX_TERMS = 300
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?")

try:  # optional: exact symbolic comparison
    import sympy
except ImportError:  # pragma: no cover - exercised only without sympy
    sympy = None


def _balanced(text: str, open_at: int) -> tuple[str, int] | None:
    """Content of the brace group opening at ``text[open_at] == "{"`` and the index after it."""
    depth = 0
    for i in range(open_at, len(text)):
        if text[i] == "{":
            depth += 1
            if depth > 64:
                return None
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[open_at + 1:i], i + 1
    return None


def extract_answer(completion: str) -> str | None:
    """The final answer in a completion (see the module docstring), or None."""
    if len(completion) > _MAX_INPUT:
        return None
    text = completion
    for marker in ("\\boxed", "\\fbox"):
        start = text.rfind(marker + "{")
        if start >= 0:
            group = _balanced(text, start + len(marker))
            # unclosed: the final answer is malformed; falling through would score a stray number in it
            return group[0].strip() if group is not None else None
    if "####" in text:
        return text.rsplit("####", 1)[1].strip().split("\n", 1)[0].strip()
    m = re.findall(r"answer is[:\s]*([^\n]{1,100})", text, flags=re.IGNORECASE)
    if m:
        return m[-1].strip().rstrip(".")
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def _replace_command(text: str, command: str, nargs: int, fmt: str) -> str:
    """Rewrite ``\\command{a}{b}`` (or the single-character shorthand ``\\frac12``) with ``fmt.format(*args)``."""
    out, i = [], 0
    while True:
        j = text.find(command, i)
        if j < 0:
            out.append(text[i:])
            return "".join(out)
        out.append(text[i:j])
        k = j + len(command)
        args = []
        for _ in range(nargs):
            while k < len(text) and text[k] == " ":
                k += 1
            if k < len(text) and text[k] == "{":
                group = _balanced(text, k)
                if group is None:
                    raise ExprError(f"unbalanced braces after {command}")
                args.append(group[0])
                k = group[1]
            elif k < len(text) and text[k].isalnum():
                args.append(text[k])
                k += 1
            else:
                raise ExprError(f"{command} is missing an argument")
        out.append(fmt.format(*args))
        i = k


def normalize_answer(answer: str) -> str:
    """Strip formatting that does not change the value (see the module docstring)."""
    s = answer.strip()
    if len(s) > _MAX_ANSWER:
        return ""
    s = s.replace("$", "").replace("\\!", "").replace("\\,", "").replace("\\;", "").replace("\\ ", "")
    s = s.replace("\\left", "").replace("\\right", "").replace("\\displaystyle", "")
    s = re.sub(r"\^\{?\\circ\}?", "", s)
    s = s.replace("\\%", "").replace("%", "")
    s = re.sub(r"\\(?:text|mbox|mathrm)\{\s*[A-Za-z ]*\}", lambda m: "" if s.strip() != m.group(0) else m.group(0), s)
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)
    s = re.sub(r"(\d),(\d{3})(?!\d)", r"\1\2", s)  # twice: 1,234,567
    if re.fullmatch(r"\s*[a-zA-Z]\s*=.*", s):
        s = s.split("=", 1)[1]
    s = s.strip().rstrip(".").strip()
    return re.sub(r"\s+", " ", s)


def latex_to_plain(s: str) -> str:
    """LaTeX math into the plain notation :mod:`safe_expr` parses."""
    for frac in ("\\dfrac", "\\tfrac"):
        s = s.replace(frac, "\\frac")
    s = _replace_command(s, "\\frac", 2, "(({0})/({1}))")
    s = _replace_command(s, "\\sqrt", 1, "sqrt({0})")
    s = s.replace("\\pi", " pi ").replace("\\cdot", "*").replace("\\times", "*").replace("\\div", "/")
    s = s.replace("{", "(").replace("}", ")")
    if "\\" in s:
        raise ExprError("unsupported LaTeX command")
    return s


def _to_sympy(tree: Node):
    kind = tree[0]
    if kind == "num":
        return sympy.Rational(tree[1].numerator, tree[1].denominator)
    if kind == "name":
        return sympy.pi if tree[1] == "pi" else sympy.Symbol(tree[1])
    if kind == "neg":
        return -_to_sympy(tree[1])
    if kind == "call":
        return sympy.sqrt(_to_sympy(tree[2]))
    op, a, b = tree[1], _to_sympy(tree[2]), _to_sympy(tree[3])
    if op == "+":
        return a + b
    if op == "-":
        return a - b
    if op == "*":
        return a * b
    if op == "/":
        if b == 0:
            raise ExprError("division by zero")
        return a / b
    if not (b.is_number and abs(float(b)) <= _OPTS.max_exponent):
        raise ExprError("exponent too large or symbolic")
    return a ** b


def expansion_budget(tree: Node) -> tuple[int, int, int]:
    """Upper bounds ``(degree, expanded_terms, bits)`` of what sympy could build from ``tree``. Pure, O(nodes).

    degree: total polynomial degree, counting every name, ``pi`` and ``sqrt(...)`` as an atom of degree 1.
    expanded_terms: monomials of that degree in that many atoms, C(degree + atoms, atoms).
    bits: size of the largest integer a rational evaluation could produce.
    A power whose exponent is not a small rational constant gets ``degree = bits = huge``.
    """
    huge = 1 << 30
    atoms: set[str] = set()

    def walk(t: Node) -> tuple[int, int]:
        kind = t[0]
        if kind == "num":
            return 0, max(t[1].numerator.bit_length(), t[1].denominator.bit_length(), 1)
        if kind == "name":
            atoms.add(t[1])
            return 1, 2
        if kind == "neg":
            return walk(t[1])
        if kind == "call":
            atoms.add(f"{t[1]}#{len(atoms)}")  # each sqrt(...) is its own atom
            d, b = walk(t[2])
            return max(1, d), b
        op = t[1]
        (da, ba), (db, bb) = walk(t[2]), walk(t[3])
        if op in ("+", "-"):
            return max(da, db), max(ba, bb) + 1
        if op in ("*", "/"):
            return da + db, ba + bb
        if db != 0:
            return huge, huge
        try:
            e = evaluate_exact(t[3], _OPTS)
        except ExprError:
            return huge, huge
        n = max(abs(e.numerator), 1)
        return min(da * n, huge), min(ba * n, huge)

    degree, bits = walk(tree)
    terms = math.comb(min(degree, huge) + len(atoms), len(atoms)) if degree <= 4 * _SYMPY_MAX_DEGREE else huge
    return degree, terms, bits


def _sympy_affordable(*trees: Node) -> bool:
    degree = terms = bits = 0
    for t in trees:
        d, n, b = expansion_budget(t)
        degree, terms, bits = max(degree, d), terms + n, max(bits, b)
    return degree <= _SYMPY_MAX_DEGREE and terms <= _SYMPY_MAX_TERMS and bits <= _OPTS.max_bits


def _names(tree: Node) -> set[str]:
    if tree[0] == "name":
        return {tree[1]} - {"pi"}
    return {n for child in tree[1:] if isinstance(child, tuple) for n in _names(child)}


def _numeric_equal(a: Node, b: Node) -> bool:
    names = sorted(_names(a) | _names(b))
    rng = random.Random(0)
    for _ in range(3):
        env = {n: rng.uniform(0.5, 2.5) for n in names}
        x, y = evaluate_float(a, env, _OPTS), evaluate_float(b, env, _OPTS)
        if not math.isclose(x, y, rel_tol=1e-9, abs_tol=1e-12):
            return False
    return True


def _trees_equal(a: Node, b: Node) -> bool:
    try:
        return evaluate_exact(a, _OPTS) == evaluate_exact(b, _OPTS)
    except ExprError:
        pass  # names, sqrt or a non-integer power: symbolic / numeric comparison below
    if sympy is not None and _sympy_affordable(a, b):
        diff = _to_sympy(a) - _to_sympy(b)
        if sympy.count_ops(diff) <= 200:
            return bool(sympy.simplify(diff) == 0)
    return _numeric_equal(a, b)


def is_equivalent(given: str | None, reference: str) -> bool:
    """Whether two final answers denote the same value (see the module docstring); never raises."""
    if given is None:
        return False
    g, r = normalize_answer(given), normalize_answer(str(reference))
    if not g:
        return False
    if g == r:
        return True
    try:
        return _trees_equal(parse(latex_to_plain(g), _OPTS), parse(latex_to_plain(r), _OPTS))
    except (ExprError, ArithmeticError, ValueError, TypeError, RecursionError) as e:
        logger.debug("answer %.80r vs %.80r not comparable: %s", g, r, e)
        return g.replace(" ", "") == r.replace(" ", "")
    except Exception as e:  # noqa: BLE001 - the promise is "never raises": sympy internals, MemoryError
        logger.warning("answer %.80r vs %.80r: comparison failed (%s); scored as not equivalent",
                       g, r, type(e).__name__)
        return False


def math_reward(completion: str, reference: str) -> float:
    """1.0 when the completion's extracted final answer is equivalent to ``reference``, else 0.0."""
    return 1.0 if is_equivalent(extract_answer(completion), reference) else 0.0
