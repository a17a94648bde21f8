"""type: reasoning_gym against the real reasoning-gym package: prompts, rewards from the task's own scorer,
DP sharding and resume, the three-task example mix with an evaluation-only task, and configuration errors."""
import asyncio
import json
from collections import Counter

import pytest

from megatron.rl.agent.api import EvaluationRequest, GroupedRolloutRequest
from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.fake import FakeInference
from tests.conftest import REPO_ROOT

rg = pytest.importorskip("reasoning_gym", reason="reasoning-gym is not installed (pip install 'megatron-rl[envs]')")

from megatron.rl.environments.reasoning_gym_env import ReasoningGymAgent  # noqa: E402

MIX = REPO_ROOT / "examples" / "rl" / "environment_configs" / "reasoning_gym_mix.yaml"
FROM_QUICKSTART = REPO_ROOT / "examples" / "rl" / "environment_configs" / "reasoning_gym_quickstart.yaml"
SMALL_SUMS = {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1, "operators": ["+"],
              "allow_parentheses": False, "allow_negation": False}


def _agent(**kw):
    args = {"task": "basic_arithmetic", "config": SMALL_SUMS, "answer_regex": r"(-?\d+)", "size": 40}
    return ReasoningGymAgent(**{**args, **kw})


def test_problems_are_the_tasks_and_rewards_its_own_scorer():
    agent = _agent(seed=11, prompt_template="Q: {metadata[expression]}=? A:", prompt_replacements={" ": ""})
    reference = rg.create_dataset("basic_arithmetic", seed=11, size=40, **SMALL_SUMS)
    for i in range(10):
        p, entry = agent.get_problem(i, False), reference[i]
        a, b = (int(x) for x in entry["metadata"]["expression"].split(" + "))
        assert p["prompt"] == f"Q: {a}+{b}=? A:" and entry["answer"] == str(a + b)
        assert agent.compute_reward(p, f" {a + b}\n") == 1.0
        assert agent.compute_reward(p, "no digits") == reference.score_answer(None, entry) == 0.0
        wrong = str(a + b + 7)
        assert agent.compute_reward(p, wrong) == reference.score_answer(wrong, entry)
    # default prompt: the task's question, the instruction on its own line
    plain = _agent(seed=11, instruction="Only the number.")
    assert plain.get_problem(3, False)["prompt"] == reference[3]["question"] + "\nOnly the number."
    assert _agent(chat=True).make_prompt(plain.get_problem(0, False))[0]["role"] == "user"


def test_the_answer_is_what_the_completion_committed_to():
    agent = _agent(seed=11, stop=["\n"], answer_regex=None, answer_format="number")
    p = agent.get_problem(0, False)
    right = p["entry"]["answer"]
    assert agent.compute_reward(p, f" {right}\n") == 1.0 and agent.compute_reward(p, f"{right}") == 1.0
    assert agent.compute_reward(p, f" {right}\nanything after the stop string") == 1.0
    assert agent.compute_reward(p, f"{right}=?{right}===") == 0.0  # not one number
    assert agent.compute_reward(p, f"x {right}\n") == 0.0
    # a regex matches the whole committed text
    assert _agent(seed=11, stop=["\n"]).compute_reward(p, f"{right} and more") == 0.0
    assert _agent(seed=11, stop=["\n"], answer_regex=r"(?s).*?(-?\d+).*").compute_reward(p, f"{right} and more") == 1.0


def test_a_constant_completion_no_longer_scores_on_the_example_products_task():
    """'0=?0====' contains the answer to every product with a zero factor: the first-integer regex the docs used
    to recommend scored it there (a policy learned to emit it); the example config's committed-number answer
    does not, while the honest answer still scores."""
    import re

    agent = build_agent_from_config(FROM_QUICKSTART, seed=1)
    products = next(e.agent for e in agent.entries if e.name == "products")
    assert products.task == "products" and products.answer_format == "number"
    zero = [p for p in (products.get_problem(i, v) for v in (False, True) for i in range(200))
            if "0" in p["entry"]["metadata"]["expression"].split(" * ")]
    assert len(zero) >= 5
    for p in zero:
        assert p["prompt"].startswith("Q: ") and p["prompt"].endswith("=? A:") and p["entry"]["answer"] == "0"
        old_answer = re.search(r"(-?\d+)", "0=?0====").group(1)  # the old documented extraction
        dataset = products._dataset(p["id"].startswith("val"))
        assert dataset.score_answer(answer=old_answer, entry=p["entry"]) == 1.0
        assert products.compute_reward(p, "0=?0====") == 0.0
        assert products.compute_reward(p, " 0\n") == 1.0


def test_every_documented_reasoning_gym_entry_takes_a_committed_number():
    for path in (MIX, FROM_QUICKSTART):
        for e in build_agent_from_config(path, seed=1).entries:
            assert e.agent.answer_format == "number" and e.agent.answer_regex is None and e.agent.stop == ["\n"]


def test_prompts_are_sharded_by_rank_and_resume_from_state():
    def draw(agent, n):
        out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
            num_groups=n, rollouts_per_group=2, inference_interface=FakeInference(),
            generation_args=GenerationArgs(max_tokens=3, seed=1))))
        return [g.problem_id for g in out.groups]

    ranks = [_agent(seed=5), _agent(seed=5)]
    for r, a in enumerate(ranks):
        a.set_data_parallel(r, 2)
    drawn = [draw(a, 20) for a in ranks]
    assert not set(drawn[0]) & set(drawn[1])
    assert sorted(drawn[0] + drawn[1]) == sorted(f"train-{i}" for i in range(40))  # one epoch, each prompt once

    a = _agent(seed=5)
    draw(a, 7)
    state = json.loads(json.dumps(a.state_dict()))
    expected = draw(a, 5)
    resumed = _agent(seed=5)
    resumed.load_state_dict(state)
    assert draw(resumed, 5) == expected


def test_three_task_mix_with_an_evaluation_only_task():
    agent = build_agent_from_config(MIX, seed=3)
    assert [(e.name, e.weight, e.evaluation_only) for e in agent.entries] == [
        ("arithmetic", 2.0, False), ("chain_sum", 1.0, False), ("letters", 1.0, False), ("gcd", 1.0, True)]
    expected = agent.allocation(8)
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=8, rollouts_per_group=2, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=4, seed=1))))
    assert Counter(g.env_id for g in out.groups) == expected and set(expected) == {"arithmetic", "chain_sum", "letters"}
    assert all(r.ok for g in out.groups for r in g.rollouts)
    ev = asyncio.run(agent.evaluate(EvaluationRequest(
        num_prompts=6, num_samples=2, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=4, seed=1))))
    for name in ("arithmetic", "chain_sum", "letters", "gcd"):  # the evaluation-only task is evaluated too
        assert ev.metrics[f"{name}/num_prompts"] == 6 and f"{name}/pass@1" in ev.metrics


@pytest.mark.parametrize("args, piece", [
    ({"task": "no_such_task"}, "reasoning-gym has no task 'no_such_task'"),
    ({"task": "basic_arithmetic", "config": {"min_terms": 5, "max_terms": 2}}, "rejected config"),
    ({"task": "basic_arithmetic", "config": {"seed": 3}}, "must not set ['seed']"),
    ({"task": "basic_arithmetic", "prompt_template": "{question.__class__}"}, "is not allowed"),
    ({"task": "basic_arithmetic", "prompt_template": "{metadata[nope]}"}, "does not fit task"),
    ({"task": "basic_arithmetic", "answer_regex": "("}, "does not compile"),
    ({"task": "basic_arithmetic", "answer_format": "first_integer"}, "answer_format"),
    ({"task": "basic_arithmetic", "answer_format": "number", "answer_regex": "\\d+"}, "give one"),
])
def test_configuration_errors_name_the_problem(args, piece):
    with pytest.raises(EnvConfigError) as e:
        build_agent_from_config([{"type": "reasoning_gym", "args": args}])
    assert piece in str(e.value) and "environments[0]" in str(e.value)
