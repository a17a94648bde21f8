"""Advantage estimators vs slow per-element references written with python floats."""
import math
import random

import pytest
import torch

from megatron.rl.algorithms import (ADVANTAGE_ESTIMATORS, compute_advantages, groups_with_same_reward)


def ref_grpo(group, eps):
    n = len(group)
    mean = sum(group) / n
    std = math.sqrt(sum((x - mean) ** 2 for x in group) / (n - 1))
    if all(x == group[0] for x in group):
        return [0.0] * n
    return [(x - mean) / (std + eps) for x in group]


def ref_drgrpo(group, eps):
    mean = sum(group) / len(group)
    return [x - mean for x in group]


def ref_rloo(group, eps):
    # the baseline of rollout i is the plain average of the other rollouts' rewards
    out = []
    for i, x in enumerate(group):
        others = [y for j, y in enumerate(group) if j != i]
        out.append(x - sum(others) / len(others))
    return out


REFS = {"grpo": ref_grpo, "drgrpo": ref_drgrpo, "rloo": ref_rloo}


def test_every_registered_estimator_has_a_reference():
    assert set(ADVANTAGE_ESTIMATORS.names()) == set(REFS)


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("group_size", [2, 3, 8])
def test_matches_reference_on_random_rewards(name, group_size):
    rng = random.Random(hash((name, group_size)) % 1000)
    groups = [[rng.choice([0.0, 1.0, rng.gauss(0, 2)]) for _ in range(group_size)] for _ in range(7)]
    groups.append([0.5] * group_size)  # an all-equal group
    adv = compute_advantages(torch.tensor(groups, dtype=torch.float64), name, eps=1e-4)
    expected = [REFS[name](g, 1e-4) for g in groups]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-12, atol=1e-12)


def test_hand_checked_values():
    r = torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    # mean 0.25, unbiased std = sqrt((0.5625 + 3 * 0.0625) / 3) = 0.5
    torch.testing.assert_close(compute_advantages(r, "grpo", eps=0.0), torch.tensor([[1.5, -0.5, -0.5, -0.5]]))
    torch.testing.assert_close(compute_advantages(r, "drgrpo"), torch.tensor([[0.75, -0.25, -0.25, -0.25]]))
    torch.testing.assert_close(compute_advantages(r, "rloo"), torch.tensor([[1.0, -1 / 3, -1 / 3, -1 / 3]]))


@pytest.mark.parametrize("name", sorted(REFS))
def test_all_equal_rewards_give_exact_zero(name):
    r = torch.full((3, 5), 0.1, dtype=torch.float32)
    adv = compute_advantages(r, name)
    assert torch.equal(adv, torch.zeros_like(r))
    assert adv.dtype == torch.float32


@pytest.mark.parametrize("name", sorted(REFS))
def test_group_size_one_is_an_error(name):
    with pytest.raises(ValueError, match="--grpo-group-size"):
        compute_advantages(torch.tensor([[1.0], [0.0]]), name)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_reward_names_the_group(bad):
    r = torch.zeros(4, 3)
    r[2, 1] = bad
    with pytest.raises(ValueError, match="group 2"):
        compute_advantages(r, "grpo")


def test_bad_shapes_and_names():
    with pytest.raises(ValueError, match="num_groups, group_size"):
        compute_advantages(torch.zeros(6), "grpo")
    with pytest.raises(ValueError, match="floating"):
        compute_advantages(torch.zeros(2, 3, dtype=torch.long), "grpo")
    with pytest.raises(ValueError, match="--grpo-advantage-estimator.*grpo"):
        compute_advantages(torch.zeros(2, 3), "nope")


def test_result_does_not_depend_on_group_batching():
    r = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    full = compute_advantages(r, "grpo")
    parts = torch.cat([compute_advantages(r[:2], "grpo"), compute_advantages(r[2:], "grpo")])
    assert torch.equal(full, parts)


def test_groups_with_same_reward():
    r = torch.tensor([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.2, 0.2, 0.2], [0.0, 1e-9, 0.0]])
    assert groups_with_same_reward(r).tolist() == [True, False, True, False]
    assert groups_with_same_reward(r, atol=1e-6).tolist() == [True, False, True, True]
