"""The separate inference layout's flags, checks and rank layout (no process group needed).

Every bad input is refused by ``rl_config_from_args`` (called by train_rl.py before any model is built)
with a ConfigError naming the flag.
"""
from __future__ import annotations

import pytest

from megatron.rl.layout.groups import LayoutSizes, layout_rank_lists, lockstep_ranks
from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.training.config import ConfigError, parse_args

MODEL = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "1", "--global-batch-size", "8",
         "--train-iters", "1", "--lr", "1e-3", "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
         "--rl-max-new-tokens", "8"]


@pytest.fixture
def env(tmp_path):
    p = tmp_path / "env.yaml"
    p.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    return str(p)


def _rl(env, *flags, world=2, cuda=False, monkeypatch=None):
    if monkeypatch is not None:
        monkeypatch.setattr("megatron.rl.runtime.cuda_usable", lambda: cuda)
    cfg = parse_args([*MODEL, "--langrl-env-config", env, *flags], extra_args_providers=[add_rl_args],
                     world_size=world)
    return rl_config_from_args(cfg)


def test_unset_means_no_copy(env, monkeypatch):
    rl = _rl(env, "--tensor-model-parallel-size", "2", monkeypatch=monkeypatch)
    assert not rl.inference_layout.enabled  # rl_loop then generates with the training model (no copy, no refit)


def test_valid_layout_and_defaults(env, monkeypatch):
    rl = _rl(env, "--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1",
             monkeypatch=monkeypatch)
    layout = rl.inference_layout
    assert layout.enabled and layout.resolved_refit_method(cuda=False) == "gloo"
    assert layout.resolved_refit_method(cuda=True) == "nccl"
    assert layout.sizes(parse_args([*MODEL, "--langrl-env-config", env, "--tensor-model-parallel-size", "2"],
                                   extra_args_providers=[add_rl_args], world_size=2)) == LayoutSizes(2, 1, 1, 1)


BAD = [
    # (flags, world, a phrase the message must contain)
    (["--rl-inference-tensor-model-parallel-size", "3", "--grpo-prompts-per-step", "6", "--global-batch-size", "24"],
     6, "--num-attention-heads=4"),
    (["--rl-inference-tensor-model-parallel-size", "4"], 2, "does not divide the world size 2"),
    (["--rl-inference-tensor-model-parallel-size", "2", "--group-query-attention", "--num-query-groups", "1"], 2,
     "--num-query-groups=1"),
    (["--rl-inference-pipeline-model-parallel-size", "3", "--untie-embeddings-and-output-weights",
      "--grpo-prompts-per-step", "6", "--global-batch-size", "24"], 6, "--num-layers=4"),
    (["--rl-inference-expert-model-parallel-size", "2"], 2, "needs a MoE model"),
    (["--num-experts", "3", "--rl-inference-expert-model-parallel-size", "2"], 2, "--num-experts=3"),
    (["--num-experts", "4", "--rl-inference-expert-model-parallel-size", "4"], 2, "does not divide the world size 2"),
    (["--rl-inference-pipeline-model-parallel-size", "2"], 2, "tied embeddings"),
    (["--rl-inference-tensor-model-parallel-size", "1", "--inference-backend", "openai",
      "--inference-server-url", "http://x"], 2, "--inference-backend openai"),
    (["--rl-inference-tensor-model-parallel-size", "1", "--refit-method", "nccl"], 2, "--refit-method nccl needs CUDA"),
    (["--refit-method", "nccl"], 2, "--refit-method nccl needs CUDA"),
    (["--tensor-model-parallel-size", "2", "--rl-inference-tensor-model-parallel-size", "1",
      "--grpo-prompts-per-step", "2", "--grpo-group-size", "8"], 4, "inference replicas"),
    (["--rl-inference-tensor-model-parallel-size", "0"], 2, "must be >= 1"),
]


@pytest.mark.parametrize("flags,world,phrase", BAD, ids=[b[2][:30] for b in BAD])
def test_bad_layouts_are_named_config_errors(env, monkeypatch, flags, world, phrase):
    with pytest.raises(ConfigError) as e:
        _rl(env, *flags, world=world, monkeypatch=monkeypatch)
    assert phrase in str(e.value)


def test_pipelined_copy_with_tied_embeddings_is_fine_when_the_trainer_is_pipelined_too(env, monkeypatch):
    rl = _rl(env, "--pipeline-model-parallel-size", "2", "--rl-inference-pipeline-model-parallel-size", "2",
             "--rl-inference-tensor-model-parallel-size", "2", world=4, monkeypatch=monkeypatch)
    assert rl.inference_layout.enabled


def test_rank_lists_follow_megatron_order():
    # tp fastest, then dp, then pp (megatron-core's default order tp-cp-ep-dp-pp)
    g = layout_rank_lists(LayoutSizes(world=8, tp=2, pp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert g["mp"] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert g["embd"] == [[0, 4], [1, 5], [2, 6], [3, 7]] and g["pos_embd"] == [[0], [1], [2], [3]]
    assert lockstep_ranks(LayoutSizes(world=8, tp=2, pp=2)) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # MoE: EP inside the expert grid (expert TP = TP); replicas span the EP group
    e = layout_rank_lists(LayoutSizes(world=4, tp=1, pp=1, ep=2))
    assert e["ep"] == [[0, 1], [2, 3]] and e["expt_dp"] == [[0, 2], [1, 3]] and e["tp"] == [[0], [1], [2], [3]]
    assert lockstep_ranks(LayoutSizes(world=4, tp=1, pp=1, ep=2)) == [[0, 1], [2, 3]]
    assert lockstep_ranks(LayoutSizes(world=2, tp=1, pp=1)) == [[0], [1]]


def test_rank_lists_equal_the_training_groups_megatron_core_builds():
    """Same sizes as a training layout -> the same membership parallel_state would give (its RankGenerator)."""
    from megatron.core.parallel_state import RankGenerator

    s = LayoutSizes(world=16, tp=2, pp=2, ep=2)
    ours = layout_rank_lists(s)
    dec = RankGenerator(tp=2, ep=1, dp=4, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    assert ours["tp"] == dec.get_ranks("tp") and ours["dp"] == dec.get_ranks("dp")
    assert all(len(r) == 2 for r in ours["ep"]) and sorted(x for r in ours["ep"] for x in r) == list(range(16))


class _FakeShard:
    """RolloutShard with the world all-gather replaced by fixed per-replica results."""

    def __new__(cls, per_replica):
        from megatron.rl.inference.control import RolloutShard

        shard = RolloutShard(rank=0, size=len(per_replica), sources=list(range(len(per_replica))))
        shard.gather = lambda obj: per_replica  # type: ignore[method-assign]
        return shard


def test_groups_are_regrouped_by_training_dp_rank_in_replica_order():
    shard = _FakeShard([["g0", "g1", "g2"], ["g3", "g4", "g5"]])  # 2 inference replicas, 3 groups each
    assert shard.regroup_for_training(["ignored"], dp_rank=0, dp_size=1) == ["g0", "g1", "g2", "g3", "g4", "g5"]
    assert shard.regroup_for_training([], dp_rank=1, dp_size=3) == ["g2", "g3"]
    with pytest.raises(RuntimeError, match="cannot be split evenly"):
        shard.regroup_for_training([], dp_rank=0, dp_size=4)


def test_replica_sources_in_replica_order():
    from megatron.rl.inference.control import RolloutShard
    from megatron.rl.layout.groups import InferenceGroups

    s = LayoutSizes(world=8, tp=2, pp=2)  # replicas {0,1,4,5} and {2,3,6,7}
    groups = InferenceGroups(sizes=s, pg_collection=None, lockstep_group=None, lockstep_source=2, replica_rank=1,
                             num_replicas=2, pp_rank=0)
    shard = RolloutShard.for_groups(groups)
    assert (shard.rank, shard.size, shard.sources) == (1, 2, [0, 2])
