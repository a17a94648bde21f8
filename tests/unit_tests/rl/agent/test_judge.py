"""The generative judge and type: model_reward with a deterministic scripted judge: score parsing, batching,
every failure an explicit failed rollout (reason in failure_reason, kind in the metrics, both in samples),
weighted combination with the environment's rule reward."""
import asyncio
import re

import pytest

from megatron.rl.agent.api import GroupedRolloutRequest
from megatron.rl.agent.env_config import EnvConfigError, build_agent_from_config
from megatron.rl.agent.judge import JudgeConfig, judge_completions, parse_score
from megatron.rl.agent.model_reward import ModelRewardAgent
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, InferenceResponse
from megatron.rl.inference.fake import FakeInference
from megatron.rl.observe.metrics import summarize_groups, summary_metrics
from megatron.rl.observe.samples import rollout_sample


class ScriptedJudge(InferenceInterface):
    """Answers from the graded completion (the text after 'Answer: '): a backend error when it starts with '!',
    nothing (sleeps) for '~', else 'SCORE: n' with n its number of digits when it has any, else 'no idea'."""

    def __init__(self):
        self.batches = []

    async def agenerate(self, requests):
        self.batches.append(len(requests))
        out = []
        for r in requests:
            completion = r.prompt.split("Answer: ", 1)[1].split("\n", 1)[0]
            head, digits = completion[:1], sum(c.isdigit() for c in completion)
            if head == "~":
                await asyncio.sleep(30)
            if head == "!":
                out.append(InferenceResponse.failed("judge server overloaded"))
            elif digits:
                out.append(InferenceResponse(text=f"Fine. SCORE: {min(digits, 10)}", token_ids=[],
                                             prompt_length=0, finish_reason="stop"))
            else:
                out.append(InferenceResponse(text="no idea", token_ids=[], prompt_length=0, finish_reason="stop"))
        return out


def test_parse_score():
    p = re.compile(JudgeConfig().score_regex)
    assert parse_score("SCORE: 3 ... SCORE: 7.5", p, (0, 10)) == 0.75  # the last one counts
    assert parse_score("SCORE:10", p, (0, 10)) == 1.0 and parse_score("SCORE: 1", p, (1, 5)) == 0.0
    for bad, msg in [("nothing", "no score"), ("SCORE: 11", "outside score_range"), ("SCORE: -1", "outside")]:
        with pytest.raises(ValueError, match=msg):
            parse_score(bad, p, (0, 10))


def test_verdicts_batches_and_failure_kinds():
    judge = ScriptedJudge()
    cfg = JudgeConfig(batch_size=3, timeout_s=0.5)
    pairs = [("Q1", "12"), ("Q2", "abc"), ("Q3", "!"), ("Q4", "1234567"), ("Q5", "9"), ("Q6", "~")]
    verdicts = asyncio.run(judge_completions(cfg, judge, pairs))
    assert sorted(judge.batches) == [3, 3]
    assert [v.score for v in verdicts[:2]] == [0.2, None]
    # the second batch holds the request the judge never answers: it times out as a whole
    assert [v.kind for v in verdicts] == [None, "judge_unparsable", "judge_error"] + ["judge_timeout"] * 3
    assert "no score in the judge's answer: 'no idea'" in verdicts[1].error
    assert "judge server overloaded" in verdicts[2].error and "timeout_s=0.5" in verdicts[5].error


def _wrapped(rule_weight=0.5, judge_weight=2.0):
    agent = ModelRewardAgent(env={"type": "arithmetic", "args": {"max_tokens": 3}}, rule_weight=rule_weight,
                             judge={"weight": judge_weight, "batch_size": 4}, env_id="judged")
    judge = ScriptedJudge()
    agent.bind_judge_inference(judge)
    return agent, judge


def test_model_reward_combines_and_fails_explicitly():
    agent, judge = _wrapped()
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=6, rollouts_per_group=4, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=3, seed=7))))
    rollouts = [r for g in out.groups for r in g.rollouts]
    assert all(r.env_id == "judged" for r in rollouts) and max(judge.batches) <= 4
    ok = [r for r in rollouts if r.ok]
    failed = [r for r in rollouts if not r.ok]
    assert ok and failed  # the fake policy writes digits and letters: both kinds occur
    for r in ok:
        c = r.metadata["reward_components"]
        assert c["judge"] == min(sum(ch.isdigit() for ch in r.completion), 10) / 10
        assert r.reward == pytest.approx(0.5 * c["rule"] + 2.0 * c["judge"])
    for r in failed:
        assert r.reward == 0.0 and r.metadata["failure_kind"] == "judge_unparsable"
        assert r.failure_reason.startswith("judge: no score in the judge's answer")
    metrics = summary_metrics(summarize_groups(out.groups, max_new_tokens=3))
    assert metrics["env/judged/failures/judge_unparsable"] == len(failed) == metrics["env/judged/failed_rollouts"]
    assert metrics["env/judged/reward/judge"] == pytest.approx(sum(r.metadata["reward_components"]["judge"]
                                                                   for r in ok) / len(ok))
    sample = rollout_sample(failed[0], "judged")
    assert sample["failure_reason"] == failed[0].failure_reason and sample["reward_components"]["rule"] in (0.0, 1.0)
    # the wrapped environment's prompt position is the checkpointed state
    assert agent.state_dict() == agent.env.state_dict() and agent.state_dict()["train_stream"]["consumed_global"] == 6


def test_judge_from_the_env_config_never_reads_an_unparsable_answer_as_zero():
    agent = build_agent_from_config([{"type": "model_reward", "name": "j", "args": {
        "env": {"type": "arithmetic"}, "rule_weight": 0.0,
        "judge": {"inference": {"backend": "fake"}, "max_tokens": 4}}}])
    out = asyncio.run(agent.generate_grouped_rollouts(GroupedRolloutRequest(
        num_groups=2, rollouts_per_group=2, inference_interface=FakeInference(),
        generation_args=GenerationArgs(max_tokens=3, seed=1))))
    # the fake backend, as a judge, babbles: every rollout is failed with the judge's answer quoted
    assert all(not r.ok and r.failure_reason.startswith("judge: no score") for g in out.groups for r in g.rollouts)


@pytest.mark.parametrize("args, piece", [
    ({"env": {"type": "arithmetic"}}, "needs a 'judge' or a 'reward_model'"),
    ({"env": {"type": "arithmetic"}, "judge": {"template": "{prompt} {answer}"}}, "field {answer} is not allowed"),
    ({"env": {"type": "arithmetic"}, "judge": {"score_regex": "SCORE"}}, "needs a group"),
    ({"env": {"type": "arithmetic"}, "judge": {"score_range": [5, 1]}}, "low < high"),
    ({"env": {"type": "nope"}, "judge": {}}, "unknown Agent type 'nope'"),
])
def test_configuration_errors(args, piece):
    with pytest.raises(EnvConfigError, match=re.escape(piece)):
        build_agent_from_config([{"type": "model_reward", "args": args}])


def test_model_reward_round_trips_through_json():
    """The environment server and the multi-task agent rebuild agents from JSON: the wrapped env comes back."""
    from megatron.rl.agent.weighted_multi_task import WeightedMultiTaskAgent

    agent = build_agent_from_config([{"type": "model_reward", "name": "m", "args": {
        "env": {"type": "arithmetic", "args": {"max_digits": 1}}, "rule_weight": 0.3,
        "judge": {"inference": {"backend": "fake"}, "score_range": [1, 5]}}}])
    clone = WeightedMultiTaskAgent.model_validate_json(agent.model_dump_json()).entries[0].agent
    assert type(clone) is ModelRewardAgent and type(clone.env).__name__ == "ArithmeticAgent"
    assert clone.env.max_digits == 1 and clone.rule_weight == 0.3 and clone.judge.score_range == (1.0, 5.0)
