"""Pure parts of the RL orchestration: rollout groups -> training sequences, RL flag validation."""
from __future__ import annotations

import math
import re
import types

import pytest
import torch

from megatron.rl.algorithms import compute_advantages
from megatron.rl.rl_config import add_rl_args, rl_config_from_args
from megatron.rl.observe.metrics import summarize_groups
from megatron.rl.rollout.sequences import CollectionStats, groups_to_sequences
from megatron.rl.training.config import ConfigError, parse_args
from megatron.rl.base.types import Rollout, RolloutGroup, TokenRollout


def _tok(reward: float, n_prompt: int = 3, n_gen: int = 2, env: str = "e", base: int = 10) -> TokenRollout:
    ids = [base + i for i in range(n_prompt + n_gen)]
    return TokenRollout(prompt="p", completion="c", reward=reward, env_id=env, token_ids=ids,
                        generation_mask=[0] * n_prompt + [1] * n_gen,
                        logprobs=[0.0] * n_prompt + [-0.5] * n_gen, prompt_length=n_prompt)


def _failed(reason: str = "boom") -> Rollout:
    return Rollout(prompt="p", completion="", reward=0.0, status="failed", failure_reason=reason, env_id="e")


# --------------------------------------------------------------------------- groups_to_sequences


def _with_stats(groups, estimator="grpo", filter_same_reward=False):
    """The sequences, and the counts the trainer derives from the same groups' summaries."""
    stats = CollectionStats.of(summarize_groups(groups, max_new_tokens=1 << 20), filter_same_reward)
    return groups_to_sequences(groups, estimator, filter_same_reward=filter_same_reward), stats


def test_failed_rollouts_dropped_counted_and_advantages_on_ok_subset():
    g0 = RolloutGroup(rollouts=[_tok(1.0, base=1), _failed("timeout"), _tok(0.0, base=2), _tok(0.5, base=3)])
    g1 = RolloutGroup(rollouts=[_tok(2.0, n_gen=4, base=4), _tok(-1.0, base=5)])
    seqs, stats = _with_stats([g0, g1], "grpo")
    assert stats.groups == 2 and stats.rollouts == 6 and stats.failed_rollouts == 1
    assert stats.failure_reasons == {"timeout": 1}
    assert stats.dropped_groups_too_few_ok == 0
    assert [s.group_index for s in seqs] == [0, 0, 0, 1, 1]
    assert [s.token_ids[0] for s in seqs] == [1, 2, 3, 4, 5]  # order kept, failed one skipped
    exp0 = compute_advantages(torch.tensor([[1.0, 0.0, 0.5]], dtype=torch.float64), "grpo")[0].tolist()
    exp1 = compute_advantages(torch.tensor([[2.0, -1.0]], dtype=torch.float64), "grpo")[0].tolist()
    assert [s.advantage for s in seqs] == pytest.approx(exp0 + exp1, abs=1e-12)
    # hand check of one group: mean 0.5, unbiased std 0.5 -> (1, -1, 0)
    assert exp0 == pytest.approx([1.0, -1.0, 0.0], abs=1e-5)
    assert stats.rewards == [1.0, 0.0, 0.5, 2.0, -1.0]
    assert stats.ok_rollouts == 5 and stats.generated_tokens == 2 + 2 + 2 + 4 + 2
    s = seqs[3]
    assert s.loss_mask == [0, 0, 0, 1, 1, 1, 1] and s.num_generated == 4
    assert s.inference_logprobs == [0.0] * 3 + [-0.5] * 4 and s.reward == 2.0


@pytest.mark.parametrize("estimator", ["grpo", "drgrpo", "rloo"])
def test_advantages_match_estimator_on_ok_subset(estimator):
    rewards = [0.3, 1.0, 0.1, 0.7]
    g = RolloutGroup(rollouts=[_tok(rewards[0]), _failed(), _tok(rewards[1]), _tok(rewards[2]), _failed(),
                               _tok(rewards[3])])
    seqs, stats = _with_stats([g], estimator)
    exp = compute_advantages(torch.tensor([rewards], dtype=torch.float64), estimator)[0].tolist()
    assert [s.advantage for s in seqs] == pytest.approx(exp, abs=1e-12)
    assert stats.failed_rollouts == 2 and stats.failure_reasons == {"boom": 2}
    if estimator == "rloo":  # r_i - mean of the others, computed by hand
        hand = [r - (sum(rewards) - r) / 3 for r in rewards]
        assert [s.advantage for s in seqs] == pytest.approx(hand, abs=1e-12)


def test_groups_with_fewer_than_two_ok_are_dropped():
    groups = [RolloutGroup(rollouts=[_tok(1.0), _failed(), _failed()]),
              RolloutGroup(rollouts=[_failed(), _failed()]),
              RolloutGroup(rollouts=[_tok(1.0), _tok(0.0)])]
    seqs, stats = _with_stats(groups, "grpo")
    assert stats.dropped_groups_too_few_ok == 2 and stats.failed_rollouts == 4
    assert [s.group_index for s in seqs] == [2, 2]
    # the lone ok rollout of a dropped group still counts in the reward statistics
    assert stats.rewards == [1.0, 1.0, 0.0]


def test_same_reward_filtering():
    groups = [RolloutGroup(rollouts=[_tok(0.5), _tok(0.5), _tok(0.5)]),
              RolloutGroup(rollouts=[_tok(1.0), _tok(0.0)]),
              RolloutGroup(rollouts=[_tok(0.1), _failed(), _tok(0.1)])]  # equal among the ok ones
    seqs, stats = _with_stats(groups, "grpo", filter_same_reward=True)
    assert stats.filtered_same_reward_groups == 2
    assert [s.group_index for s in seqs] == [1, 1]
    seqs_nf, stats_nf = _with_stats(groups, "grpo", filter_same_reward=False)
    assert stats_nf.filtered_same_reward_groups == 0 and len(seqs_nf) == 7
    # an unfiltered equal-reward group has exactly zero advantage
    assert all(s.advantage == 0.0 for s in seqs_nf if s.group_index in (0, 2))


def test_non_token_rollout_is_type_error():
    g = RolloutGroup(rollouts=[_tok(1.0), Rollout(prompt="p", completion="c", reward=0.0)])
    with pytest.raises(TypeError, match="TokenRollout"):
        groups_to_sequences([g])


def test_empty_input():
    seqs, stats = _with_stats([])
    assert seqs == [] and stats.groups == 0


# --------------------------------------------------------------------------- RL flag validation


@pytest.fixture
def env_yaml(tmp_path):
    p = tmp_path / "env.yaml"
    p.write_text('environments: [{type: arithmetic, weight: 1}]\n')
    return p


BASE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
        "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "16",
        "--train-iters", "3", "--lr", "1e-4"]


def _rl(env, *extra, world_size=1, base=BASE):
    argv = [*base, "--langrl-env-config", str(env), "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "8", *map(str, extra)]
    return rl_config_from_args(parse_args(argv, extra_args_providers=[add_rl_args], world_size=world_size))


def test_valid_config(env_yaml):
    rl = _rl(env_yaml)
    assert rl.rollouts_per_step == 16 and rl.group_size == 4 and rl.max_new_tokens == 8
    assert rl.env_config == str(env_yaml)


@pytest.mark.parametrize("extra,world,flags", [
    # 4 x 3 = 12 rollouts are not a multiple of 16
    (["--grpo-group-size", "3"], 1, ["--global-batch-size", "--grpo-prompts-per-step", "--grpo-group-size"]),
    # 3 prompts over DP=2 (global batch 6: 3 x 2 = 6 keeps the batch arithmetic valid)
    (["--grpo-prompts-per-step", "3", "--grpo-group-size", "2", "--global-batch-size", "6",
      "--micro-batch-size", "1"], 2, ["--grpo-prompts-per-step", "data-parallel"]),
    (["--grpo-group-size", "1", "--global-batch-size", "4"], 1, ["--grpo-group-size"]),
    (["--grpo-group-size", "1", "--global-batch-size", "4", "--grpo-advantage-estimator", "rloo"], 1,
     ["--grpo-group-size"]),
    (["--rl-max-new-tokens", "64"], 1, ["--rl-max-new-tokens", "--seq-length"]),
    (["--rl-max-new-tokens", "100"], 1, ["--rl-max-new-tokens", "--seq-length"]),
    (["--inference-backend", "openai"], 1, ["--inference-backend", "--inference-server-url"]),
    (["--grpo-prompts-per-step", "0"], 1, ["--grpo-prompts-per-step"]),
    (["--rl-default-top-p", "0"], 1, ["--rl-default-top-p"]),
    (["--grpo-kl-beta", "-1"], 1, ["--grpo-kl-beta"]),
])
def test_bad_combinations_name_the_flag(env_yaml, extra, world, flags):
    with pytest.raises(ConfigError) as e:
        _rl(env_yaml, *extra, world_size=world)
    msg = str(e.value)
    for flag in flags:
        assert flag in msg, msg


def test_missing_env_config(tmp_path):
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match="--langrl-env-config") as e:
        _rl(missing)
    assert str(missing) in str(e.value)
    argv = [*BASE, "--grpo-prompts-per-step", "4", "--grpo-group-size", "4"]
    with pytest.raises(ConfigError, match="--langrl-env-config"):
        rl_config_from_args(parse_args(argv, extra_args_providers=[add_rl_args]))


def test_openai_with_url_is_valid(env_yaml):
    rl = _rl(env_yaml, "--inference-backend", "openai", "--inference-server-url", "http://127.0.0.1:1")
    assert rl.inference_backend == "openai"


def test_dp2_divisible_is_valid(env_yaml):
    rl = _rl(env_yaml, "--micro-batch-size", "2", world_size=2)
    assert rl.prompts_per_step % 2 == 0 and not math.isnan(rl.temperature)


def test_count_all_failed_resets_on_any_success():
    from megatron.rl.rl_loop import count_all_failed

    n = 0
    for failed, expected in ((16, 1), (16, 2), (15, 0), (16, 1)):
        n = count_all_failed(n, {"failed_rollouts": float(failed)}, 16)
        assert n == expected
    assert count_all_failed(5, {}, 16) == 0  # an iteration without the metric is not a failure


# --------------------------------------------------------------------------- hostile flag values
@pytest.mark.parametrize("flag, value", [
    ("--rl-default-temperature", "inf"), ("--rl-default-temperature", "nan"), ("--rl-default-temperature", "0"),
    ("--rl-default-temperature", "-1"), ("--rl-eval-temperature", "-1"), ("--rl-eval-temperature", "inf"),
    ("--rl-default-temperature", "1e-38"), ("--rl-eval-temperature", "0.0001"), ("--rl-default-temperature", "1000"),
    ("--grpo-clamp-eps-lower", "-1"), ("--grpo-clamp-eps-lower", "2"), ("--grpo-clamp-eps-lower", "1"),
    ("--grpo-clamp-eps-upper", "-0.1"), ("--grpo-clamp-eps-upper", "inf"),
    ("--grpo-entropy-term-weight", "nan"), ("--grpo-kl-beta", "inf"), ("--grpo-kl-beta", "nan"),
    ("--rl-default-top-p", "nan"), ("--rl-importance-sampling-truncation-coef", "inf"),
    ("--inference-backend", "unknown"), ("--rl-importance-sampling-mask-low", "nan"),
    ("--rl-importance-sampling-mask-low", "-0.5"), ("--rl-reject-sequence-max-log-ratio", "-1"),
    ("--rl-reject-sequence-mean-log-ratio", "0"), ("--rl-warn-off-policy-kl", "0"),
    ("--rl-warn-entropy-drop", "1"), ("--rl-warn-trend-window", "0"), ("--rl-warn-top-answer-share", "1.5"),
    ("--rl-warn-env-window", "0"), ("--rl-warn-pass-at-1-drop", "0"), ("--rl-env-collapse-patience", "0"),
    ("--rl-env-collapse-weight-factor", "1"), ("--rl-env-collapse-weight-factor", "0"),
])
def test_hostile_rl_flag_values_are_named_errors(env_yaml, flag, value):
    with pytest.raises(ConfigError) as e:
        _rl(env_yaml, flag, value)
    assert f"{flag}={value}" in str(e.value)


@pytest.mark.parametrize("extra, flags", [
    (["--rl-importance-sampling-mask-low", "2", "--rl-importance-sampling-mask-high", "1"],
     ["--rl-importance-sampling-mask-low=2.0 > --rl-importance-sampling-mask-high=1.0"]),
    (["--rl-importance-sampling-mode", "masked", "--rl-importance-sampling-mask-low", "1.1"],
     ["--rl-importance-sampling-mask-low/-high", "excludes ratio 1"]),
    (["--grpo-policy-loss", "gspo", "--grpo-clamp-eps-lower", "1"], ["--grpo-clamp-eps-lower=1.0", "gspo"]),
    (["--rl-env-collapse-action", "stop", "--rl-warn-top-answer-share", "1"],
     ["--rl-env-collapse-action stop", "--rl-warn-top-answer-share=1.0", "is off"]),
])
def test_off_policy_corrections_and_clip_ranges_are_named_errors(env_yaml, extra, flags):
    with pytest.raises(ConfigError) as e:
        _rl(env_yaml, *extra)
    for flag in flags:
        assert flag in str(e.value), str(e.value)


def test_each_loss_gets_its_published_clip_range_and_cispo_may_drop_the_lower_bound(env_yaml):
    assert _rl(env_yaml, "--grpo-policy-loss", "gspo").loss.clip_range == (3e-4, 4e-4)
    assert _rl(env_yaml, "--grpo-policy-loss", "cispo").loss.clip_range == (1.0, 3.0)
    assert _rl(env_yaml, "--grpo-policy-loss", "cispo", "--grpo-clamp-eps-lower", "1").loss.clip_range[0] == 1.0
    assert _rl(env_yaml).loss.clip_range == (0.2, 0.2)


def test_legal_edge_values_are_accepted(env_yaml):
    rl = _rl(env_yaml, "--grpo-clamp-eps-lower", "0", "--grpo-clamp-eps-upper", "0.28", "--rl-eval-temperature",
             "0", "--rl-default-temperature", "0.7", "--inference-backend", "fake")
    assert rl.loss.eps_lower == 0 and rl.inference_backend == "fake"


def test_train_rl_bad_input_exits_2_with_one_line_before_building_anything(env_yaml, capsys, monkeypatch):
    """Bad values are one line and exit status 2 (no traceback), caught before any model is built."""
    import importlib.util

    from tests.conftest import REPO_ROOT

    spec = importlib.util.spec_from_file_location("train_rl_main", REPO_ROOT / "train_rl.py")
    train_rl = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_rl)
    import megatron.rl.rl_loop as rl_loop

    def no_model(*a, **k):
        raise AssertionError("the model was built before the flags were checked")

    monkeypatch.setattr(rl_loop, "run_rl", no_model)
    argv = [*BASE, "--langrl-env-config", str(env_yaml), "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "8"]
    for bad in (["--grpo-clamp-eps-lower", "2"], ["--inference-backend", "unknown"],
                ["--rl-default-temperature", "inf"], ["--grpo-entropy-term-weight", "nan"],
                ["--rl-importance-sampling-mask-low", "2"]):  # lo > hi (1.25)
        capsys.readouterr()
        assert train_rl.main([*argv, *bad]) == 2
        err = capsys.readouterr().err.splitlines()
        # ConfigError or a section's subclass of it (PolicyLossConfigError), then the flag
        assert re.match(r"train_rl\.py: error: \w*ConfigError: " + re.escape(bad[0]),
                        [x for x in err if x.startswith("train_rl.py: error: ")][0]), err
    bad_env = env_yaml.parent / "bad.yaml"
    bad_env.write_text("- type: arithmetic\n  weight: -1\n")
    argv[argv.index(str(env_yaml))] = str(bad_env)
    from megatron.rl.agent.env_config import load_env_config

    monkeypatch.setattr(rl_loop, "run_rl", lambda cfg, rl: load_env_config(rl.env_config))
    capsys.readouterr()
    assert train_rl.main(argv) == 2
    assert "train_rl.py: error: EnvConfigError: " in capsys.readouterr().err


@pytest.mark.parametrize("bad, message", [
    (["--rl-eval-temperature", "-1"], "ConfigError: --rl-eval-temperature=-1.0"),
    (["--grpo-kl-beta", "0.1"], "ConfigError: --grpo-kl-beta=0.1 needs --pretrained-checkpoint"),  # in run_rl
    (["--rl-packed-attention-per-sequence"], "ConfigError: --rl-packed-attention-per-sequence is not a flag of this "
                                             "version: use --rl-packed-attention exact"),
])
def test_train_rl_script_prints_one_line_and_exits_2(env_yaml, bad, message):
    import subprocess
    import sys

    from tests.conftest import REPO_ROOT

    argv = [*BASE, "--langrl-env-config", str(env_yaml), "--grpo-prompts-per-step", "4", "--grpo-group-size", "4",
            "--rl-max-new-tokens", "8", *bad]
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "train_rl.py"), *argv], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and message in proc.stderr, proc.stderr[-3000:]


def test_megatron_backend_generation_is_capped_at_seq_length(env_yaml, monkeypatch):
    """The in-process engine caps prompt + generation at --seq-length: a longer sequence would be generated and
    then fail in packing."""
    import torch

    from megatron.rl.inference.control import build_training_inference
    from megatron.rl.inference.megatron import MegatronInference

    seen = {}
    monkeypatch.setattr(MegatronInference, "__init__", lambda self, model, tok, **kw: seen.update(kw))
    model = torch.nn.Linear(1, 1)
    model.max_sequence_length = 256  # --max-position-embeddings larger than --seq-length
    rl = _rl(env_yaml)
    cfg = types.SimpleNamespace(model=types.SimpleNamespace(seq_length=64),
                                parallel=types.SimpleNamespace(tensor_model_parallel_size=1))
    assert isinstance(build_training_inference(cfg, rl, [model], None), MegatronInference)
    assert seen["max_sequence_length"] == 64
    model.max_sequence_length = 32
    build_training_inference(cfg, rl, [model], None)
    assert seen["max_sequence_length"] == 32


def test_a_removed_flag_names_its_replacement(env_yaml):
    from megatron.rl.rl_config import add_rl_args
    from megatron.rl.training.config import build_parser

    with pytest.raises(ConfigError, match=r"--rl-packed-attention-per-sequence is not a flag of this version: use "
                                          r"--rl-packed-attention exact"):
        _rl(env_yaml, "--rl-packed-attention-per-sequence")
    assert "per-sequence" not in build_parser([add_rl_args]).format_help()
    assert _rl(env_yaml, "--rl-packed-attention", "exact").packed_attention == "exact"


# --------------------------------------------------------------------------- flags recorded in checkpoints


def test_checkpointed_run_flags_are_real_flags_and_record_the_parsed_values(tmp_path):
    from megatron.rl.rl_config import CHECKPOINTED_FLAGS, checkpointed_run_flags
    from megatron.rl.training.checkpoint.run_flags import file_sha256, run_flags_argv
    from megatron.rl.training.config import build_parser

    env = tmp_path / "env.yaml"
    env.write_text("environments: [{type: arithmetic, weight: 1}]\n")
    argv = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "32",
            "--langrl-env-config", str(env), "--rl-max-new-tokens", "8", "--rl-default-temperature", "0.7",
            "--rl-eval-pass-at-k", "1", "4", "--rl-eval-samples", "4", "--rl-eval-temperature", "1.0",
            "--rl-use-sequence-packing", "--rl-generation-lag", "1"]
    cfg = parse_args(argv, extra_args_providers=[add_rl_args], world_size=1)
    record = checkpointed_run_flags(cfg)
    parser = build_parser([add_rl_args])
    options = {s for a in parser._actions for s in a.option_strings}
    assert set(CHECKPOINTED_FLAGS) <= options
    assert len(record["flags"]) == len(CHECKPOINTED_FLAGS)
    assert record["sha256"] == {"langrl_env_config": file_sha256(env)}
    # what comes back parses to the same RL config
    back = [t for g in run_flags_argv(record, parser, set(), "test") for t in g]
    again = parse_args(argv[:8] + back, extra_args_providers=[add_rl_args], world_size=1)
    assert rl_config_from_args(again) == rl_config_from_args(cfg)
