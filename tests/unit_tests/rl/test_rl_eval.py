"""Evaluation: pass@k through the trainer's request and DP merge vs the estimator by hand; table; flags."""
import asyncio
import types
from math import comb

import pytest

from megatron.rl.agent.pass_at_evaluation_agent import PassAtEvaluationAgent
from megatron.rl.agent.weighted_multi_task import TaskEntry, WeightedMultiTaskAgent
from megatron.rl.inference.api import InferenceInterface, InferenceResponse
from megatron.rl.observe.config import ObserveConfig
from megatron.rl.rl_eval import evaluation_request, format_eval_line, format_eval_table, merge_eval_metrics
from megatron.rl.training.config import ConfigError
from tests.unit_tests.rl.test_rl_config import _rl, env_yaml  # noqa: F401 (a fixture)

N = 8  # samples per prompt
CORRECT = {"easy": [8, 5, 3, 1, 0], "hard": [0, 1, 0]}  # correct samples of each prompt


class ScriptedInference(InferenceInterface):
    """Prompt ``<env>:<i>``: of its n samples the first ``CORRECT[env][i]`` say "right", the rest "wrong"."""

    async def agenerate(self, requests):
        out = []
        for req in requests:
            env, i = req.prompt.split(":")
            for j in range(req.generation_args.n):
                text = "right" if j < CORRECT[env][int(i)] else "wrong"
                out.append(InferenceResponse(text=text, token_ids=[1, 2, 3], prompt_length=1, finish_reason="stop"))
        return out


class Scripted(PassAtEvaluationAgent):
    task: str

    def dataset_size(self, validation):
        return len(CORRECT[self.task])

    def get_problem(self, index, validation):
        return {"prompt": f"{self.task}:{index}", "id": f"{self.task}{index}"}

    def compute_reward(self, problem, completion):
        return float(completion == "right")


def by_hand(counts, k):
    """Mean over prompts of 1 - C(n-c, k) / C(n, k), with exact binomials."""
    return sum(1 - comb(N - c, k) / comb(N, k) for c in counts) / len(counts)


def rl_cfg(prompts_per_eval, ks):
    return types.SimpleNamespace(observe=ObserveConfig(eval_samples=N, eval_ks=ks), eval_temperature=1.0,
                                 max_new_tokens=4, prompts_per_eval=prompts_per_eval)


def agent():
    return WeightedMultiTaskAgent(entries=[TaskEntry(name=t, agent=Scripted(task=t)) for t in CORRECT])


@pytest.mark.parametrize("dp_size", [1, 2, 3])
def test_pass_at_k_over_dp_ranks_matches_the_unbiased_estimator(dp_size):
    ks = (1, 2, 4, 8)
    per_rank = []
    for rank in range(dp_size):
        a = agent()
        a.set_data_parallel(rank, dp_size)
        request = evaluation_request(rl_cfg(10 * dp_size, ks), seed=3, dp_rank=rank, dp_size=dp_size,
                                     inference=ScriptedInference())
        assert request.num_samples == N and request.ks == list(ks) and not request.greedy
        per_rank.append(asyncio.run(a.evaluate(request)).metrics)
    m = merge_eval_metrics(per_rank)  # ranks hold uneven shares (e.g. 3 + 2 prompts): weighted by prompts
    for env, counts in CORRECT.items():
        assert m[f"eval/{env}/num_prompts"] == len(counts)
        for k in ks:
            assert m[f"eval/{env}/pass@{k}"] == pytest.approx(by_hand(counts, k), abs=1e-12), (env, k)
        assert m[f"eval/{env}/mean_reward"] == pytest.approx(sum(counts) / (N * len(counts)))
    for k in ks:
        assert m[f"eval/pass@{k}"] == pytest.approx((by_hand(CORRECT["easy"], k) + by_hand(CORRECT["hard"], k)) / 2)


def test_merge_falls_back_to_greedy_accuracy_for_pass_at_1():
    m = merge_eval_metrics([{"a/greedy_accuracy": 0.5, "a/num_prompts": 2.0},
                            {"a/greedy_accuracy": 1.0, "a/num_prompts": 6.0}])
    assert m["eval/a/greedy_accuracy"] == pytest.approx(0.875) and m["eval/pass@1"] == pytest.approx(0.875)
    assert m["eval/a/num_prompts"] == 8.0


def test_table_and_line():
    metrics = {"eval/arith/num_prompts": 64.0, "eval/arith/pass@1": 0.5, "eval/arith/pass@4": 0.8125,
               "eval/arith/mean_reward": 0.5, "eval/arith/failed_fraction": 0.0,
               "eval/plain/num_prompts": 10.0, "eval/plain/mean_reward": 0.25,
               "eval/pass@1": 0.5, "eval/pass@4": 0.8125}
    assert format_eval_table(metrics).splitlines() == [
        "environment  prompts  pass@1  pass@4  mean reward  failed",
        "-----------  -------  ------  ------  -----------  ------",
        "arith             64   0.500   0.812        0.500    0.0%",
        "plain             10       -       -        0.250       -",
        "mean              74   0.500   0.812        0.375    0.0%"]
    assert format_eval_line(metrics) == ("pass@1: 0.5 | pass@4: 0.8125 | arith pass@1: 0.5 pass@4: 0.8125 "
                                         "reward: 0.5 | plain reward: 0.25")


# --------------------------------------------------------------------------- flags


def observe(env, *extra):
    return _rl(env, *extra).observe


def test_observe_flags_defaults_and_derived_values(env_yaml):
    o = observe(env_yaml)
    assert (o.log_samples, o.eval_samples, o.eval_ks, o.eval_only, o.warn_interval) == (4, 1, (1,), False, 10)
    o = observe(env_yaml, "--rl-eval-pass-at-k", "8", "1", "4", "--rl-eval-temperature", "1.0")
    assert o.eval_samples == 8 and o.eval_ks == (1, 4, 8)  # samples default to the largest k
    o = observe(env_yaml, "--rl-eval-samples", "16", "--rl-eval-temperature", "0.7")
    assert o.eval_ks == (1, 16)
    o = observe(env_yaml, "--eval-only", "--load", "ckpt")  # no --train-iters needed
    assert o.eval_only


@pytest.mark.parametrize("extra,needle", [
    (["--rl-eval-pass-at-k", "1", "4"], "--rl-eval-temperature 1.0"),
    (["--rl-eval-samples", "2", "--rl-eval-pass-at-k", "4", "--rl-eval-temperature", "1"],
     "raise --rl-eval-samples to 4"),
    (["--rl-eval-pass-at-k", "0"], "--rl-eval-pass-at-k=[0]: every k must be >= 1"),
    (["--rl-log-samples", "-1"], "--rl-log-samples=-1"),
    (["--rl-warn-same-reward-share", "1.5"], "--rl-warn-same-reward-share=1.5: must be a share in [0, 1]"),
    (["--rl-warn-logprob-gap", "0"], "--rl-warn-logprob-gap=0.0"),
    (["--rl-warn-interval", "-2"], "--rl-warn-interval=-2"),
    (["--eval-only"], "--eval-only needs the checkpoint to evaluate: pass --load DIR"),
    (["--eval-only", "--load", "x", "--rl-prompts-per-eval", "0"], "--eval-only with --rl-prompts-per-eval=0"),
    (["--rl-eval-output", "out.json"], "--rl-eval-output is only used with --eval-only"),
])
def test_bad_observe_flags_are_named_errors(env_yaml, extra, needle):
    with pytest.raises(ConfigError) as e:
        observe(env_yaml, *extra)
    assert needle in str(e.value)
