"""Per-environment health: a collapse inside one environment of a mixture is warned, naming it and quoting a
sample, while the mixture's own numbers stay healthy; the per-environment numbers and checks at their thresholds."""
import logging
import math
import random

import pytest

from megatron.rl.base.types import RolloutGroup, TokenRollout
from megatron.rl.observe.env_health import check_env_health, check_env_trends, check_pass_at_1
from megatron.rl.observe.findings import WarningThresholds
from megatron.rl.observe.metrics import (local_observations, merge_observations, merge_summaries, summarize_groups,
                                         summary_metrics)
from megatron.rl.observe.warnings import RunWarnings, check_failure_points, check_trends

CAP = 8


def _observe(groups, cap, num_samples):
    """One data-parallel rank's observations, merged as the trainer's gather merges them."""
    return merge_observations([local_observations(groups, cap, num_samples)], num_samples)
COLLAPSE_AT = 30  # the iteration the short-answer environment starts answering " 7" to everything
G = 8


def rollout(env, problem, completion, reward, logprob=-1.0, reason="stop"):
    n = max(1, len(completion) // 2)
    return TokenRollout(prompt=f"Q{problem}=? A:", completion=completion, reward=reward, env_id=env,
                        problem_id=str(problem), token_ids=list(range(2 + n)), generation_mask=[0, 0] + [1] * n,
                        logprobs=[0.0, 0.0] + [logprob] * n, prompt_length=2,
                        metadata={"finish_reasons": [reason], "num_turns": 1})


def healthy_group(env, rng, problem):
    """A group of a learning policy: about half its rollouts right, the rest varied wrong answers."""
    answer = rng.randint(0, 99)
    rollouts = []
    for _ in range(G):
        right = rng.random() < 0.5
        text = answer if right else rng.randint(0, 99)
        rollouts.append(rollout(env, problem, f" {text}\n", float(text == answer), logprob=-rng.uniform(0.5, 1.5)))
    return RolloutGroup(env_id=env, rollouts=rollouts)


def collapsed_group(env, rng, problem):
    """Every rollout answers " 7": reward 1 only on the problems whose answer is 7."""
    answer = rng.choice([7, 3, 12, 40, 5, 9, 21, 64, 8, 1])
    return RolloutGroup(env_id=env, rollouts=[rollout(env, problem, " 7\n", float(answer == 7), logprob=-0.02)
                                              for _ in range(G)])


def mixture_iteration(rng, iteration):
    """A 1:3 mixture of 8 groups: 2 of "short" (collapsed from COLLAPSE_AT on), 6 of "arith" (healthy)."""
    short = [collapsed_group("short", rng, f"s{iteration}-{i}") if iteration >= COLLAPSE_AT
             else healthy_group("short", rng, f"s{iteration}-{i}") for i in range(2)]
    return short + [healthy_group("arith", rng, f"a{iteration}-{i}") for i in range(6)]


def test_a_collapse_in_one_environment_of_a_mixture_is_warned_within_ten_iterations(caplog):
    """The acceptance scenario, through the real metrics path (local_observations, merge_observations): one environment of a 1:3 mixture
    answers one constant string from COLLAPSE_AT on, while the mixture's reward and same-reward share stay
    healthy. A warning names that environment, quotes the constant answer's sample, within 10 iterations; the
    run-wide checks alone say nothing (so without the per-environment checks this test fails)."""
    rng = random.Random(0)
    checks = RunWarnings(WarningThresholds(), interval=10, max_new_tokens=CAP)
    per_env, run_wide, texts = {}, {}, {}
    with caplog.at_level(logging.WARNING):
        for it in range(1, COLLAPSE_AT + 10):
            obs = _observe(mixture_iteration(rng, it), CAP, 4)
            metrics = dict(obs.metrics)
            metrics["reward_mean"] = sum(s.reward_sum for s in obs.summaries.values()) / sum(
                s.ok for s in obs.summaries.values())
            findings = checks.check(metrics, obs)
            per_env[it] = {f.kind for f in findings}
            texts[it] = checks.report(findings, it)
            history = {"reward_mean": [metrics["reward_mean"]]}
            run_wide[it] = (check_failure_points(metrics, checks.thresholds, CAP)
                            + check_trends(history, checks.thresholds))
            if it >= COLLAPSE_AT:  # the mixture still looks healthy
                assert metrics["same_reward_group_fraction"] < 0.9 and metrics["reward_mean"] > 0.3
    assert not any(per_env[it] for it in range(1, COLLAPSE_AT)), "a false alarm before the collapse"
    warned = [it for it in range(COLLAPSE_AT, COLLAPSE_AT + 10) if "answer_collapse/short" in per_env[it]]
    assert warned, f"no per-environment warning within 10 iterations of the collapse: {per_env}"
    first = warned[0]
    assert "same_reward/short" in per_env[first + 1] or "same_reward/short" in per_env[COLLAPSE_AT + 9]
    assert not any(k.endswith("/arith") for it in per_env for k in per_env[it])
    text = texts[first]
    assert "environment 'short'" in text and "' 7\\n'" in text and "'7'" in text
    assert "--rl-warn-top-answer-share" in text
    assert any(r.getMessage() == text for r in caplog.records)
    assert not any(run_wide[it] for it in run_wide), "the run-wide checks should not see this collapse"


def test_per_environment_health_metrics_by_hand_and_across_ranks():
    groups = [RolloutGroup(env_id="e", rollouts=[rollout("e", 1, " 7\n", 1.0, -0.5), rollout("e", 1, "7", 1.0, -0.5),
                                                 rollout("e", 1, " 8\n", 0.0, -1.0)]),
              RolloutGroup(env_id="e", rollouts=[rollout("e", 2, " 7\n", 0.0, -0.25), rollout("e", 2, " 9", 0.0)]),
              RolloutGroup(env_id="f", rollouts=[rollout("f", 3, "abc", 1.0)])]
    m = summary_metrics(summarize_groups(groups, CAP))
    # e: answers 7, 7, 8, 7, 9 -> 3 distinct, top share 3/5; one same-reward group (2) of 2 scored groups;
    # tokens (len // 2, at least 1): 1, 1, 1, 1, 1 with -log p 0.5, 0.5, 1, 0.25, 1 -> 3.25 / 5
    assert m["env/e/distinct_answers"] == 3 and m["env/e/top_answer_share"] == pytest.approx(0.6)
    assert m["env/e/same_reward_group_fraction"] == pytest.approx(0.5)
    assert m["env/e/sampled_entropy"] == pytest.approx(3.25 / 5)
    assert "env/f/same_reward_group_fraction" not in m  # no group with two ok rollouts: not measured, not NaN
    split = merge_summaries([summarize_groups(groups[:1], CAP), summarize_groups(groups[1:], CAP)])
    assert summary_metrics(split) == pytest.approx(m)
    # an agent's recorded answer wins over the completion
    r = rollout("g", 1, "the answer is 4", 1.0)
    r.metadata["extracted_answer"] = "4"
    assert summarize_groups([RolloutGroup(env_id="g", rollouts=[r])], CAP)["g"].answers == {"4": 1}


def window_of(groups_per_iteration):
    return [summarize_groups(g, CAP) for g in groups_per_iteration]


def test_checks_wait_for_a_full_window_and_fire_strictly_above_their_thresholds():
    t = WarningThresholds(env_window=2, top_answer_share=0.75)
    constant = [RolloutGroup(env_id="e", rollouts=[rollout("e", i, " 7\n", 0.0) for _ in range(4)]) for i in range(2)]
    assert check_env_health(window_of([constant]), t) == []  # one iteration of two: not yet
    [f] = check_env_health(window_of([constant, constant]), t)  # single environment: the answer check only
    assert f.kind == "answer_collapse/e" and f.value == 1.0 and f.env == "e"
    three_of_four = [RolloutGroup(env_id="e", rollouts=[rollout("e", i, " 7", 0.0)] * 3 + [rollout("e", i, " 1", 1.0)])
                     for i in range(2)]
    assert check_env_health(window_of([three_of_four] * 2), t) == []  # 0.75 is not above 0.75
    assert check_env_health(window_of([constant] * 2), WarningThresholds(env_window=2, top_answer_share=1.0)) == []


def test_same_reward_and_length_cap_per_environment_only_in_a_mixture():
    t = WarningThresholds(env_window=1)
    stuck = [RolloutGroup(env_id="b", rollouts=[rollout("b", i, f" {i}{j}", 0.0, reason="length") for j in range(4)])
             for i in range(3)]
    fine = [RolloutGroup(env_id="a", rollouts=[rollout("a", i, f" {i}{j}", float(j % 2)) for j in range(4)])
            for i in range(9)]
    kinds = sorted(f.kind for f in check_env_health(window_of([stuck + fine]), t))
    assert kinds == ["length_cap/b", "same_reward/b"]
    assert check_env_health(window_of([stuck]), t) == []  # alone, the run-wide checks are this environment's


def test_the_mixture_as_a_whole_collapsing_is_named_too():
    t = WarningThresholds(env_window=1)
    groups = [RolloutGroup(env_id=env, rollouts=[rollout(env, i, " 0", 0.0) for _ in range(4)])
              for env in ("a", "b") for i in range(2)]
    assert {f.kind for f in check_env_health(window_of([groups]), t)} >= {"answer_collapse/a", "answer_collapse/b",
                                                                          "answer_collapse/mixture"}


def test_sampled_entropy_trend_per_environment():
    t = WarningThresholds(trend_window=3)
    history = {"env/a/sampled_entropy": [1.0] * 3 + [0.9] * 3, "env/b/sampled_entropy": [1.0] * 3 + [0.2] * 3}
    assert [f.kind for f in check_env_trends(history, t)] == ["entropy_collapse/b"]
    assert check_env_trends({"env/b/sampled_entropy": [1.0] * 5}, t) == []


def test_pass_at_1_against_the_first_evaluation():
    t = WarningThresholds()
    first = {"eval/a/pass@1": 0.5, "eval/b/pass@1": 0.5, "eval/pass@1": 0.5}
    latest = {"eval/a/pass@1": 0.45, "eval/b/pass@1": 0.3, "eval/pass@1": 0.375, "eval/b/pass@8": 0.0}
    findings = check_pass_at_1(first, latest, t)
    assert [f.kind for f in findings] == ["pass_at_1_drop/b", "pass_at_1_drop/mixture"]
    assert "'b'" in findings[0].message and "0.500" in findings[0].message and "0.300" in findings[0].message
    checks = RunWarnings(t, interval=1, max_new_tokens=CAP, report=False)
    assert checks.check_eval(first) == []
    assert [f.kind for f in checks.check_eval(latest)] == ["pass_at_1_drop/b", "pass_at_1_drop/mixture"]
    assert check_pass_at_1(first, {"eval/b/pass@1": math.nan}, t) == []
