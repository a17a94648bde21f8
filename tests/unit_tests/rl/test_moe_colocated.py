"""Expert parallelism at the training layout with the default in-process backend: prompts split by lockstep group.

With EP > 1 the ranks of an expert-parallel group form one lockstep group that serves its lowest rank's
requests. Split by training data-parallel rank, the other ranks would ask for other prompts and every one of
their rollouts would fail ("model-parallel ranks submitted different requests": 8 of 16 per iteration here).
Every rank of a lockstep group asks for the same prompts, and the groups are regrouped by data-parallel rank
afterwards.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from megatron.rl.inference.engine.lockstep import lockstep_rank_groups
from megatron.rl.inference.control import RolloutShard
from megatron.rl.layout.groups import layout_rank_lists, LayoutSizes
from tests.conftest import run_torchrun

SCRIPT = Path(__file__).parent / "scripts" / "moe_colocated_run.py"
AGENTS = "tests.unit_tests.rl.rl_test_agents"


# ------------------------------------------------------------------------------------------ the split itself


@pytest.mark.parametrize("world,tp,pp,ep,expected", [
    (2, 1, 1, 1, [[0], [1]]),  # pure DP: one group per rank
    (4, 2, 1, 1, [[0, 1], [2, 3]]),  # TP: the tensor-parallel pairs
    (8, 2, 2, 1, [[0, 1, 4, 5], [2, 3, 6, 7]]),  # TP x PP: the model-parallel groups
    (2, 1, 1, 2, [[0, 1]]),  # EP=2 on 2 ranks: both data-parallel ranks serve one engine
    (4, 1, 1, 2, [[0, 1], [2, 3]]),
    (8, 2, 1, 2, [[0, 1, 2, 3], [4, 5, 6, 7]]),  # EP joins two TP pairs
    (8, 1, 2, 2, [[0, 1, 4, 5], [2, 3, 6, 7]]),
    (8, 1, 1, 8, [list(range(8))]),
])
def test_which_ranks_share_a_lockstep_group(world, tp, pp, ep, expected):
    assert lockstep_rank_groups(world, tp, pp, ep) == expected


def test_expert_tensor_parallel_size_joins_groups_too():
    # TP=1 for attention but expert TP=2: the expert-TP pairs run their forwards together
    assert lockstep_rank_groups(4, 1, 1, 1, expert_tp=2) == [[0, 1], [2, 3]]
    assert lockstep_rank_groups(4, 2, 1, 1, expert_tp=1) == [[0, 1], [2, 3]]


def _shards(world, tp, pp, ep):
    groups = lockstep_rank_groups(world, tp, pp, ep)
    return [RolloutShard.for_lockstep(groups, r) for r in range(world)]


@pytest.mark.parametrize("world,tp,pp", [(2, 1, 1), (4, 2, 1), (4, 1, 2), (8, 2, 2), (8, 1, 2)])
def test_without_expert_parallelism_the_groups_are_the_data_parallel_ranks(world, tp, pp):
    """So the backend keeps today's split (by DP rank, no regrouping) whenever EP = 1."""
    s = LayoutSizes(world=world, tp=tp, pp=pp)
    dp_rank = {r: i for ranks in layout_rank_lists(s)["dp"] for i, r in enumerate(ranks)}
    shards = _shards(world, tp, pp, 1)
    assert all(sh.size == s.dp for sh in shards)
    assert [sh.rank for sh in shards] == [dp_rank[r] for r in range(world)]


@pytest.mark.parametrize("world,tp,pp,ep,expected_rank,expected_sources", [
    (2, 1, 1, 2, [0, 0], [0]),  # the failing case: ranks 0 and 1 ask for the same (all) prompts
    (4, 1, 1, 2, [0, 0, 1, 1], [0, 2]),
    (8, 2, 1, 2, [0, 0, 0, 0, 1, 1, 1, 1], [0, 4]),
    (8, 1, 2, 2, [0, 0, 1, 1, 0, 0, 1, 1], [0, 2]),
])
def test_which_share_each_rank_collects_with_expert_parallelism(world, tp, pp, ep, expected_rank, expected_sources):
    shards = _shards(world, tp, pp, ep)
    assert [sh.rank for sh in shards] == expected_rank
    assert all(sh.size == len(expected_sources) and sh.sources == expected_sources for sh in shards)
    dp = world // (tp * pp)
    # every data-parallel rank gets an equal, disjoint part of all groups' prompts after regrouping
    per_group = [[f"g{i}.{j}" for j in range(dp)] for i in range(len(expected_sources))]
    shard = shards[0]
    shard.gather = lambda obj: per_group  # type: ignore[method-assign]
    parts = [shard.regroup_for_training([], d, dp) for d in range(dp)]
    assert [g for part in parts for g in part] == [g for groups in per_group for g in groups]


# ------------------------------------------------------------------------------------------ a 2-process MoE run

FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11", "--grpo-prompts-per-step", "4",
         "--grpo-group-size", "4", "--rl-max-new-tokens", "8", "--rl-use-sequence-packing", "--log-interval", "1",
         "--langrl-allow-imports", "--num-experts", "4", "--moe-router-topk", "2",
         "--expert-model-parallel-size", "2", "--train-iters", "2", "--rl-prompts-per-eval", "4",
         "--eval-interval", "2"]


@pytest.mark.multiprocess
@pytest.mark.slow  # ~70 s on the loaded 2-core machine
def test_moe_ep2_colocated_run_gets_every_rollout_and_the_ranks_train_on_the_same_data(tmp_path):
    env = tmp_path / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    proc = run_torchrun(SCRIPT, [*FLAGS, "--langrl-env-config", env], timeout=600,
                        env={"RESULT_DIR": str(result_dir)})
    ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    assert len(ranks) == 2, proc.stdout[-4000:]
    for r in ranks:
        assert len(r["collected"]) == len(r["trained"]) == 2
        for it, (mine, everyone) in enumerate(zip(r["collected"], r["trained"])):
            # this data-parallel rank's half: 2 of the 4 prompt groups, 4 rollouts each, none failed
            assert mine["rollouts"] == [4, 4] and mine["failed"] == 0, (r["rank"], it, mine)
            # all 4 x 4 requested rollouts came back and are trained on
            assert (everyone["groups"], everyone["rollouts"], everyone["failed"]) == (4, 16, 0), everyone
            assert everyone["sequences"] == 16, everyone
        assert [h["failed_rollouts"] for h in r["history"]] == [0.0, 0.0]
        assert [e["eval/HashReward/num_prompts"] for e in r["evals"]] == [4, 4], r["evals"]
    first, second = ranks
    for a, b in zip(first["collected"], second["collected"]):
        # the two data-parallel ranks hold different halves of one set of prompts (nothing trained twice)
        assert not set(a["problems"]) & set(b["problems"]) and len(set(a["problems"] + b["problems"])) == 4
    # the lockstep group's ranks train on the same global batch, so their losses agree
    assert [t["digest"] for t in first["trained"]] == [t["digest"] for t in second["trained"]]
    assert [h["rl_loss"] for h in first["history"]] == [h["rl_loss"] for h in second["history"]]
    # and the iterations differ (the prompt stream moved on, shared by the group)
    assert first["collected"][0]["problems"] != first["collected"][1]["problems"]


@pytest.mark.multiprocess
@pytest.mark.slow  # ~100 s on the loaded 2-core machine
def test_inference_copy_with_expert_parallelism_gets_every_rollout(tmp_path):
    """The same bug in the separate layout: train TP=2 (EP=1), generate with a TP=1 EP=2 copy. The copy's two
    replicas share one EP group, so one engine; prompts were split by replica and the groups gathered from the
    group's one source, so half the rollouts (and evaluation prompts) were dropped without a failure count."""
    env = tmp_path / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    result_dir = tmp_path / "results"
    result_dir.mkdir()
    ep = FLAGS.index("--expert-model-parallel-size")
    flags = FLAGS[:ep] + FLAGS[ep + 2:]  # training EP 1
    script = Path(__file__).parent / "layout" / "scripts" / "layout_rl_run.py"
    run_torchrun(script, [*flags, "--langrl-env-config", env, "--tensor-model-parallel-size", "2",
                          "--sequence-parallel", "--disable-bias-linear", "--rl-inference-tensor-model-parallel-size",
                          "1", "--rl-inference-expert-model-parallel-size", "2", "--rl-verify-model-weights-swap"],
                 timeout=600, env={"LAYOUT_RESULT_DIR": str(result_dir)})
    ranks = [json.loads(p.read_text()) for p in sorted(result_dir.glob("rank*.json"))]
    assert len(ranks) == 2
    for r in ranks:
        assert [(h["num_sequences"], h["failed_rollouts"]) for h in r["history"]] == [(16.0, 0.0), (16.0, 0.0)]
        assert max(h["logprob_gap_max"] for h in r["history"]) < 1e-5
        assert [e["eval/HashReward/num_prompts"] for e in r["evals"]] == [4, 4], r["evals"]
    assert ranks[0]["token_digests"] == ranks[1]["token_digests"]
