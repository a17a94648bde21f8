"""The shared answer extraction: the committed text, the formats, and the environments' exact formats unchanged."""
import random
import re

import pytest

from megatron.rl.agent.answers import (NUMBER, committed_answer, committed_text, extract_answer, last_number,
                                              last_tag)
from megatron.rl.environments.arithmetic import arithmetic_reward


def test_committed_text_ends_at_the_earliest_stop_string():
    assert committed_text(" 12\nmore", ["\n"]) == " 12"
    assert committed_text("a</s>b\nc", ["\n", "</s>"]) == "a"
    assert committed_text("no stop", ["\n"]) == "no stop" and committed_text("all", []) == "all"
    assert committed_text("x\ny", ["", "\n"]) == "x"  # an empty stop string stops nothing


@pytest.mark.parametrize("completion, fmt, stop, answer", [
    ("  42 \n", "text", (), "42"),
    (" 42\nthen 7", "text", ["\n"], "42"),
    (" -3\n", "number", ["\n"], "-3"),
    ("1,234.5", "number", (), "1,234.5"),
    ("+7", "number", (), "+7"),
    ("0=?0====", "number", ["\n"], None),
    ("x = -3, y = 4", "number", (), None),
    ("12 apples", "number", (), None),
    ("1,23", "number", (), None),
    ("so <answer>7</answer> or <answer> 8 </answer>", "tag", (), "8"),
    ("7", "tag", (), None),
])
def test_formats(completion, fmt, stop, answer):
    assert extract_answer(completion, fmt, stop=stop) == answer


def test_a_regex_must_match_all_of_the_committed_text():
    first_int = re.compile(r"(-?\d+)")
    assert extract_answer("0=?0====", pattern=first_int) is None
    assert extract_answer(" 15 \n", pattern=first_int, stop=["\n"]) == "15"
    assert extract_answer("the answer is 4.", pattern=re.compile(r"(?s).*answer is (-?\d+)\.?")) == "4"
    assert extract_answer("none", pattern=re.compile(r"\d+")) is None
    assert committed_answer(" 5 ", re.compile(r" ?(\d) *"), strip=False) == "5"
    assert committed_answer("  5", re.compile(r" ?(\d) *"), strip=False) is None
    assert committed_answer("5" * 70, re.compile(r"\d+"), max_chars=64) is None
    with pytest.raises(ValueError, match="answer format 'first'"):
        extract_answer("1", "first")


def test_tags_and_last_numbers_are_bounded():
    assert last_tag("<answer>" + "x" * 500 + "</answer>") is None  # longer than an answer
    assert last_tag("y" * 10_001 + "<answer>1</answer>") is None  # past the scanned prefix
    assert last_number("about 1,200 then 35.5 units") == "35.5" and last_number("none") is None
    assert NUMBER.fullmatch("-0012") and not NUMBER.fullmatch("1e5")


def _arithmetic_reward_before(completion, answer):
    """The arithmetic task's scoring as it was written before the shared module (the quickstart's figures)."""
    head = completion.split("\n", 1)[0]
    if len(head) > 64:
        return 0.0
    m = re.compile(r" ?(-?\d{1,40})").fullmatch(head.rstrip(" "))
    return 1.0 if m is not None and m.group(1) == str(int(answer)) else 0.0


def test_arithmetic_scores_every_completion_as_before():
    rng = random.Random(0)
    alphabet = [" ", "  ", "\n", "-", "=", "?", "1", "2", "7", "0", "x", "\t"]
    cases = [" 12\n", "12", " 12 \n", "  12\n", " -3\n", " 12\n13", "=12", " 0012\n", " " + "1" * 70]
    cases += ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(5000)]
    for completion in cases:
        for answer in (12, -3, 1, 7, 0, 2):
            assert arithmetic_reward(completion, answer) == _arithmetic_reward_before(completion, answer), completion
