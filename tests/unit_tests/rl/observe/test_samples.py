"""Which sample completions get logged, and how they look."""
from megatron.rl.observe.samples import (COMPLETION_MAX_CHARS, rollout_sample, sample_candidates, samples_markdown,
                                    select_samples, spread_indices, truncate_middle)
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout


def cand(env, reward, status="ok", name=""):
    return {"env": env, "reward": reward, "status": status, "name": name or f"{env}{reward}"}


def test_truncate_middle_keeps_both_ends_and_says_how_much_was_cut():
    assert truncate_middle("short", 10) == "short"
    text = "A" * 50 + "B" * 100 + "C" * 50
    out = truncate_middle(text, 60)
    assert out.startswith("A" * 40) and out.endswith("C" * 20)
    assert "[... 140 characters cut ...]" in out
    assert len(out) - len("[... 140 characters cut ...]") == 60


def test_spread_indices():
    assert spread_indices(10, 1) == [4]
    assert spread_indices(10, 2) == [0, 9]
    assert spread_indices(10, 4) == [0, 3, 6, 9]
    assert spread_indices(3, 5) == [0, 1, 2]
    assert spread_indices(0, 3) == [] and spread_indices(5, 0) == []


def test_selection_goes_round_robin_over_environments_and_spreads_rewards():
    cands = [cand("b", r / 10) for r in range(10)] + [cand("a", 0.5), cand("a", 0.0, "failed")]
    out = select_samples(cands, 5)
    # a has 2 candidates (both taken: failed first), b gets the remaining 3: lowest, middle, highest reward
    assert [(s["env"], s["reward"], s["status"]) for s in out] == [
        ("a", 0.0, "failed"), ("a", 0.5, "ok"), ("b", 0.0, "ok"), ("b", 0.4, "ok"), ("b", 0.9, "ok")]
    assert len(select_samples(cands, 100)) == len(cands)
    assert select_samples(cands, 0) == []


def test_selection_is_deterministic_and_ties_keep_candidate_order():
    cands = [cand("e", 1.0, name=f"n{i}") for i in range(7)]
    assert [s["name"] for s in select_samples(cands, 3)] == ["n0", "n3", "n6"]
    assert select_samples(cands, 3) == select_samples(list(cands), 3)


def _rollout(env, reward, completion="c"):
    return TokenRollout(prompt="Q:", completion=completion, reward=reward, env_id=env, problem_id="p",
                        token_ids=[1, 2, 3], generation_mask=[0, 1, 1], prompt_length=1,
                        metadata={"num_turns": 1, "finish_reasons": ["stop"]})


def test_candidates_per_rank_keep_every_environment_for_the_final_choice():
    # rank 0 sees mostly env "a"; rank 1 only "b": the final 2 samples must still show both environments
    rank0 = [RolloutGroup(env_id="a", rollouts=[_rollout("a", r) for r in (0.0, 0.2, 0.4, 0.6)])]
    rank1 = [RolloutGroup(env_id="b", rollouts=[_rollout("b", 1.0)])]
    union = sample_candidates(rank0, 2) + sample_candidates(rank1, 2)
    assert [(s["env"], s["reward"]) for s in union] == [("a", 0.0), ("a", 0.6), ("b", 1.0)]
    assert [s["env"] for s in select_samples(union, 2)] == ["a", "b"]
    assert sample_candidates(rank0, 0) == []


def test_sample_fields_and_long_completion_truncation():
    long = "word " * 1000
    s = rollout_sample(_rollout("a", 0.5, completion=long), "a")
    assert s["env"] == "a" and s["reward"] == 0.5 and s["response_tokens"] == 2 and s["turns"] == 1
    assert s["finish_reasons"] == ["stop"] and s["status"] == "ok" and s["failure_reason"] is None
    assert len(s["completion"]) < COMPLETION_MAX_CHARS + 40 and "characters cut" in s["completion"]
    chat = Rollout(prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
                   completion="", reward=0.0, status="failed", failure_reason="scoring failed: boom", env_id="c")
    f = rollout_sample(chat, "c")
    assert f["prompt"] == "system: be brief\nuser: 2+2?" and f["status"] == "failed" and f["response_tokens"] is None


def test_markdown_keeps_whitespace_completions_visible():
    spaces = {**rollout_sample(_rollout("a", 0.0, completion=" " * 8), "a")}
    md = samples_markdown([spaces, rollout_sample(_rollout("b", 1.0, completion="has ``` fence"), "b")])
    assert "```\n        \n```" in md  # 8 spaces inside a code block
    assert "````\nhas ``` fence\n````" in md  # a longer fence around text containing one
    assert "**1. a**" in md and "**2. b**" in md and "reward **0**" in md
