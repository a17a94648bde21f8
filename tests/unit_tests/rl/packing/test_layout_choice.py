"""--rl-layout / --rl-packing-row-length / --rl-use-sequence-packing: which rows a step uses, and why."""
from __future__ import annotations

import dataclasses

import pytest

from megatron.rl.base.errors import ConfigError
from megatron.rl.packing.layout_choice import LayoutInputs, choose_layout, group_row_length, parse_row_length
from megatron.rl.packing.prefix_sharing import plan_shared_packing
from tests.conftest import REPO_ROOT

# the quickstart's shape: 64-token rows, groups of 8, 8 new tokens, micro-batch 8
QS = LayoutInputs(layout="auto", use_sequence_packing=False, row_length="auto", seq_length=64, micro_batch_size=8,
                  group_size=8, max_new_tokens=8, max_sequences_per_bin=16)


def _with(**kw) -> LayoutInputs:
    return dataclasses.replace(QS, **kw)


def test_auto_packs_rows_of_one_group_by_hand_count():
    layout = choose_layout(QS)
    # the first rollout whole (<= 64 tokens), 7 more of 8 new tokens + the prompt's last token: 64 + 63 = 127 -> 128
    assert (layout.packed, layout.row_length, layout.shares_prompts) == (True, 128, True)
    assert layout.microbatch_rows == 8 * 64 // 128 == 4  # the micro-batch budget of 8 padded rows of 64
    assert layout.reason.startswith("--rl-layout auto")
    assert "--seq-length 64 + 7 x (--rl-max-new-tokens 8 + 1) rounded up to 128" in layout.describe()


@pytest.mark.parametrize("prompt", [1, 20, 56])
def test_the_auto_row_holds_a_whole_group_for_any_prompt_that_fits(prompt):
    """The real planner puts a group of the longest rollouts the engine admits (prompt + 8 new tokens <= 64) in
    one row of the auto length."""
    row = group_row_length(64, 8, 8, 16)
    tokens = [list(range(prompt)) + [100 + i] * 8 for i in range(8)]
    masks = [[0] * prompt + [1] * 8] * 8
    info = plan_shared_packing(tokens, masks, row, 16)
    assert info.num_bins == 1
    assert info.bin_token_counts[0] == prompt + 8 + 7 * (8 + 1) <= row


def test_row_rounding_cap_and_per_bin_limit():
    assert group_row_length(64, 8, 8, 16, length_multiple=3) == 192  # a multiple of lcm(32, 3) = 96
    assert group_row_length(64, 32, 8, 16) == 224  # at most 16 rollouts a row: 64 + 15 x 9 = 199, rounded up
    capped = choose_layout(_with(micro_batch_size=1))
    assert (capped.row_length, capped.microbatch_rows, capped.shares_prompts) == (64, 1, True)
    assert "capped at --micro-batch-size x --seq-length = 64" in capped.reason


@pytest.mark.parametrize("kw,blocker", [
    (dict(pipeline_parallel=2), "pipeline parallelism"),
    (dict(use_thd=True), "THD"),
    (dict(share_prompt_prefix="off"), "--rl-share-prompt-prefix off"),
])
def test_auto_without_prompt_sharing_packs_rows_of_seq_length(kw, blocker):
    layout = choose_layout(_with(**kw))
    assert (layout.packed, layout.row_length, layout.microbatch_rows, layout.shares_prompts) == (True, 64, 8, False)
    assert "not of one group" in layout.reason and blocker in layout.reason


def test_explicit_flags_override_auto():
    padded = choose_layout(_with(layout="padded"))
    assert (padded.packed, padded.row_length, padded.microbatch_rows) == (False, 64, 8)
    assert padded.reason == "--rl-layout padded"
    # --rl-use-sequence-packing keeps its meaning: rows of --seq-length, --micro-batch-size rows each
    legacy = choose_layout(_with(use_sequence_packing=True))
    assert (legacy.packed, legacy.row_length, legacy.microbatch_rows, legacy.shares_prompts) == (True, 64, 8, True)
    assert legacy.reason.startswith("--rl-use-sequence-packing")
    n = choose_layout(_with(use_sequence_packing=True, row_length="256"))
    assert (n.row_length, n.microbatch_rows) == (256, 2)
    packed = choose_layout(_with(layout="packed", row_length="200"))
    assert (packed.row_length, packed.microbatch_rows) == (200, 2) and packed.reason.startswith("--rl-layout packed")
    assert choose_layout(_with(layout="packed")).row_length == 128  # as auto


@pytest.mark.parametrize("kw,words", [
    (dict(layout="padded", use_sequence_packing=True), ["--rl-layout padded", "--rl-use-sequence-packing"]),
    (dict(layout="padded", row_length="128"), ["--rl-packing-row-length=128", "--rl-layout padded"]),
    (dict(row_length="32"), ["--rl-packing-row-length=32", "--seq-length=64", "at least 64"]),
    (dict(row_length="lots"), ["--rl-packing-row-length=lots", "auto or a whole number"]),
    (dict(row_length="100", length_multiple=8), ["--rl-packing-row-length=100", "multiple of 8", "104"]),
])
def test_bad_layout_flags_are_named(kw, words):
    with pytest.raises(ConfigError) as e:
        choose_layout(_with(**kw))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_parse_row_length():
    assert parse_row_length("auto", 64) is None and parse_row_length(" AUTO ", 64) is None
    assert parse_row_length("64", 64) == 64


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--micro-batch-size", "8", "--global-batch-size", "64", "--train-iters", "5", "--lr", "1e-3",
        "--langrl-env-config", str(REPO_ROOT / "examples/rl/environment_configs/arithmetic.yaml"),
        "--grpo-prompts-per-step", "8", "--grpo-group-size", "8", "--rl-max-new-tokens", "8"]


def _rl(*extra, world_size=1):
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.training.config import parse_args

    cfg = parse_args([*BASE, *extra], extra_args_providers=[add_rl_args], world_size=world_size)
    return cfg, rl_config_from_args(cfg)


def test_the_flags_resolve_into_the_run_config():
    from megatron.rl.rl_config import RLConfig, step_layout

    cfg, rl = _rl()
    assert rl.use_sequence_packing and rl.training_layout == choose_layout(QS)
    cfg, rl = _rl("--rl-layout", "padded")
    assert not rl.use_sequence_packing and rl.training_layout.row_length == 64
    cfg, rl = _rl("--pipeline-model-parallel-size", "2", world_size=2)
    assert rl.use_sequence_packing and not rl.training_layout.shares_prompts and "pipeline" in rl.training_layout.reason
    cfg, rl = _rl("--sequence-parallel", "--tensor-model-parallel-size", "2", world_size=2)
    assert rl.training_layout.row_length == 128
    with pytest.raises(ConfigError, match="--rl-use-sequence-packing"):
        _rl("--rl-layout", "padded", "--rl-use-sequence-packing")
    # an RLConfig built by hand keeps what its use_sequence_packing says, in rows of --seq-length
    assert not step_layout(RLConfig(), cfg).packed
    assert step_layout(RLConfig(use_sequence_packing=True), cfg).row_length == 64


def test_a_rollout_longer_than_seq_length_is_refused_even_in_longer_rows():
    from types import SimpleNamespace

    from megatron.rl.rl_utils import RLDataError, check_sequence_lengths

    rollouts = [SimpleNamespace(token_ids=[1] * n) for n in (10, 64)]
    check_sequence_lengths(rollouts, 64)
    check_sequence_lengths(rollouts + [SimpleNamespace(token_ids=[1] * 65)], None)
    with pytest.raises(RLDataError, match="65 tokens, more than --seq-length=64"):
        check_sequence_lengths(rollouts + [SimpleNamespace(token_ids=[1] * 65)], 64)
