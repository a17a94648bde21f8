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
