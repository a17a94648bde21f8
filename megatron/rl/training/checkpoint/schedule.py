"""Does a resumed run keep the learning-rate / weight-decay schedule its checkpoint was trained with?

The comparison is on the schedule as a function of the step (what megatron-core's ``OptimizerParamScheduler``
computes from its state), not on the flag values that built it. Two facts of its formulas make some values
irrelevant:

- with ``--lr-decay-style constant`` the learning rate after warmup is ``--lr`` whatever the decay length
  (``--lr-decay-iters``, default ``--train-iters``) or ``--min-lr``;
- when the start and end weight decay are equal, the weight decay is that value whatever the increment
  length or style.

So a constant-LR run may resume with a larger ``--train-iters``; a cosine run may not (its decay stretches).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Mapping

from megatron.rl.training.checkpoint.paths import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["SCHEDULE_FIELDS", "effective_schedule", "check_scheduler_matches"]

# megatron-core's scheduler state key (also its attribute) -> the flag that sets it here
SCHEDULE_FIELDS = (
    ("max_lr", "--lr"),
    ("min_lr", "--min-lr"),
    ("lr_warmup_steps", "--lr-warmup-iters"),
    ("lr_decay_steps", "--lr-decay-iters (default: --train-iters)"),
    ("lr_decay_style", "--lr-decay-style"),
    ("start_wd", "--start-weight-decay / --weight-decay"),
    ("end_wd", "--end-weight-decay / --weight-decay"),
    ("wd_incr_steps", "--train-iters"),
    ("wd_incr_style", "--weight-decay-incr-style"),
)
_FLAG = dict(SCHEDULE_FIELDS)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-12, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b


def effective_schedule(state: Mapping[str, Any]) -> dict[str, Any]:
    """The schedule fields of ``state`` (a scheduler ``state_dict()``) that the LR or WD of some step depends on.

    Pure. Two states with equal effective schedules give the same learning rate and weight decay at every step.
    """
    out = {key: state[key] for key, _ in SCHEDULE_FIELDS if key in state}
    if out.get("lr_decay_style") == "constant":
        out.pop("lr_decay_steps", None)  # after warmup: max_lr, however long the "decay"
        out.pop("min_lr", None)
    if "start_wd" in out and "end_wd" in out and _same(out["start_wd"], out["end_wd"]):
        out.pop("wd_incr_steps", None)  # nothing to increment
        out.pop("wd_incr_style", None)
    return out


def _current(scheduler) -> dict[str, Any]:
    return {key: getattr(scheduler, key) for key, _ in SCHEDULE_FIELDS if hasattr(scheduler, key)}


def check_scheduler_matches(ckpt: Path, saved: Any, scheduler) -> Any:
    """The scheduler state to load from checkpoint ``ckpt`` into this run's ``scheduler``.

    Raises CheckpointError naming the flags whose change alters the schedule, unless the run chose what wins
    (--override-opt-param-scheduler / --use-checkpoint-opt-param-scheduler: ``saved`` is returned as is, for
    megatron-core to apply that choice). When only values the schedule never reads differ (a longer
    --train-iters with a constant LR), the returned state carries this run's values for them, so the run
    continues with its own flags and megatron-core's equality check on load passes.
    """
    if not isinstance(saved, dict) or getattr(scheduler, "override_opt_param_scheduler", False) or \
            getattr(scheduler, "use_checkpoint_opt_param_scheduler", False):
        return saved
    now = _current(scheduler)
    then = {k: v for k, v in saved.items() if k in now}
    was, will = effective_schedule(then), effective_schedule(now)
    changed = set(was) != set(will) or any(not _same(was[k], will[k]) for k in was)
    # the values that differ among those either schedule reads (a style change also shows the lengths it reads)
    diffs = [f"{key} is {then.get(key)} in the checkpoint but {now.get(key)} now ({_FLAG[key]})"
             for key, _ in SCHEDULE_FIELDS if (key in was or key in will) and not _same(then.get(key), now.get(key))
             ] if changed else []
    if diffs:
        raise CheckpointError(
            f"the learning-rate / weight-decay schedule of {ckpt} does not match this run: {'; '.join(diffs)}. "
            f"Resume with the saving run's values, or pass --use-checkpoint-opt-param-scheduler to keep the saved "
            f"schedule, or --override-opt-param-scheduler to switch to this run's.")
    unread = {k: now[k] for k in then if not _same(then[k], now[k])}
    if unread:
        logger.info("resuming %s with %s: the schedule does not read these values, so it is unchanged", ckpt,
                    ", ".join(f"{k}={now[k]} (checkpoint: {then[k]})" for k in unread))
    return {**saved, **unread}
