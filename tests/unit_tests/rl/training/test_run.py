"""TrainingRun (the build sequence shared by pretraining and RL) and the entry points' shared main()."""
from __future__ import annotations

import pytest
import torch

from megatron.rl.training.config import parse_args
from megatron.rl.training.initialize import destroy_megatron
from megatron.rl.training.run import PRETRAIN_RESUME, RL_RESUME, Resumed, TrainingRun, resolve_load_dir

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--train-iters", "4", "--lr", "1e-3", "--mock-data"]


@pytest.fixture
def megatron_cleanup():
    yield
    destroy_megatron()


def _weights(run: TrainingRun) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in run.model[0].module.named_parameters()}


def test_build_save_resume_roundtrip_and_the_two_policies(tmp_path, megatron_cleanup):
    ckpt = str(tmp_path / "ckpt")
    flags = [*TINY, "--save", ckpt, "--load", ckpt]  # auto-resume: the first run finds nothing to load
    run = TrainingRun.build(parse_args(flags, world_size=1))
    assert run.load_dir is None and run.resume() == Resumed(0, {}, False)
    assert len(run.model) == 1 and run.optimizer is not None and run.ref_model is None
    with torch.no_grad():
        for p in run.model[0].module.parameters():
            p.add_(0.25)  # weights a fresh build would not have
    run.scheduler.step(increment=5)  # scheduler state a fresh build would not have
    saved = _weights(run)
    run.save(3, {"iteration": 3, "consumed_samples": 24})
    run.close()
    destroy_megatron()

    run = TrainingRun.build(parse_args(flags, world_size=1))
    assert run.load_dir == ckpt
    start = run.resume()
    assert (start.iteration, start.run_state["consumed_samples"], start.from_checkpoint) == (3, 24, True)
    assert all(torch.equal(saved[n], w) for n, w in _weights(run).items())
    assert run.scheduler.num_steps == 5
    destroy_megatron()

    # --finetune (pretraining and RL alike; RL does not resume at 3): the weights only, from
    # iteration 0, without the run state (RL: prompt positions) and with a fresh scheduler and optimizer
    finetune = parse_args([*flags, "--finetune"], world_size=1)
    for policy in (PRETRAIN_RESUME, RL_RESUME):
        run = TrainingRun.build(finetune, policy)
        assert run.resume() == Resumed(0, {}, True)
        assert all(torch.equal(saved[n], w) for n, w in _weights(run).items())
        assert run.scheduler.num_steps == 0
        destroy_megatron()


def test_ref_model_is_a_frozen_copy_from_the_pretrained_checkpoint(tmp_path, megatron_cleanup):
    ckpt = str(tmp_path / "pre")
    run = TrainingRun.build(parse_args([*TINY, "--save", ckpt], world_size=1))
    run.save(1, {"iteration": 1})
    saved = _weights(run)
    destroy_megatron()
    run = TrainingRun.build(parse_args([*TINY, "--pretrained-checkpoint", ckpt, "--seed", "7"], world_size=1),
                            RL_RESUME, ref_model=True)
    assert run.resume() == Resumed(0, {}, False)  # weights only: no iteration, no run state
    ref = dict(run.ref_model[0].named_parameters())
    assert all(torch.equal(saved[n], ref[n]) and torch.equal(saved[n], w) for n, w in _weights(run).items())


def test_empty_load_is_an_error_only_for_pretraining(tmp_path):
    from megatron.rl.training.checkpoint.save_load import CheckpointError

    cfg = parse_args([*TINY, "--load", str(tmp_path / "none")], world_size=1)
    with pytest.raises(CheckpointError, match="no checkpoint there"):
        resolve_load_dir(cfg)
    assert resolve_load_dir(cfg, required=RL_RESUME.load_required) is None


@pytest.mark.parametrize("program", ["pretrain_gpt", "train_rl"])
def test_both_entry_points_share_one_main(program, monkeypatch, capsys):
    """A user error on a non-zero rank: exit 2, quiet, and a pause so rank 0's line is printed first."""
    import importlib

    from megatron.rl.training import cli_errors

    pauses = []
    monkeypatch.setattr(cli_errors.time, "sleep", pauses.append)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    main = importlib.import_module(program).main
    assert main([*TINY, "--bf16", "--fp16"]) == 2
    assert pauses == [cli_errors._GRACE_S] and capsys.readouterr().err == ""
    monkeypatch.setenv("RANK", "0")
    assert main([*TINY, "--bf16", "--fp16"]) == 2
    err = capsys.readouterr().err
    assert err == f"{program}.py: error: ConfigError: --bf16 and --fp16 were both given; choose one.\n"
