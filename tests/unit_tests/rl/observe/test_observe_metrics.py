"""Per-environment metrics of an iteration, from scripted rollout groups, against numbers worked out by hand."""
import math
import pickle

import pytest

from megatron.rl.observe.metrics import (format_env_line, is_length_capped, local_observations, merge_observations,
                                    merge_summaries, summarize_groups, summary_metrics)
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout

CAP = 8


def _observe(groups, cap, num_samples):
    """One data-parallel rank's observations, merged as the trainer's gather merges them."""
    return merge_observations([local_observations(groups, cap, num_samples)], num_samples)


def tok(env, reward, generated, turns=1, reasons=None, observation_tokens=0, completion="x"):
    """A TokenRollout with 3 prompt tokens, ``generated`` policy tokens and ``observation_tokens`` env tokens."""
    mask = [0, 0, 0] + [1] * generated + [0] * observation_tokens
    meta = {"num_turns": turns}
    if reasons is not None:
        meta["finish_reasons"] = reasons
    return TokenRollout(prompt="p", completion=completion, reward=reward, env_id=env, problem_id="q",
                        token_ids=list(range(len(mask))), generation_mask=mask, prompt_length=3, metadata=meta)


def failed(env):
    return Rollout(prompt="p", completion="", reward=0.0, status="failed", failure_reason="boom", env_id=env)


def scripted_groups():
    """Two environments. Worked out by hand below."""
    return [
        # "math": group 1 mixed rewards, one failure; group 2 all 0 (same reward)
        RolloutGroup(env_id="math", rollouts=[tok("math", 1.0, 4, reasons=["stop"]),
                                              tok("math", 0.0, 8, reasons=["length"]), failed("math")]),
        RolloutGroup(env_id="math", rollouts=[tok("math", 0.0, 8, reasons=["length"]),
                                              tok("math", 0.0, 6, reasons=["stop"])]),
        # "tool": multi-turn; observation tokens must not count as response length
        RolloutGroup(env_id="tool", rollouts=[
            tok("tool", 0.5, 5, turns=3, reasons=["stop", "stop", "stop"], observation_tokens=7),
            tok("tool", 0.5, 9, turns=2, reasons=["length", "stop"], observation_tokens=4)]),
        # one ok rollout only: not a scored group, so never a same-reward group
        RolloutGroup(env_id="tool", rollouts=[tok("tool", 1.0, 2, turns=1, reasons=["stop"]), failed("tool")]),
    ]


def test_per_environment_metrics_match_a_hand_computation():
    m = summary_metrics(summarize_groups(scripted_groups(), CAP))
    # math: ok rewards 1, 0, 0, 0 -> 0.25; lengths 4, 8, 8, 6 -> 6.5; 1 failure; capped 2 of 4
    assert m["env/math/groups"] == 2 and m["env/math/failed_rollouts"] == 1
    assert m["env/math/reward_mean"] == pytest.approx(0.25)
    assert m["env/math/response_length_mean"] == pytest.approx(6.5)
    assert m["env/math/turns_mean"] == 1.0 and m["env/math/length_capped_fraction"] == pytest.approx(0.5)
    # tool: ok rewards 0.5, 0.5, 1.0; lengths 5, 9, 2 (observations excluded); turns 3, 2, 1; capped 1 of 3
    assert m["env/tool/groups"] == 2 and m["env/tool/failed_rollouts"] == 1
    assert m["env/tool/reward_mean"] == pytest.approx(2.0 / 3)
    assert m["env/tool/response_length_mean"] == pytest.approx(16 / 3)
    assert m["env/tool/turns_mean"] == pytest.approx(2.0)
    assert m["env/tool/length_capped_fraction"] == pytest.approx(1 / 3)
    # run-wide: 7 ok rollouts, turns 1+1+1+1+3+2+1 = 10; capped 3; scored groups 3 (math x2, tool first),
    # same-reward ones: math's all-zero group and tool's 0.5/0.5 group
    assert m["turns_per_episode_mean"] == pytest.approx(10 / 7)
    assert m["length_capped_fraction"] == pytest.approx(3 / 7)
    assert m["same_reward_groups"] == 2 and m["same_reward_group_fraction"] == pytest.approx(2 / 3)


def test_summaries_of_split_groups_add_up_to_the_whole():
    groups = scripted_groups()
    whole = summary_metrics(summarize_groups(groups, CAP))
    # as if DP rank 0 had the first and last group and rank 1 the middle two (and summaries crossed a pickle)
    parts = [pickle.loads(pickle.dumps(summarize_groups(g, CAP))) for g in ([groups[0], groups[3]], groups[1:3])]
    merged = summary_metrics(merge_summaries(parts))
    assert merged.keys() == whole.keys()
    for k in whole:
        assert merged[k] == pytest.approx(whole[k]), k
    values = merge_summaries(parts)
    assert values["math"].same_reward_values == {0.0: 1} and values["tool"].same_reward_values == {0.5: 1}


def test_all_failed_environment_has_nan_means_not_a_crash():
    m = summary_metrics(summarize_groups([RolloutGroup(env_id="bad", rollouts=[failed("bad"), failed("bad")])], CAP))
    assert m["env/bad/failed_rollouts"] == 2 and math.isnan(m["env/bad/reward_mean"])
    assert math.isnan(m["same_reward_group_fraction"]) and math.isnan(m["length_capped_fraction"])


def test_length_cap_without_finish_reasons_falls_back_to_the_token_budget():
    assert is_length_capped(tok("e", 0, 8), CAP) and not is_length_capped(tok("e", 0, 7), CAP)
    assert not is_length_capped(tok("e", 0, 8, reasons=["stop"]), CAP)  # EOS exactly at the budget


def test_env_line_is_short_and_only_for_mixtures():
    m = summary_metrics(summarize_groups(scripted_groups(), CAP))
    assert format_env_line(m) == "envs: math 2g r=0.25 len=6.5 fail=1, tool 2g r=0.667 len=5.33 turns=2 fail=1"
    single = summary_metrics(summarize_groups(scripted_groups()[:2], CAP))
    assert format_env_line(single) == ""


def test_observations_of_one_rank_give_metrics_and_samples():
    obs = _observe(scripted_groups(), CAP, 3)
    assert obs.metrics == summary_metrics(summarize_groups(scripted_groups(), CAP))
    assert [s["env"] for s in obs.samples] == ["math", "math", "tool"]
    assert _observe(scripted_groups(), CAP, 0).samples == []
