"""pass@k estimator vs brute-force enumeration of size-k subsets, and PassAtEvaluationAgent.evaluate."""
import asyncio
import itertools
from fractions import Fraction

import pytest

from megatron.rl.agent.api import Agent, EvaluationRequest
from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent, pass_at_k
from megatron.rl.inference.api import GenerationArgs
from megatron.rl.inference.fake import FakeInference


def brute_force(n, c, k):
    samples = [1] * c + [0] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return Fraction(sum(any(samples[i] for i in s) for s in subsets), len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_matches_brute_force(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force(n, c, k)), abs=1e-12), (n, c, k)


def test_large_n_is_stable_and_pass1_is_the_mean():
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    assert pass_at_k(1000, 250, 1) == pytest.approx(0.25)
    v = pass_at_k(10_000, 3, 100)
    assert 0 < v < 1 and v == pytest.approx(1 - (1 - 100 / 10_000) ** 3, rel=1e-3)
    with pytest.raises(ValueError):
        pass_at_k(3, 4, 1)
    with pytest.raises(ValueError):
        pass_at_k(3, 1, 4)


@Agent.register_subclass("test_first_char_agent")
class FirstCharAgent(PassAtEvaluationAgent):
    """Correct iff the first generated character is in ``good`` (so correctness is random but checkable)."""

    good: str = "abcdefghijklm"

    def dataset_size(self, validation):
        return 6

    def get_problem(self, index, validation):
        return {"prompt": f"#{index}", "id": f"q{index}"}

    def compute_reward(self, problem, completion):
        return float(bool(completion) and completion[0] in self.good)


def test_evaluate_reports_pass_at_k_and_greedy():
    agent = FirstCharAgent()
    req = EvaluationRequest(num_samples=5, ks=[1, 3, 5], inference_interface=FakeInference(),
                            generation_args=GenerationArgs(max_tokens=2, seed=0, temperature=1.5))
    out = asyncio.run(agent.evaluate(req))
    assert out.metrics["num_prompts"] == 6 and len(out.results) == 6
    for r in out.results:
        assert r.num_correct == sum(x >= 1.0 for x in r.rewards)
        for k in (1, 3, 5):
            assert r.pass_at_k[k] == pytest.approx(float(brute_force(5, r.num_correct, k)))
        assert r.greedy_reward == float(r.greedy_completion[:1] in list(agent.good))
    assert out.metrics["pass@1"] == pytest.approx(sum(r.num_correct for r in out.results) / 30)
    assert out.metrics["pass@1"] <= out.metrics["pass@3"] <= out.metrics["pass@5"]
    assert out.metrics["greedy_accuracy"] == pytest.approx(sum(r.greedy_reward for r in out.results) / 6)
    # the greedy decode really is greedy: identical on a second run with another seed
    again = asyncio.run(agent.evaluate(req.model_copy(update={
        "generation_args": GenerationArgs(max_tokens=2, seed=99, temperature=1.5)})))
    assert [r.greedy_completion for r in again.results] == [r.greedy_completion for r in out.results]
    # DP ranks split the validation prompts
    agent.set_data_parallel(1, 2)
    assert [r.problem_id for r in asyncio.run(agent.evaluate(req)).results] == ["q1", "q3", "q5"]


def test_evaluation_request_validates_ks():
    with pytest.raises(ValueError, match="1 <= k <= num_samples"):
        EvaluationRequest(num_samples=2, ks=[3])
