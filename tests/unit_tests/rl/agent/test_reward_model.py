"""The reward model: batched scores equal one-at-a-time forwards of the same local model, and every failure
(missing files, a classifier with several labels, a timeout, a missing package) is explicit."""
import asyncio
import time

import pytest

pytest.importorskip("transformers", reason="the reward model needs transformers (pip install 'megatron-rl[hf]')")

from megatron.rl.agent.api import GroupedRolloutRequest  # noqa: E402
from megatron.rl.agent.model_reward import ModelRewardAgent  # noqa: E402
from megatron.rl.agent.reward_model import RewardModel, RewardModelConfig, RewardModelError  # noqa: E402
from megatron.rl.inference.api import GenerationArgs  # noqa: E402
from megatron.rl.inference.fake import FakeInference  # noqa: E402
from tests.unit_tests.rl.agent.tiny_reward_model import build_digit_reward_model, digit_share  # noqa: E402


@pytest.fixture(scope="module")
def rm_path(tmp_path_factory):
    return build_digit_reward_model(tmp_path_factory.mktemp("rm") / "digits", steps=150)


def _one_by_one(path, texts):
    """Reference: each text alone through the model (no padding, no batching)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return [float(model(**tok(t, return_tensors="pt")).logits[0, 0]) for t in texts]


def test_batched_scores_equal_single_forwards_and_prefer_digits(rm_path):
    texts = ["Q: 1+1? A:", " 2", "abc", "12345", "a1", "!!", "x9y8z7", "hello there"]
    rm = RewardModel(config=RewardModelConfig(path=str(rm_path), batch_size=3, template="{prompt}{completion}"))
    scores = asyncio.run(rm.score([(t[:2], t[2:]) for t in texts]))
    assert scores == pytest.approx(_one_by_one(rm_path, texts), abs=1e-5)
    # the trained preference: digit-heavy texts score higher
    assert scores[texts.index("12345")] > 0.8 > 0.2 > scores[texts.index("abc")]
    assert sorted(range(len(texts)), key=lambda i: scores[i])[-1] in {i for i, t in enumerate(texts)
                                                                       if digit_share(t) == 1.0}


def _rescore(agent):
    return asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=3, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=4, seed=2))))


def test_model_reward_uses_the_reward_model(rm_path):
    agent = ModelRewardAgent(env={"type": "arithmetic"}, rule_weight=0.0,
                             reward_model={"path": str(rm_path), "weight": 2.0, "template": "{completion}"})
    rollouts = [r for g in _rescore(agent).groups for r in g.rollouts]
    expected = _one_by_one(rm_path, [r.completion for r in rollouts])
    assert all(r.ok for r in rollouts)
    assert [r.metadata["reward_components"]["reward_model"] for r in rollouts] == pytest.approx(expected, abs=1e-5)
    assert [r.reward for r in rollouts] == pytest.approx([2.0 * e for e in expected], abs=1e-5)


@pytest.mark.parametrize("case", ["missing", "two_labels", "timeout"])
def test_reward_model_failures_are_failed_rollouts_with_the_reason(rm_path, tmp_path, monkeypatch, case):
    path, expect, timeout = str(rm_path), "", 120.0
    if case == "missing":
        path, expect = str(tmp_path / "nowhere"), "cannot load the reward model from"
    elif case == "two_labels":
        path, expect = str(build_digit_reward_model(tmp_path / "two", steps=1, num_labels=2)), "num_labels=2"
    else:
        expect, timeout = "no scores within timeout_s=0.2", 0.2
        monkeypatch.setattr(RewardModel, "score_sync", lambda self, texts: time.sleep(2.0))
    agent = ModelRewardAgent(env={"type": "arithmetic"}, reward_model={"path": path, "timeout_s": timeout})
    rollouts = [r for g in _rescore(agent).groups for r in g.rollouts]
    assert all(not r.ok and r.reward == 0.0 for r in rollouts)
    assert all(r.metadata["failure_kind"] == "reward_model_error" and expect in r.failure_reason
               and r.failure_reason.startswith("reward model: ") for r in rollouts)
