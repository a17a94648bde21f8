"""Resume checks compare the learning-rate / weight-decay schedule as a function of the step, not flag values."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from megatron.rl.training.checkpoint.schedule import effective_schedule

STYLES = ("constant", "linear", "cosine", "inverse-square-root")


def _scheduler(**state):
    """megatron-core's own scheduler with ``state``: the reference for what a schedule computes."""
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    class _Opt:
        param_groups = [{"params": []}]

    return OptimizerParamScheduler(_Opt(), init_lr=0.0, use_checkpoint_opt_param_scheduler=False, **state)


def _values(state: dict, horizon: int) -> list[tuple[float, float]]:
    """(lr, wd) at steps 0..horizon, computed by megatron-core's scheduler."""
    sched, out = _scheduler(**state), []
    for step in range(horizon + 1):
        sched.num_steps = step
        out.append((sched.get_lr({}), sched.get_wd()))
    return out


def _random_state(rng: random.Random) -> dict:
    wd = rng.choice([0.0, 0.01])
    end_wd = rng.choice([wd, 0.1])
    decay = rng.choice([10, 20, 30])
    return dict(max_lr=rng.choice([1e-3, 2e-3]), min_lr=rng.choice([0.0, 1e-4]),
                lr_warmup_steps=rng.choice([0, 2, 5]), lr_decay_steps=decay, lr_decay_style=rng.choice(STYLES),
                start_wd=wd, end_wd=end_wd, wd_incr_steps=rng.choice([10, 20, 30]),
                wd_incr_style="constant" if wd == end_wd else rng.choice(["linear", "cosine"]))


def test_equal_effective_schedules_are_exactly_the_states_with_equal_lr_and_wd_at_every_step():
    """Checked against megatron-core's scheduler on random pairs of states, both ways: equal effective schedules
    give equal LR and WD at every step, and different ones differ at some step."""
    rng = random.Random(0)
    states = [_random_state(rng) for _ in range(60)]
    equal_pairs = 0
    for a, b in itertools.combinations(states, 2):
        same_values = _values(a, 40) == _values(b, 40)
        assert (effective_schedule(a) == effective_schedule(b)) == same_values, (a, b)
        equal_pairs += same_values and a != b
    assert equal_pairs > 0  # pairs that differ only in values the schedule never reads were drawn


# ---------------------------------------------------------------------------------- resume through the flags

TINY = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--lr", "1e-3", "--mock-data"]


@pytest.fixture
def megatron_cleanup():
    from megatron.rl.training.initialize import destroy_megatron

    yield
    destroy_megatron()


def _build(flags):
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.run import TrainingRun

    return TrainingRun.build(parse_args(flags, world_size=1))


@pytest.mark.parametrize("style", ["constant", "cosine"])
def test_more_train_iters_resume_with_a_constant_lr_and_are_refused_with_a_decaying_one(tmp_path, style,
                                                                                        megatron_cleanup):
    from megatron.rl.training.checkpoint.paths import CheckpointError
    from megatron.rl.training.initialize import destroy_megatron

    ckpt = str(tmp_path / "ckpt")
    flags = [*TINY, "--lr-decay-style", style, "--min-lr", "1e-4", "--save", ckpt, "--load", ckpt]
    run = _build([*flags, "--train-iters", "4"])
    run.resume()
    run.scheduler.step(increment=3)
    run.save(3, {"iteration": 3})
    run.close()
    destroy_megatron()

    run = _build([*flags, "--train-iters", "8"])
    if style == "cosine":  # a real change: the decay now spans 8 iterations
        with pytest.raises(CheckpointError, match=r"lr_decay_steps is 4 in the checkpoint but 8 now.*--train-iters"):
            run.resume()
        return
    assert run.resume().iteration == 3
    # the run continues with its own flags (8 iterations) from the saved step, at the same constant LR
    assert run.scheduler.num_steps == 3 and run.scheduler.lr_decay_steps == 8
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
    run.scheduler.step(increment=4)
    assert run.optimizer.param_groups[0]["lr"] == pytest.approx(1e-3)
