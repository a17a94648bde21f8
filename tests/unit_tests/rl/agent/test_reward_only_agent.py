"""RewardOnlyAgent on the deterministic fake backend: token alignment, multi-turn masks, failures, batching,
determinism, DP sharding and resume."""
import asyncio
import threading
import time

import numpy as np
import pytest

from megatron.rl.agent.api import Agent, GroupedRolloutRequest, RolloutRequest
from megatron.rl.agent.reward_only_agent import RewardOnlyAgent, merge_turn_tokens
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, InferenceResponse
from megatron.rl.inference.fake import FakeInference
from megatron.rl.base.types import TokenRollout


class CountingBackend(InferenceInterface):
    """Wraps a backend and records how many agenerate calls were in flight at once."""

    def __init__(self, inner):
        self.inner, self.inflight, self.max_inflight, self.calls = inner, 0, 0, 0

    async def agenerate(self, requests):
        self.inflight += 1
        self.calls += 1
        self.max_inflight = max(self.max_inflight, self.inflight)
        try:
            await asyncio.sleep(0.01)
            return await self.inner.agenerate(requests)
        finally:
            self.inflight -= 1


@Agent.register_subclass("test_letters_agent")
class LettersAgent(RewardOnlyAgent):
    """Reward = fraction of generated characters that are letters; 10 fixed problems."""

    def dataset_size(self, validation):
        return 10

    def get_problem(self, index, validation):
        return {"prompt": f"Problem {index}:", "id": f"p{index}"}

    def compute_reward(self, problem, completion):
        return sum(c.isalpha() for c in completion) / max(len(completion), 1)


@Agent.register_subclass("test_echo_tool_agent")
class EchoToolAgent(RewardOnlyAgent):
    """Multi-turn: after each turn the environment answers "\\nOBS <turn>\\n"; the episode lasts max_turns."""

    max_turns: int = 3
    stop: list[str] = ["\n"]

    def get_problem(self, index, validation):
        return {"prompt": f"Task {index}:"}

    def observe(self, problem, turns):
        return f"\nOBS {len(turns)}\n"

    def compute_episode_reward(self, problem, turns):
        return float(len(turns))


class BrokenRewardAgent(LettersAgent):
    mode: str = "raise"

    def compute_reward(self, problem, completion):
        if self.mode == "raise":
            raise RuntimeError("reward exploded")
        return float("nan")


def _request(backend, groups=3, size=4, seed=7, **ga):
    ga = {"max_tokens": 12, "seed": seed, **ga}
    return GroupedRolloutRequest(num_groups=groups, rollouts_per_group=size, generation_args=GenerationArgs(**ga),
                                 inference_interface=backend)


def test_single_turn_groups_are_aligned_with_the_backend():
    fake = FakeInference()
    agent = LettersAgent()
    out = asyncio.run(agent.generate_grouped_rollouts(_request(fake, temperature=0.8)))
    assert len(out.groups) == 3 and all(len(g.rollouts) == 4 for g in out.groups)
    for g in out.groups:
        assert len({r.problem_id for r in g.rollouts}) == 1 and g.env_id == "test_letters_agent"
        assert len({tuple(r.token_ids) for r in g.rollouts}) > 1  # samples in a group differ
        for r in g.rollouts:
            assert isinstance(r, TokenRollout) and r.ok
            prompt = r.prompt.encode()
            assert r.token_ids[:r.prompt_length] == list(prompt)
            assert r.generation_mask == [0] * len(prompt) + [1] * (len(r.token_ids) - len(prompt))
            # logprobs at generated positions == a teacher-forced "forward" of the fake model at T=0.8
            ref = fake.score(r.token_ids, r.prompt_length, temperature=0.8)
            np.testing.assert_allclose(r.generated_logprobs, ref, atol=1e-12)
            assert r.reward == pytest.approx(sum(c.isalpha() for c in r.completion) / max(len(r.completion), 1))


def test_seeded_generation_is_deterministic_and_groups_run_concurrently():
    a = asyncio.run(LettersAgent().generate_grouped_rollouts(_request(FakeInference())))
    counting = CountingBackend(FakeInference())
    b = asyncio.run(LettersAgent().generate_grouped_rollouts(_request(counting, groups=5)))
    assert [r.token_ids for g in a.groups for r in g.rollouts] == \
        [r.token_ids for g in b.groups[:3] for r in g.rollouts]
    assert counting.calls == 5 and counting.max_inflight == 5  # one batched call per group, all in flight


def test_multi_turn_mask_excludes_observation_tokens():
    fake = FakeInference(eos_bias=-50.0)  # never ends with EOS, so every turn ends on "\n" or max_tokens
    agent = EchoToolAgent()
    out = asyncio.run(agent.generate_grouped_rollouts(_request(fake, groups=2, size=3, max_tokens=6)))
    for g in out.groups:
        for r in g.rollouts:
            assert r.ok and r.metadata["num_turns"] == 3 and r.reward == 3.0
            assert r.metadata["untrained_generated_tokens"] == 0
            text = bytes(r.token_ids).decode()
            assert text == r.prompt + r.completion + ("\n" if r.metadata["finish_reasons"][-1] == "stop" else "")
            # rebuild the expected mask from the transcript: generated text (+ its "\n" stop) is 1, "OBS k\n" is 0
            expected = [0] * r.prompt_length
            completion = r.completion
            for turn, reason in enumerate(r.metadata["finish_reasons"], 1):
                obs = f"\nOBS {turn}\n" if turn < 3 else ""
                end = completion.index(obs) if obs else len(completion)
                stopped = 1 if reason == "stop" else 0  # the generated "\n" stop token is the policy's
                expected += [1] * (end + stopped) + [0] * max(len(obs) - stopped, 0)
                completion = completion[end + len(obs):]
            assert r.generation_mask == expected
            for k in (1, 2):
                start = text.index(f"OBS {k}\n")
                assert not any(r.generation_mask[start:start + len(f"OBS {k}\n")])
            ref = fake.score(r.token_ids, 1, temperature=1.0)  # bigram model: context = the previous token
            got = [lp for lp, m in zip(r.logprobs[1:], r.generation_mask[1:]) if m]
            np.testing.assert_allclose(got, [x for x, m in zip(ref, r.generation_mask[1:]) if m], atol=1e-12)


def test_merge_turn_tokens_drops_tokens_lost_to_retokenization():
    resp = InferenceResponse(text="z", token_ids=[1, 2, 9, 8, 7], prompt_length=4, logprobs=[-0.7],
                             finish_reason="stop")
    ids, mask, lps, lost = merge_turn_tokens([1, 2, 3, 4], [0, 0, 1, 1], [0.0, 0.0, -0.1, -0.2], resp)
    assert ids == [1, 2, 9, 8, 7] and mask == [0, 0, 0, 0, 1] and lps == [0, 0, 0, 0, -0.7] and lost == 2
    ids, mask, lps, lost = merge_turn_tokens([1, 2, 3], [0, 1, 1], [0.0, -0.1, -0.2],
                                             InferenceResponse(text="z", token_ids=[1, 2, 3, 5, 6], prompt_length=4,
                                                               logprobs=[-0.3], finish_reason="stop"))
    assert mask == [0, 1, 1, 0, 1] and lps == [0.0, -0.1, -0.2, 0.0, -0.3] and lost == 0


@pytest.mark.parametrize("mode, reason", [("raise", "reward exploded"), ("nan", "finite")])
def test_failed_scoring_is_explicit(mode, reason):
    out = asyncio.run(BrokenRewardAgent(mode=mode).generate_grouped_rollouts(_request(FakeInference(), groups=1)))
    for r in out.groups[0].rollouts:
        assert r.status == "failed" and "scoring failed" in r.failure_reason and reason in r.failure_reason
        assert r.reward == 0.0
    assert out.groups[0].num_failed == 4


def test_inference_error_becomes_failed_rollout():
    out = asyncio.run(LettersAgent().generate_grouped_rollouts(_request(FakeInference(max_seq_len=5), groups=2)))
    assert all(r.status == "failed" and "inference error" in r.failure_reason
               for g in out.groups for r in g.rollouts)


def test_generate_rollouts_and_missing_backend():
    out = asyncio.run(LettersAgent().generate_rollouts(RolloutRequest(
        num_rollouts=3, inference_interface=FakeInference(), generation_args=GenerationArgs(max_tokens=4, seed=1))))
    assert len(out.rollouts) == 3 and len({r.problem_id for r in out.rollouts}) == 3
    with pytest.raises(Exception, match="no inference backend"):
        asyncio.run(LettersAgent().generate_grouped_rollouts(GroupedRolloutRequest(num_groups=1,
                                                                                   rollouts_per_group=1)))
    agent = LettersAgent()
    agent.bind_inference(FakeInference())
    assert asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=1, rollouts_per_group=2, generation_args=GenerationArgs(max_tokens=3)))).groups[0].rollouts


def _problem_ids(agent, n):
    out = asyncio.run(agent.generate_grouped_rollouts(_request(FakeInference(), groups=n, size=1, max_tokens=1)))
    return [g.problem_id for g in out.groups]


def test_dp_ranks_draw_disjoint_prompts_and_state_resumes():
    r0, r1 = LettersAgent(seed=3), LettersAgent(seed=3)
    r0.set_data_parallel(0, 2)
    r1.set_data_parallel(1, 2)
    a, b = _problem_ids(r0, 5), _problem_ids(r1, 5)
    assert sorted(a + b) == [f"p{i}" for i in range(10)]

    agent = LettersAgent(seed=11)
    _problem_ids(agent, 4)
    state = agent.state_dict()
    expected = _problem_ids(agent, 8)
    resumed = LettersAgent(seed=11)
    resumed.load_state_dict(state)
    assert _problem_ids(resumed, 8) == expected
    assert _problem_ids(LettersAgent(seed=11), 4) != _problem_ids(LettersAgent(seed=12), 4)


def test_basic_evaluate_and_inference_spec_requests():
    from megatron.rl.agent.api import EvaluationRequest, InferenceSpec

    agent = LettersAgent()
    spec = InferenceSpec(backend="fake", kwargs={"max_seq_len": 512})
    req = EvaluationRequest(num_prompts=4, num_samples=3, inference=spec,
                            generation_args=GenerationArgs(max_tokens=5, seed=2))
    out = asyncio.run(agent.evaluate(req))
    assert [r.problem_id for r in out.results] == ["p0", "p1", "p2", "p3"]
    assert all(len(r.rewards) == 3 for r in out.results)
    assert out.metrics["mean_reward"] == pytest.approx(np.mean([np.mean(r.rewards) for r in out.results]))
    backend = agent.resolve_inference(req)
    assert isinstance(backend, FakeInference) and backend.max_seq_len == 512
    assert agent.resolve_inference(req) is backend  # built once per spec


# -- rewards run off the event loop, bounded in time ---------------------------------------------------------------
_LOOP_RAN = threading.Event()


class BlockingRewardAgent(LettersAgent):
    """Problem 0's reward waits (in its thread) until another coroutine on the event loop has run: it can only
    finish if the loop is free while a reward is being computed."""

    def compute_reward(self, problem, completion):
        if problem["id"] == "p0":
            return 1.0 if _LOOP_RAN.wait(timeout=5.0) else -1.0
        return 0.5


def test_a_slow_reward_does_not_stall_the_event_loop():
    _LOOP_RAN.clear()
    agent = BlockingRewardAgent(seed=0)
    req = GroupedRolloutRequest(num_groups=10, rollouts_per_group=2, generation_args=GenerationArgs(max_tokens=4),
                                inference_interface=FakeInference())

    async def main():
        async def ticker():
            await asyncio.sleep(0.05)  # runs only if rewards do not block the loop
            _LOOP_RAN.set()
        tick = asyncio.create_task(ticker())
        out = await agent.generate_grouped_rollouts(req)
        await tick
        return out

    out = asyncio.run(main())
    rewards = {g.problem_id: g.rewards for g in out.groups}
    assert rewards["p0"] == [1.0, 1.0], rewards  # -1.0: the loop was blocked while the reward ran


class SlowRewardAgent(LettersAgent):
    def compute_reward(self, problem, completion):
        if problem["id"] == "p1":
            time.sleep(1.0)
        return 1.0


def test_reward_timeout_fails_the_rollout_not_the_batch():
    agent = SlowRewardAgent(seed=0, reward_timeout_s=0.2)
    req = GroupedRolloutRequest(num_groups=10, rollouts_per_group=2, generation_args=GenerationArgs(max_tokens=4),
                                inference_interface=FakeInference())
    out = asyncio.run(agent.generate_grouped_rollouts(req))
    by_id = {g.problem_id: g for g in out.groups}
    assert all(r.status == "failed" and "reward_timeout_s=0.2" in r.failure_reason for r in by_id["p1"].rollouts)
    assert all(g.rewards == [1.0, 1.0] for pid, g in by_id.items() if pid != "p1")
    with pytest.raises(ValueError):
        SlowRewardAgent(reward_timeout_s=float("nan"))


class SteadyRewardAgent(LettersAgent):
    def compute_reward(self, problem, completion):
        time.sleep(0.2)
        return 1.0


def test_reward_timeout_counts_from_the_start_not_the_queue(monkeypatch):
    """Six 0.2 s rewards on one thread take 1.2 s in all; none overran its 0.6 s budget, so none fails."""
    from concurrent.futures import ThreadPoolExecutor

    import megatron.rl.agent.reward_only_agent as roa

    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(roa, "_POOL", pool)
    agent = SteadyRewardAgent(seed=0, reward_timeout_s=0.6)
    req = GroupedRolloutRequest(num_groups=3, rollouts_per_group=2, generation_args=GenerationArgs(max_tokens=4),
                                inference_interface=FakeInference())
    out = asyncio.run(agent.generate_grouped_rollouts(req))
    pool.shutdown()
    assert [r.status for g in out.groups for r in g.rollouts] == ["ok"] * 6


_P1_SCORING = threading.Event()


class HangingRewardAgent(LettersAgent):
    def compute_reward(self, problem, completion):
        if problem["id"] == "p1":
            _P1_SCORING.set()
            time.sleep(3.0)
        return 1.0


class AfterP1Inference(FakeInference):
    """Answers p1 at once and every other problem only once p1's reward holds the pool's thread, so the other
    rewards are queued behind it whatever order the machine's load would give."""

    async def agenerate(self, requests):
        if not any("Problem 1:" in (r.prompt or "") for r in requests):
            for _ in range(3000):
                if _P1_SCORING.is_set():
                    break
                await asyncio.sleep(0.01)
        return await super().agenerate(requests)


def test_rewards_queued_behind_overrunning_ones_fail_instead_of_waiting(monkeypatch):
    """With every pool thread held by a reward past its timeout, queued rewards fail (named) rather than wait."""
    from concurrent.futures import ThreadPoolExecutor

    import megatron.rl.agent.reward_only_agent as roa

    pool = ThreadPoolExecutor(max_workers=1)
    monkeypatch.setattr(roa, "_POOL", pool)
    monkeypatch.setattr(roa, "_POOL_THREADS", 1)
    _P1_SCORING.clear()
    agent = HangingRewardAgent(seed=0, reward_timeout_s=0.3)
    req = GroupedRolloutRequest(num_groups=10, rollouts_per_group=1, generation_args=GenerationArgs(max_tokens=4),
                                inference_interface=AfterP1Inference())
    out = asyncio.run(agent.generate_grouped_rollouts(req))
    reasons = {g.problem_id: g.rollouts[0].failure_reason for g in out.groups}
    assert "took longer than reward_timeout_s=0.3" in reasons["p1"], reasons
    assert any(r and "every reward thread is held" in r for r in reasons.values()), reasons
    pool.shutdown(wait=True)
    assert roa._overrunning == [0]  # the overrun is accounted back once the thread returns


class RoutingBackend(InferenceInterface):
    """The fake backend plus MoE routes, as the in-process engine returns them: the route of position p in turn t's
    request is t * 1000 + p (one layer, top-1), and the response's last token has none (-1)."""

    def __init__(self, inner):
        self.inner = inner

    async def agenerate(self, requests):
        from megatron.rl.base.routes import Routes

        out = await self.inner.agenerate(requests)
        for req, resp in zip([r for r in requests for _ in range(r.generation_args.n)], out):
            turn = req.prompt.count("OBS")
            values = np.array([turn * 1000 + p for p in range(len(resp.token_ids) - 1)] + [-1])
            resp.routes = Routes.from_tensor(values.reshape(1, -1, 1), num_experts=4000)
        return out


def test_multi_turn_rollouts_keep_each_tokens_route_from_the_first_turn_that_ran_it():
    agent = EchoToolAgent()
    backend = RoutingBackend(FakeInference(eos_bias=-50.0))
    out = asyncio.run(agent.generate_grouped_rollouts(_request(backend, groups=2, size=2, max_tokens=6)))
    for r in (r for g in out.groups for r in g.rollouts):
        assert r.ok and r.metadata["num_turns"] == 3
        routes = r.routes.tensor()[0, :, 0].tolist()
        text = bytes(r.token_ids).decode()
        # turn t's response ends where its generation did: before "\nOBS t+1\n", or one token into it when the
        # turn stopped at its "\n" (the policy's stop token)
        reasons = r.metadata["finish_reasons"]
        ends = [text.index(f"\nOBS {t + 1}\n") + (reasons[t] == "stop") for t in (0, 1)] + [len(text)]
        expected = [next(t for t, end in enumerate(ends) if p < end - 1) * 1000 + p for p in range(len(text) - 1)]
        assert routes == expected + [-1]


_REWARD_THREADS: list[str] = []


class InlineLettersAgent(LettersAgent):
    """Its reward records the thread it runs on; with inline_rewards, the event loop's."""

    inline_rewards = True

    def compute_reward(self, problem, completion):
        _REWARD_THREADS.append(threading.current_thread().name)
        if problem["id"] == "p1":
            raise RuntimeError("reward exploded")
        return super().compute_reward(problem, completion)


@pytest.mark.parametrize("inline", [True, False])
def test_inline_rewards_run_on_the_event_loop_and_still_fail_alone(inline, monkeypatch):
    monkeypatch.setattr(InlineLettersAgent, "inline_rewards", inline)
    _REWARD_THREADS.clear()
    agent = InlineLettersAgent(seed=0)
    req = GroupedRolloutRequest(num_groups=3, rollouts_per_group=2, generation_args=GenerationArgs(max_tokens=4),
                                inference_interface=FakeInference())
    out = asyncio.run(agent.generate_grouped_rollouts(req))
    here = threading.current_thread().name  # asyncio.run's loop runs on this thread
    assert len(_REWARD_THREADS) == 6
    assert all((name == here) == inline for name in _REWARD_THREADS), _REWARD_THREADS
    by_id = {g.problem_id: g for g in out.groups}
    assert all(r.status == "failed" and "reward exploded" in r.failure_reason for r in by_id["p1"].rollouts)
    assert all(r.status == "ok" for pid, g in by_id.items() if pid != "p1" for r in g.rollouts)


def test_the_arithmetic_environment_scores_inline():
    from megatron.rl.environments.arithmetic import ArithmeticAgent

    assert ArithmeticAgent.inline_rewards and not RewardOnlyAgent.inline_rewards
