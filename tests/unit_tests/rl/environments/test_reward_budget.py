"""Short answers that denote huge work must score quickly, in bounded memory, and never raise; an unclosed
``\\boxed{`` is no answer.

The bombs run in a child process with an address-space limit and a wall-clock timeout, so a reward function
without the bounds fails this test (MemoryError / timeout) instead of hanging the test session for minutes.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron.rl.environments.math_answers import expansion_budget, extract_answer, math_reward
from megatron.rl.environments.safe_expr import parse
from tests.conftest import REPO_ROOT

# (completion, reference, expected reward)
BOMBS = [
    ("\\boxed{(a+b+c+d)^{64}}", "2", 0.0),
    ("\\boxed{(a+b+c+d)^{64}}", "(d+c+b+a)^{64}", 1.0),  # over the sympy budget: compared numerically
    ("\\boxed{(a+b+c+d)^{64}}", "(a+b+c+d)^{63}", 0.0),
    ("\\boxed{(((((2^{64})^{64})^{64})^{64})^{64})}", "2", 0.0),
    ("\\boxed{(((((x^{64})^{64})^{64})^{64})^{64})}", "x", 0.0),
    ("\\boxed{(a+b)^{64}(c+d)^{64}-(a+b+c+d)^{64}}", "0", 0.0),
    ("\\boxed{(\\sqrt{2}+\\pi)^{64}}", "1", 0.0),
]

_CHILD = r"""
import json, resource, sys, time
resource.setrlimit(resource.RLIMIT_AS, (1 << 31, 1 << 31))  # 2 GiB: the power tower needed 3.4 GB
from megatron.rl.environments.math_answers import math_reward
out = []
for completion, reference in json.loads(sys.argv[1]):
    t = time.perf_counter()
    try:
        value = math_reward(completion, reference)
    except BaseException as e:
        value = f"raised {type(e).__name__}"
    out.append({"value": value, "seconds": time.perf_counter() - t})
print(json.dumps({"results": out, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def test_math_reward_bombs_are_bounded_and_never_raise():
    pairs = [(c, r) for c, r, _ in BOMBS]
    try:
        proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(pairs)], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("math_reward did not finish the bombs within 90 s (expansion not bounded)")
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    got = [r["value"] for r in report["results"]]
    assert got == [want for _, _, want in BOMBS], list(zip(pairs, report["results"]))


def test_expansion_budget_bounds():
    degree, terms, _ = expansion_budget(parse("(a+b+c+d)^64", _opts()))
    assert degree == 64 and terms > 40_000
    _, _, bits = expansion_budget(parse("((2^64)^64)^64", _opts()))
    assert bits >= 64 ** 3
    assert expansion_budget(parse("x^2+2*x+1", _opts())) == (2, 3, 6)  # C(2+1, 1) monomials; bits: a loose bound
    # small answers still get the exact symbolic comparison
    assert math_reward("\\boxed{x^2+2x+1}", "(x+1)^2") == 1.0
    assert math_reward("\\boxed{(a+b)^3}", "a^3+3a^2 b+3a b^2+b^3") == 1.0


def _opts():
    from megatron.rl.environments import math_answers

    return math_answers._OPTS


@pytest.mark.parametrize("completion", ["so \\boxed{7", "the answer is 7 \\boxed{7", "\\boxed{\\frac{7}{1}"])
def test_unclosed_boxed_is_no_answer(completion):
    assert extract_answer(completion) is None
    assert math_reward(completion, "7") == 0.0
    assert math_reward("so \\boxed{7}", "7") == 1.0
