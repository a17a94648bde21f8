"""type: openenv against the real openenv-core package: multi-turn episodes token-in/token-out (each turn's
request carries the episode's exact tokens), rubric scores as reward components, explicit failures, sharding
and resume, configuration errors and the missing-package message."""
import asyncio
import json

import pytest

from megatron.rl.agent.api import EvaluationRequest, GroupedRolloutRequest
from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, InferenceResponse
from megatron.rl.inference.fake import FakeInference

pytest.importorskip("openenv.core.env_server.interfaces",
                    reason="openenv-core is not installed (pip install 'megatron-rl[openenv]')")

from tests.unit_tests.rl.environments import openenv_fixture_envs  # noqa: E402,F401  (the environment's module)

ENV = "tests.unit_tests.rl.environments.openenv_fixture_envs:GuessEnv"


class Recording(InferenceInterface):
    """Forwards to a backend and keeps every request and response."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    async def agenerate(self, requests):
        responses = await self.inner.agenerate(requests)
        self.calls += list(zip(requests, responses))
        return responses


class Scripted(InferenceInterface):
    """A byte-level 'policy' answering turn k with ``answers[k]`` (log-prob -0.5 per byte); turn k's prompt ends
    with the episode's (k+1)-th ':' (the first prompt and every hint end with one)."""

    def __init__(self, answers):
        self.answers = answers

    async def agenerate(self, requests):
        out = []
        for r in requests:
            ids = list(r.prefix_token_ids or []) + list(r.prompt.encode())
            text = self.answers[min(ids.count(ord(":")) - 1, len(self.answers) - 1)]
            out.append(InferenceResponse(text=text, token_ids=ids + list((text + "\n").encode()),
                                         prompt_length=len(ids), logprobs=[-0.5] * (len(text) + 1),
                                         finish_reason="stop"))
        return out


def _agent(**kw):
    return build_agent_from_config([{"type": "openenv", "name": "guess", "args": {
        "environment": ENV, "action_field": "guess", "observation_field": "prompt", "max_turns": 3,
        "stop": ["\n"], "max_tokens": 4, **kw}}]).entries[0].agent


def _run(agent, iface, groups=3, size=2, seed=1):
    return asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=groups, rollouts_per_group=size, inference_interface=iface,
        generation_args=GenerationArgs(max_tokens=4, seed=seed))))


def test_multi_turn_tokens_are_the_engines_tokens():
    rec = Recording(FakeInference())
    out = _run(_agent(), rec)
    rollouts = [r for g in out.groups for r in g.rollouts]
    assert all(r.ok for r in rollouts) and any(r.metadata["num_turns"] > 1 for r in rollouts)
    by_prefix = {}
    for req, resp in rec.calls:  # every later turn sent the previous response's tokens, unchanged
        if req.prefix_token_ids is not None:
            assert resp.token_ids[:len(req.prefix_token_ids)] == req.prefix_token_ids
        by_prefix[tuple(resp.token_ids)] = (req, resp)
    for r in rollouts:
        req, last = by_prefix[tuple(r.token_ids)]  # the rollout is exactly the last response's tokens
        turns, chain = [], last
        while chain is not None:
            turns.append(chain)
            prev = req.prefix_token_ids
            req, chain = by_prefix.get(tuple(prev), (None, None)) if prev else (None, None)
        turns.reverse()
        assert len(turns) == r.metadata["num_turns"]
        generated = [i for resp in turns for i in range(resp.prompt_length, len(resp.token_ids))]
        assert [i for i, m in enumerate(r.generation_mask) if m] == generated
        assert [r.logprobs[i] for i in generated] == [lp for resp in turns for lp in resp.logprobs]
        assert r.prompt_length == turns[0].prompt_length and r.prompt == "Guess 1-9:"


def test_rewards_and_rubric_components():
    out = _run(_agent(), Scripted(["0", "9", "5"]), groups=4, size=1)  # targets differ per seed: some solve
    solved = []
    for g in out.groups:
        r = g.rollouts[0]
        assert r.ok and r.completion.startswith("0\nhigher:9\nlower:5")
        solved.append(r.metadata["done"])
        # each step pays 0.2 for a short guess and the solving one 0.8 more; components are the last step's
        assert r.reward == pytest.approx(0.2 * r.metadata["num_turns"] + (0.8 if solved[-1] else 0.0))
        assert r.metadata["reward_components"] == pytest.approx(
            {"rubric": 1.0 if solved[-1] else 0.2, "total": 1.0 if solved[-1] else 0.2,
             "total.rubric_0": float(solved[-1]), "total.rubric_1": 1.0})
    assert True in solved and False in solved


def test_failures_are_explicit():
    crashed = _run(_agent(), Scripted(["boom"]), groups=1, size=2)
    assert all(not r.ok and "step() raised RuntimeError: the environment crashed on purpose" in r.failure_reason
               for r in crashed.groups[0].rollouts)
    rejected = _run(_agent(action_field="nope"), FakeInference(), groups=1, size=1)
    assert "GuessAction(nope=...) rejected the completion" in rejected.groups[0].rollouts[0].failure_reason
    wrong_obs = _run(_agent(observation_field="text"), FakeInference(), groups=1, size=1)
    assert "has no field 'text' (observation_field)" in wrong_obs.groups[0].rollouts[0].failure_reason


def test_sharded_resumable_and_evaluated():
    a = _agent()
    _run(a, FakeInference(), groups=3)
    state = json.loads(json.dumps(a.state_dict()))
    expected = [g.problem_id for g in _run(a, FakeInference(), groups=2).groups]
    b = _agent()
    b.load_state_dict(state)
    assert [g.problem_id for g in _run(b, FakeInference(), groups=2).groups] == expected == ["train-3", "train-4"]
    ranks = [_agent(), _agent()]
    for i, x in enumerate(ranks):
        x.set_data_parallel(i, 2)
    assert [[g.problem_id for g in _run(x, FakeInference(), groups=2).groups] for x in ranks] == \
        [["train-0", "train-2"], ["train-1", "train-3"]]
    ev = asyncio.run(a.evaluate(EvaluationRequest(num_prompts=4, num_samples=2, inference_interface=FakeInference(),
                                                  generation_args=GenerationArgs(max_tokens=4, seed=1))))
    assert ev.metrics["num_prompts"] == 4 and "pass@1" in ev.metrics


@pytest.mark.parametrize("args, piece", [
    ({"environment": "not_imported_pkg.envs:Env"}, "module 'not_imported_pkg.envs' is not imported"),
    ({"environment": ENV.replace("GuessEnv", "Missing")}, "has no class or factory 'Missing'"),
    ({"environment": "no_colon"}, "must be 'module:attribute'"),
])
def test_configuration_errors(args, piece):
    with pytest.raises(EnvConfigError, match=piece.replace("(", r"\(").replace(")", r"\)")):
        build_agent_from_config([{"type": "openenv", "args": args}])
