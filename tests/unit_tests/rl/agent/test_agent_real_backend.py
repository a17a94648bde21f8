"""Agents against a real backend: the Hugging Face backend on a tiny random Llama with a BPE tokenizer
(built in the test, no downloads). Checks that rollout log-probs equal a teacher-forced forward of the final
token sequence at the generated positions, also for multi-turn episodes whose prompts get re-tokenized."""
import asyncio

import numpy as np
import pytest
import torch

from megatron.rl.environments.arithmetic import ArithmeticAgent
from megatron.rl.agent.api import Agent, EvaluationRequest, GroupedRolloutRequest
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent
from megatron.rl.inference.api import GenerationArgs, build_inference_interface
from megatron.rl.base.types import TokenRollout
from tests.unit_tests.rl.inference.tiny_hf import build_tiny_hf_model


@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    path = build_tiny_hf_model(tmp_path_factory.mktemp("tiny_hf_agent"), chat_template=True)
    return build_inference_interface("huggingface", model_path=str(path), device="cpu", max_batch_size=16)


def teacher_forced(model, token_ids, temperature):
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids])).logits[0].double()
    t = temperature if temperature > 0 else 1.0
    logp = torch.log_softmax(logits / t, dim=-1)
    return [0.0] + [float(logp[i - 1, token_ids[i]]) for i in range(1, len(token_ids))]


@Agent.register_subclass("test_hf_multi_turn_agent")
class AlwaysObserveAgent(RewardOnlyAgent):
    max_turns: int = 3
    stop: list[str] = ["\n"]

    def get_problem(self, index, validation):
        return {"prompt": f"The quick brown fox {index}"}

    def observe(self, problem, turns):
        return f"\nHello world! {len(turns)}\n"

    def compute_episode_reward(self, problem, turns):
        return float(sum(len(t.text) for t in turns) > 0)


def _check_against_forward(hf, rollout, temperature):
    assert isinstance(rollout, TokenRollout) and rollout.ok
    ref = teacher_forced(hf.model, rollout.token_ids, temperature)
    idx = [i for i, m in enumerate(rollout.generation_mask) if m]
    assert idx, "no generated tokens"
    np.testing.assert_allclose([rollout.logprobs[i] for i in idx], [ref[i] for i in idx], rtol=0, atol=1e-5)


def test_single_turn_rollouts_match_teacher_forced_forward(hf):
    agent = ArithmeticAgent()
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=hf,
        generation_args=GenerationArgs(temperature=0.7, max_tokens=8, seed=0))))
    for g in out.groups:
        for r in g.rollouts:
            assert r.token_ids[:r.prompt_length] == hf.tokenizer(r.prompt)["input_ids"]
            assert sum(r.generation_mask) == len(r.token_ids) - r.prompt_length
            _check_against_forward(hf, r, 0.7)


def test_multi_turn_with_retokenization(hf):
    agent = AlwaysObserveAgent()
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=hf,
        generation_args=GenerationArgs(temperature=1.0, max_tokens=5, seed=3))))
    for g in out.groups:
        for r in g.rollouts:
            assert r.metadata["num_turns"] == 3
            assert hf.tokenizer.decode(r.token_ids).startswith(r.prompt)
            # every observation's text is outside the generated (mask 1) tokens
            gen_text = hf.tokenizer.decode([t for t, m in zip(r.token_ids, r.generation_mask) if m])
            assert "Hello world!" not in gen_text
            obs_ids = [t for i, (t, m) in enumerate(zip(r.token_ids, r.generation_mask)) if not m
                       and i >= r.prompt_length]
            assert "Hello world! 1" in hf.tokenizer.decode(obs_ids).replace("\n", "")
            # trained positions carry the log-probs the policy had when it generated them
            _check_against_forward(hf, r, 1.0)


@pytest.mark.slow
def test_pass_at_k_evaluation_on_real_backend(hf):
    agent = ArithmeticAgent(validation_size=3)
    out = asyncio.run(agent.evaluate(EvaluationRequest(num_samples=2, inference_interface=hf,
                                                       generation_args=GenerationArgs(max_tokens=6, seed=0))))
    assert out.metrics["num_prompts"] == 3 and set(out.metrics) >= {"pass@1", "pass@2", "greedy_accuracy"}
    greedy = [r.greedy_completion for r in out.results]
    again = asyncio.run(agent.evaluate(EvaluationRequest(num_samples=1, inference_interface=hf,
                                                         generation_args=GenerationArgs(max_tokens=6, seed=9))))
    assert [r.greedy_completion for r in again.results] == greedy
