"""The iteration's rollouts cross data-parallel ranks in one all-gather, and are counted once."""
from __future__ import annotations

import statistics
import types

import pytest

from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout
from megatron.rl.rl_utils import _collection_metrics
from megatron.rl.rollout import gather

REWARDS_0 = [[0.1, 0.7, 1 / 3], [0.5, 0.5], [0.2]]
REWARDS_1 = [[1e-3, 0.9], [0.25, 0.25, 0.25]]


def _tok(reward: float, env: str, n_gen: int) -> TokenRollout:
    return TokenRollout(prompt="p", completion=f"c{reward}", reward=reward, env_id=env, token_ids=list(range(2 + n_gen)),
                        generation_mask=[0, 0] + [1] * n_gen, logprobs=[0.0, 0.0] + [-0.5] * n_gen, prompt_length=2)


def _groups(rewards: list[list[float]], envs: tuple[str, ...]) -> list[RolloutGroup]:
    out = []
    for i, rs in enumerate(rewards):
        env = envs[i % len(envs)]
        rollouts = [_tok(r, env, n_gen=1 + (j + i) % 3) for j, r in enumerate(rs)]
        rollouts.append(Rollout(prompt="p", completion="", reward=0.0, status="failed", env_id=env,
                                failure_reason=f"timeout {i % 2}"))
        out.append(RolloutGroup(rollouts=rollouts, env_id=env))
    return out


RL = types.SimpleNamespace(advantage_estimator="grpo", filter_same_reward=True, max_new_tokens=8,
                           observe=types.SimpleNamespace(log_samples=2))


@pytest.fixture
def two_ranks(monkeypatch):
    """Rank 0's view of a two-rank gather: the other rank's payload is what it would send; calls are counted."""
    rank1 = []
    monkeypatch.setattr(gather.parallel_utils, "all_gather_object", lambda obj, group=None: rank1.append(obj) or [obj])
    gather.gather_rollouts(_groups(REWARDS_1, ("b", "a")), RL)
    calls = []

    def fake_all_gather(obj, group=None):
        calls.append(group)
        return [obj, rank1[0]]

    monkeypatch.setattr(gather.parallel_utils, "all_gather_object", fake_all_gather)
    return calls


def test_one_all_gather_gives_sequences_counts_and_observations(two_ranks):
    sequences, stats, observed = gather.gather_rollouts(_groups(REWARDS_0, ("a", "b")), RL, dp_group="dp")
    assert two_ranks == ["dp"]
    # every group with >= 2 distinct ok rewards trains, rank 0's first
    assert [s.reward for s in sequences] == [0.1, 0.7, 1 / 3, 1e-3, 0.9]
    assert stats.groups == 5 and stats.rollouts == 16 and stats.failed_rollouts == 5 and stats.ok_rollouts == 11
    assert stats.dropped_groups_too_few_ok == 1 and stats.filtered_same_reward_groups == 2
    assert stats.failure_reasons == {"timeout 0": 3, "timeout 1": 2}
    assert sorted(observed.summaries) == ["a", "b"] and sum(s.groups for s in observed.summaries.values()) == 5
    assert observed.metrics["same_reward_groups"] == 2.0 and len(observed.samples) == 2


def test_logged_counts_equal_those_counted_over_the_rollouts_themselves(two_ranks):
    """The derived counts give the same numbers, bit for bit, as statistics over every ok rollout in rank order."""
    groups = _groups(REWARDS_0, ("a", "b")) + _groups(REWARDS_1, ("b", "a"))
    ok = [r for g in groups for r in g.rollouts if r.ok]
    rewards, lengths = [r.reward for r in ok], [r.num_generated_tokens for r in ok]
    _, stats, _ = gather.gather_rollouts(_groups(REWARDS_0, ("a", "b")), RL)
    metrics = _collection_metrics(stats, t_gen=0.7)
    assert metrics["reward_mean"] == statistics.fmean(rewards)
    assert metrics["reward_std"] == statistics.pstdev(rewards)
    assert metrics["response_length_mean"] == statistics.fmean(lengths)
    assert metrics["generated_tokens"] == float(sum(lengths))
    assert metrics["generation_tokens_per_s"] == sum(lengths) / 0.7
