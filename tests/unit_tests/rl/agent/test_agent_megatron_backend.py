"""Agents on the production backend: megatron-core's dynamic engine around a tiny GPT with the byte-level
tokenizer (the setup train_rl.py uses). Rollout log-probs must equal a teacher-forced forward of the final
token sequence at every generated position, including multi-turn episodes; observation bytes are masked."""
import asyncio

import pytest
import torch

from megatron.rl.agent.api import Agent, GroupedRolloutRequest
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
from megatron.rl.inference.api import GenerationArgs

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def backend():
    from tests.unit_tests.rl.inference.scripts.megatron_common import init_distributed, tiny_gpt

    init_distributed(tp=1)  # installs the CPU runtime layer: must precede importing the engine (see report)
    from megatron.rl.inference.megatron import MegatronInference
    from megatron.rl.training.tokenizer import ByteLevelTokenizer

    model = tiny_gpt()
    b = MegatronInference(model, ByteLevelTokenizer())
    yield model, b
    b.exit_inference_mode()


@Agent.register_subclass("test_megatron_observe_agent")
class ObserveAgent(RewardOnlyAgent):
    max_turns: int = 3
    stop: list[str] = ["\n"]

    def get_problem(self, index, validation):
        return {"prompt": f"Q: {index}+1=? A:"}

    def observe(self, problem, turns):
        return f"\nTOOL {len(turns)}\n"

    def compute_episode_reward(self, problem, turns):
        return 0.0


def _check(model, rollout, temperature):
    from tests.unit_tests.rl.inference.scripts.megatron_common import teacher_forced_logprobs

    ref = teacher_forced_logprobs(model, rollout.token_ids, 1, temperature)  # ref[i-1] is token i's log-prob
    idx = [i for i, m in enumerate(rollout.generation_mask) if m]
    assert idx
    torch.testing.assert_close(torch.tensor([rollout.logprobs[i] for i in idx]),
                               torch.stack([ref[i - 1] for i in idx]).float(), atol=1e-5, rtol=0)


def test_arithmetic_rollouts_on_megatron_engine(backend):
    from megatron.rl.environments.arithmetic import ArithmeticAgent

    model, b = backend
    out = asyncio.run(ArithmeticAgent().generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=3, rollouts_per_group=2, inference_interface=b,
        generation_args=GenerationArgs(temperature=0.8, max_tokens=8, seed=0))))
    for g in out.groups:
        for r in g.rollouts:
            assert r.ok and r.token_ids[:r.prompt_length] == list(r.prompt.encode())
            _check(model, r, 0.8)


def test_multi_turn_on_megatron_engine(backend):
    model, b = backend
    out = asyncio.run(ObserveAgent().generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=b,
        generation_args=GenerationArgs(temperature=1.0, max_tokens=6, seed=1))))
    for g in out.groups:
        for r in g.rollouts:
            assert r.ok and r.metadata["num_turns"] == 3
            data = bytes(t for t in r.token_ids if t < 256)
            for k in (1, 2):
                start = data.index(f"TOOL {k}\n".encode())
                assert not any(r.generation_mask[start:start + len(f"TOOL {k}\n")])
            _check(model, r, 1.0)
