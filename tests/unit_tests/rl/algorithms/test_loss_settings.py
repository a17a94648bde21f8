"""A registered policy loss declares its own settings, help line and clip kind; nothing else changes to add one."""
from __future__ import annotations

import pytest
import torch

from megatron.rl.algorithms import POLICY_LOSSES, PolicyLossConfig, compute_token_loss
from megatron.rl.algorithms.policy_loss import PolicyLossConfigError, loss_settings, validate_policy_loss
from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.training.config import build_parser, parse_args

from tests.conftest import REPO_ROOT

BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", "3", "--langrl-env-config", str(REPO_ROOT / "examples/rl/environment_configs/arithmetic.yaml"),
        "--grpo-prompts-per-step", "4", "--grpo-group-size", "4", "--rl-max-new-tokens", "8"]


@pytest.fixture
def scaled_loss():
    """A user's loss with a setting of its own: the REINFORCE term times ``scale``."""

    @POLICY_LOSSES.register("scaled_reinforce")
    @loss_settings(0.5, 0.5, "REINFORCE times a scale", clips_weight=True, scale=1.0, flip=False)
    def scaled(logprobs, old_logprobs, advantages, mask, eps_lower, eps_upper, seq_ids=None, scale=1.0,
               flip=False):
        sign = -1.0 if flip else 1.0
        loss = -sign * scale * advantages * logprobs * mask.to(logprobs.dtype)
        return loss, {"num_tokens": mask.sum()}

    yield scaled
    POLICY_LOSSES.pop("scaled_reinforce")


def _rl(argv):
    return rl_config_from_args(parse_args(BASE + argv, extra_args_providers=[add_rl_args]))


def test_a_loss_setting_reaches_the_loss_typed_like_its_default(scaled_loss):
    rl = _rl(["--grpo-policy-loss", "scaled_reinforce", "--grpo-policy-loss-option", "scale=2.5", "flip=true"])
    assert rl.loss.options == {"scale": 2.5, "flip": True}
    lp, adv, mask = torch.tensor([-1.0, -2.0]), torch.tensor([1.0, -0.5]), torch.tensor([1, 1])
    loss, _ = compute_token_loss(rl.loss, lp, lp.clone(), adv, mask)
    assert torch.allclose(loss, 2.5 * adv * lp)  # flipped sign, scaled


def test_unknown_or_mistyped_settings_are_refused_naming_the_flag(scaled_loss):
    with pytest.raises(PolicyLossConfigError, match=r"--grpo-policy-loss-option 'size=2'.*scale=1.0, flip=False"):
        _rl(["--grpo-policy-loss", "scaled_reinforce", "--grpo-policy-loss-option", "size=2"])
    with pytest.raises(PolicyLossConfigError, match="expected a float"):
        _rl(["--grpo-policy-loss", "scaled_reinforce", "--grpo-policy-loss-option", "scale=big"])
    with pytest.raises(PolicyLossConfigError, match="ppo_clip declares these settings: none"):
        _rl(["--grpo-policy-loss-option", "scale=2"])


def test_the_help_lists_every_registered_loss_with_its_summary_and_clip_defaults(scaled_loss):
    text = build_parser([add_rl_args]).format_help()
    assert "scaled_reinforce: REINFORCE times a scale" in " ".join(text.split())
    assert "scaled_reinforce 0.5" in " ".join(text.split())


def test_the_clip_kind_is_declared_not_named(scaled_loss):
    validate_policy_loss(PolicyLossConfig(policy_loss="scaled_reinforce", eps_lower=1.0))  # a weight's clip
    validate_policy_loss(PolicyLossConfig(policy_loss="cispo", eps_lower=1.0))
    with pytest.raises(PolicyLossConfigError, match="--grpo-clamp-eps-lower=1.0"):
        validate_policy_loss(PolicyLossConfig(policy_loss="ppo_clip", eps_lower=1.0))
