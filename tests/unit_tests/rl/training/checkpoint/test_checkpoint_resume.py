"""Save at step k, continue to n; load k into a fresh model/optimizer and continue: identical losses and
parameters. Also: what each restored part contributes, release (model-only) checkpoints, and
architecture mismatches."""
import pytest
import torch

from megatron.rl.training.checkpoint.save_load import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

K, N = 2, 5


def adam_steps(opt) -> set[float]:
    """Adam's step count over every parameter state of a (chained) megatron optimizer."""
    steps = set()
    for o in getattr(opt, "chained_optimizers", [opt]):
        for st in o.optimizer.state.values():
            steps.add(float(st["step"]))
    return steps


def run_and_save(tiny, arch, distopt, ckpt_dir):
    chunks, opt, sched = tiny.build(arch, distopt)
    for s in range(K):
        tiny.train_step(chunks, opt, sched, s)
    path = save_checkpoint(ckpt_dir, K, chunks, opt, sched, run_state={"consumed_samples": K * tiny.GBS},
                           model_args=arch.model_args())
    ref = [tiny.train_step(chunks, opt, sched, s) for s in range(K, N)]
    return path, ref, chunks, opt, sched


def resume(tiny, arch, distopt, ckpt_dir, **load_kw):
    chunks, opt, sched = tiny.build(arch, distopt, seed=99)  # different init: only the load can make it match
    tiny.reseed(4321)  # generators differ from the ones at save time
    info = load_checkpoint(ckpt_dir, chunks, opt, sched, model_args=arch.model_args(), **load_kw)
    losses = [tiny.train_step(chunks, opt, sched, s) for s in range(info.iteration, N)]
    return info, losses, chunks, opt, sched


@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distopt"])
def test_resume_is_exact(dist1, tmp_path, distopt):
    tiny = dist1
    arch = tiny.Arch(dropout=0.1)  # dropout makes the losses depend on the restored RNG state
    path, ref, chunks, opt, sched = run_and_save(tiny, arch, distopt, tmp_path)
    assert path == tmp_path / "iter_0000002" and latest_checkpoint(tmp_path) == path
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "2"

    info, got, chunks2, opt2, sched2 = resume(tiny, arch, distopt, tmp_path)
    assert info.iteration == K and info.run_state == {"consumed_samples": K * tiny.GBS} and info.path == path
    assert info.loaded_optimizer and info.loaded_scheduler and info.loaded_rng
    assert got == ref  # bitwise on CPU fp32
    p_ref, p_got = tiny.full_params(chunks), tiny.full_params(chunks2)
    assert p_ref.keys() == p_got.keys()
    assert all(torch.equal(p_ref[k], p_got[k]) for k in p_ref)
    assert adam_steps(opt2) == adam_steps(opt) == {float(N)}
    assert sched2.num_steps == sched.num_steps and opt2.param_groups[0]["lr"] == opt.param_groups[0]["lr"]


@pytest.mark.parametrize("distopt", [False, True], ids=["adam", "distopt"])
def test_save_before_first_step(dist1, tmp_path, distopt):
    """Iteration 0 (fresh optimizer, no Adam state yet) saves and resumes exactly."""
    tiny = dist1
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, distopt)
    save_checkpoint(tmp_path, 0, chunks, opt, sched)
    ref = [tiny.train_step(chunks, opt, sched, s) for s in range(2)]
    chunks2, opt2, sched2 = tiny.build(arch, distopt, seed=99)
    assert load_checkpoint(tmp_path, chunks2, opt2, sched2).iteration == 0
    assert [tiny.train_step(chunks2, opt2, sched2, s) for s in range(2)] == ref
    assert adam_steps(opt2) == {2.0}


def test_each_restored_part_matters(dist1, tmp_path):
    """Without the RNG state (dropout masks) or without the optimizer state the continuation differs:
    the exact match above is not an accident of the data."""
    tiny = dist1
    arch = tiny.Arch(dropout=0.1)
    _, ref, *_ = run_and_save(tiny, arch, False, tmp_path)
    info, no_rng, *_ = resume(tiny, arch, False, tmp_path, load_rng=False)
    assert not info.loaded_rng and no_rng != ref
    info, no_opt, _, opt, sched = resume(tiny, arch, False, tmp_path, load_optimizer=False)
    assert not info.loaded_optimizer and not info.loaded_scheduler and no_opt != ref
    assert adam_steps(opt) == {float(N - K)} and sched.num_steps == (N - K) * 1
    # a checkpoint saved without RNG state loads (nothing to restore) and continues like load_rng=False
    chunks, opt, sched = tiny.build(arch, False)
    for s in range(K):
        tiny.train_step(chunks, opt, sched, s)
    save_checkpoint(tmp_path / "no_rng", K, chunks, opt, sched, save_rng=False)
    info, no_saved_rng, *_ = resume(tiny, arch, False, tmp_path / "no_rng")
    assert not info.loaded_rng and info.loaded_optimizer and no_saved_rng == no_rng


def test_release_checkpoint_is_model_only(dist1, tmp_path):
    tiny = dist1
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, False)
    tiny.train_step(chunks, opt, sched, 0)
    expected = tiny.eval_loss(chunks)
    path = save_checkpoint(tmp_path, "release", chunks, model_args=arch.model_args())
    assert path.name == "release" and (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "release"

    fresh, opt2, sched2 = tiny.build(arch, False, seed=5)
    assert tiny.eval_loss(fresh) != expected
    with pytest.raises(CheckpointError, match="no optimizer state.*load_optimizer=False"):
        load_checkpoint(tmp_path, fresh, opt2, sched2)
    info = load_checkpoint(tmp_path, fresh, opt2, sched2, load_optimizer=False)
    assert info.iteration == 0 and not info.loaded_optimizer and not info.loaded_rng
    assert tiny.eval_loss(fresh) == expected
    # the checkpoint directory itself can be given instead of the save directory
    assert load_checkpoint(path, fresh, load_optimizer=False).path == path


def test_architecture_mismatch_names_the_key(dist1, tmp_path):
    tiny = dist1
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, False)
    save_checkpoint(tmp_path, 3, chunks, opt, sched, model_args=arch.model_args())

    other = tiny.Arch(hidden_size=32)
    chunks2, opt2, sched2 = tiny.build(other, False)
    with pytest.raises(CheckpointError, match=r"hidden_size is 64 in the checkpoint but 32 in this run"):
        load_checkpoint(tmp_path, chunks2, opt2, sched2, model_args=other.model_args())
    # without model_args the shape mismatch still fails loudly, naming the checkpoint
    with pytest.raises(CheckpointError, match="iter_0000003"):
        load_checkpoint(tmp_path, chunks2, opt2, sched2)

    deeper = tiny.Arch(num_layers=2)
    chunks3, _, _ = tiny.build(deeper, False)
    with pytest.raises(CheckpointError, match=r"num_layers is 4 in the checkpoint but 2"):
        load_checkpoint(tmp_path, chunks3, model_args=deeper.model_args(), load_optimizer=False)
