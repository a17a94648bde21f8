"""Failure-point warnings: the pure checks at their thresholds, and the rate limiter."""
import logging

import pytest

from megatron.rl.observe.metrics import RolloutObservations, summarize_groups
from megatron.rl.observe.warnings import (RunWarnings, WarningLimiter, WarningThresholds, check_failure_points,
                                     warning_metrics)
from megatron.rl.base.types import RolloutGroup, TokenRollout

T = WarningThresholds(same_reward_share=0.9, length_cap_share=0.5, logprob_gap=1.0)


def kinds(metrics, thresholds=T, **kw):
    return [f.kind for f in check_failure_points(metrics, thresholds, **kw)]


def test_healthy_iteration_has_no_findings():
    assert kinds({"same_reward_group_fraction": 0.3, "length_capped_fraction": 0.1, "logprob_gap_mean": 1e-6}) == []
    assert kinds({}) == []  # nothing measured (e.g. no log-probs from the backend): nothing to say
    nan = float("nan")
    assert kinds({"same_reward_group_fraction": nan, "length_capped_fraction": nan, "logprob_gap_mean": nan}) == []


@pytest.mark.parametrize("key,kind,threshold", [("same_reward_group_fraction", "same_reward", 0.9),
                                                ("length_capped_fraction", "length_cap", 0.5),
                                                ("logprob_gap_mean", "logprob_gap", 1.0)])
def test_each_check_fires_strictly_above_its_threshold(key, kind, threshold):
    assert kinds({key: threshold}) == []
    assert kinds({key: threshold + 1e-9}) == [kind]


def test_share_threshold_one_disables_and_gap_inf_disables():
    off = WarningThresholds(same_reward_share=1.0, length_cap_share=1.0, logprob_gap=float("inf"))
    assert kinds({"same_reward_group_fraction": 1.0, "length_capped_fraction": 1.0, "logprob_gap_mean": 16.0},
                 off) == []


def test_messages_name_the_flag_the_numbers_and_the_evidence():
    findings = check_failure_points({"same_reward_group_fraction": 1.0, "length_capped_fraction": 0.97,
                                     "logprob_gap_mean": 12.5, "logprob_gap_max": 31.0}, T, max_new_tokens=64,
                                    example=" " * 8, same_reward_value=0.0)
    msg = {f.kind: f.message for f in findings}
    assert "100% of groups got the same reward" in msg["same_reward"] and "most often 0" in msg["same_reward"]
    assert "--rl-warn-same-reward-share" in msg["same_reward"]
    assert "97% of responses stopped at the length cap (--rl-max-new-tokens=64)" in msg["length_cap"]
    assert "e.g. '        '" in msg["length_cap"]  # the collapsed completion, whitespace visible
    assert "12.5 nats per generated token, max 31" in msg["logprob_gap"]
    assert "different policy" in msg["logprob_gap"] and "--rl-warn-logprob-gap" in msg["logprob_gap"]
    assert warning_metrics(findings) == {"warn/same_reward": 1.0, "warn/length_cap": 1.0, "warn/logprob_gap": 1.0}


def test_limiter_reports_first_then_every_interval_and_counts_what_it_held_back():
    lim = WarningLimiter(interval=3)
    f = check_failure_points({"length_capped_fraction": 0.9}, T)
    g = check_failure_points({"logprob_gap_mean": 5.0}, T)
    seen = {it: [(x.kind, held) for x, held in lim.admit(f + (g if it >= 2 else []), it)] for it in range(1, 8)}
    assert seen == {1: [("length_cap", 0)], 2: [("logprob_gap", 0)], 3: [], 4: [("length_cap", 2)],
                    5: [("logprob_gap", 2)], 6: [], 7: [("length_cap", 2)]}
    assert WarningLimiter(interval=0).admit(f, 1) == []  # 0 disables


def test_report_is_one_log_record_per_iteration(caplog):
    lim = WarningLimiter(interval=10)
    findings = check_failure_points({"length_capped_fraction": 0.9, "logprob_gap_mean": 5.0}, T)
    with caplog.at_level(logging.WARNING):
        text = lim.report(findings, 4)
        assert lim.report(findings, 5) is None
    assert len(caplog.records) == 1 and caplog.records[0].getMessage() == text
    assert text.startswith("iteration 4: possible training problems:") and text.count("\n  - ") == 2


def test_run_warnings_quote_a_capped_sample_and_the_common_constant_reward():
    def r(reward, reason):
        return TokenRollout(prompt="Q", completion=" " * 8 if reason == "length" else "ok", reward=reward,
                            env_id="e", token_ids=[1, 2], generation_mask=[0, 1], prompt_length=1,
                            metadata={"finish_reasons": [reason], "num_turns": 1})

    groups = [RolloutGroup(env_id="e", rollouts=[r(0.0, "length"), r(0.0, "length")]) for _ in range(3)]
    groups.append(RolloutGroup(env_id="e", rollouts=[r(1.0, "stop"), r(1.0, "stop")]))
    samples = [{"finish_reasons": ["stop"], "completion": "ok"}, {"finish_reasons": ["length"], "completion": " " * 8}]
    obs = RolloutObservations(metrics={}, summaries=summarize_groups(groups, 8), samples=samples)
    checks = RunWarnings(T, interval=10, max_new_tokens=8, report=False)
    findings = checks.check({"same_reward_group_fraction": 1.0, "length_capped_fraction": 0.75}, obs)
    msg = {f.kind: f.message for f in findings}
    assert "most often 0" in msg["same_reward"] and "e.g. '        '" in msg["length_cap"]
    assert checks.report(findings, 1) is None  # not the reporting rank


# ------------------------------------------------------------------ asynchronous rollouts: off-policy drift, trends
ASYNC = {"staleness_mean": 0.6, "off_policy_token_share": 0.6}


def test_off_policy_drift_fires_only_for_asynchronous_runs_above_the_kl_or_the_truncated_share():
    assert kinds({**ASYNC, "mismatch_kl_k3": 0.03, "is_truncated_fraction": 0.05}) == []
    assert kinds({**ASYNC, "mismatch_kl_k3": 0.0301, "is_truncated_fraction": 0.0}) == ["off_policy"]
    assert kinds({**ASYNC, "mismatch_kl_k3": 0.001, "is_truncated_fraction": 0.0501}) == ["off_policy"]
    # synchronous: the same numbers are the train-inference mismatch, which the log-prob gap check covers
    assert kinds({"mismatch_kl_k3": 0.5, "is_truncated_fraction": 0.5}) == []
    [f] = check_failure_points({**ASYNC, "mismatch_kl_k3": 0.35, "is_weight_mean": 0.916,
                                "is_truncated_fraction": 0.011}, T)
    assert "KL 0.35 nats per token" in f.message and "weights mean 0.916" in f.message and "1.1% truncated" in f.message
    assert "--rl-warn-off-policy-kl=0.03" in f.message and "--rl-importance-sampling-mode" in f.message
    assert "--lr-warmup-iters" in f.message


def test_asynchronous_runs_check_the_gap_of_the_tokens_the_trained_policy_generated():
    stale_only = {**ASYNC, "logprob_gap_mean": 3.0, "logprob_gap_stale_mean": 3.0}
    assert kinds(stale_only) == []  # the policy moved since: by design
    assert kinds({**stale_only, "logprob_gap_fresh_mean": 2.0, "logprob_gap_fresh_max": 9.0}) == ["logprob_gap"]


def _trend(values_by_key, **kw):
    from megatron.rl.observe.warnings import check_trends

    t = WarningThresholds(trend_window=5, **kw)
    return [f.kind for f in check_trends(values_by_key, t)]


def test_reward_drop_compares_the_last_window_with_the_first():
    rising = [0.4, 0.45, 0.5, 0.5, 0.55] + [0.6] * 10
    falling = [0.5] * 5 + [0.45] * 5 + [0.35, 0.3, 0.3, 0.3, 0.3]  # last window 0.31, first 0.5
    assert _trend({"env/arith/reward_mean": rising, "env/sub/reward_mean": falling}) == ["reward_drop/sub"]
    assert _trend({"env/sub/reward_mean": falling[:9]}) == []  # not two whole windows yet
    assert _trend({"env/sub/reward_mean": [0.5] * 5 + [0.41] * 5}) == []  # 0.09 <= 0.1
    assert _trend({"reward_mean": falling}) == ["reward_drop/all"]  # no per-environment metrics
    assert _trend({"env/sub/reward_mean": falling}, reward_drop=float("inf")) == []


def test_entropy_collapse_is_a_fraction_of_the_first_window():
    assert _trend({"entropy_mean": [0.6] * 5 + [0.16] * 5}) == []  # 0.16 >= 0.25 x 0.6 = 0.15
    assert _trend({"entropy_mean": [0.6] * 5 + [0.14] * 5}) == ["entropy_collapse"]
    assert _trend({"entropy_mean": [0.6] * 5 + [0.01] * 5}, entropy_drop=0.0) == []


def test_run_warnings_follow_a_collapsing_asynchronous_run_and_stay_quiet_on_a_learning_one():
    """The history the warnings keep: an arithmetic reward that rises from 0.45 (a learning run) stays quiet; one that
    falls to 0.2 while the policy moves far per step (the collapse) warns about both, once per interval."""
    def run(rewards, kls):
        checks = RunWarnings(WarningThresholds(trend_window=10), interval=50, max_new_tokens=8, report=False)
        found = []
        for it, (reward, kl) in enumerate(zip(rewards, kls), 1):
            metrics = {**ASYNC, "env/arith/reward_mean": reward, "env/sub/reward_mean": 0.2, "mismatch_kl_k3": kl,
                       "is_weight_mean": 0.99, "entropy_mean": 0.5 - 0.001 * it}
            found.append({f.kind for f in checks.check(metrics)})
        return found

    learning = run([0.45 + 0.002 * i for i in range(60)], [0.01] * 60)
    assert all(not f for f in learning)
    collapse = run([0.5] * 20 + [0.5 - 0.01 * i for i in range(30)] + [0.2] * 10, [0.01] * 30 + [0.08] * 30)
    first_drop = next(i for i, f in enumerate(collapse) if "reward_drop/arith" in f)
    assert 20 < first_drop < 50 and all("reward_drop/arith" in f for f in collapse[first_drop:])
    assert all("off_policy" in f for f in collapse[30:]) and not any("off_policy" in f for f in collapse[:30])


def test_an_iteration_without_a_value_does_not_silence_the_trend():
    """A NaN reward (an iteration where no rollout of the environment succeeded) is no point of the trend: it must
    not take a slot of the first window and leave the check short of two whole windows for the rest of the run."""
    def drops(rewards):
        checks = RunWarnings(WarningThresholds(trend_window=3), interval=1, max_new_tokens=8, report=False)
        return sum("reward_drop/arith" in {f.kind for f in checks.check({**ASYNC, "env/arith/reward_mean": r})}
                   for r in rewards)

    falling = [1.0] * 3 + [0.2] * 7
    assert drops(falling) > 0
    assert drops([float("nan")] + falling) == drops(falling)
