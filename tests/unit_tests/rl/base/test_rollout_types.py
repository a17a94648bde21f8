"""Rollout / TokenRollout validation: finite rewards, explicit failures, aligned token-level fields."""
import pytest
from pydantic import ValidationError

from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout


def _tok(**kw):
    base = dict(prompt="p", completion="c", reward=1.0, token_ids=[1, 2, 3, 4], generation_mask=[0, 0, 1, 1],
                logprobs=[0.0, 0.0, -0.1, -2.0], prompt_length=2)
    base.update(kw)
    return TokenRollout(**base)


def test_token_rollout_properties():
    t = _tok()
    assert t.num_generated_tokens == 2 and t.generated_logprobs == [-0.1, -2.0] and t.ok


@pytest.mark.parametrize("reward", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_rejected(reward):
    with pytest.raises(ValidationError, match="finite"):
        Rollout(prompt="p", completion="c", reward=reward)


@pytest.mark.parametrize("kw, msg", [
    (dict(generation_mask=[0, 0, 1]), "generation_mask has 3"),
    (dict(generation_mask=[0, 0, 2, 1]), "0 or 1"),
    (dict(generation_mask=[0, 1, 1, 1]), "0 over the prompt"),
    (dict(logprobs=[0.0, -1.0]), "logprobs has 2"),
    (dict(logprobs=[0.0, 0.0, float("nan"), -1.0]), "finite and <= 0"),
    (dict(logprobs=[0.0, 0.0, 0.5, -1.0]), "finite and <= 0"),
    (dict(prompt_length=5), "exceeds"),
])
def test_misaligned_token_fields_rejected(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        _tok(**kw)


def test_failed_rollout_needs_reason_and_group_mean_skips_failures():
    with pytest.raises(ValidationError, match="failure_reason"):
        Rollout(prompt="p", completion="", reward=0.0, status="failed")
    g = RolloutGroup(rollouts=[_tok(reward=1.0), _tok(reward=0.0),
                               Rollout(prompt="p", completion="", reward=0.0, status="failed", failure_reason="x")])
    assert g.num_failed == 1 and g.mean_reward == 0.5 and g.rewards == [1.0, 0.0, 0.0]
