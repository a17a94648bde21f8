"""A megatron optimizer's state in a checkpoint: the metadata of its sharded form, the state a fresh optimizer lacks,
the step megatron-core 0.16.1 leaves out at step 0, and the error that says why a saved state does not fit."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from megatron.rl.training.checkpoint.paths import CheckpointError

__all__ = ["optimizer_metadata", "materialize_optimizer_state", "restore_zero_steps", "uses_distributed_optimizer",
           "optimizer_error"]


def optimizer_metadata(dist_opt_format: str) -> dict[str, Any]:
    # chained_optim_avoid_prefix: keys of a chained optimizer do not depend on how params are split into
    # sub-optimizers (dense/expert), so they stay stable when the layout changes.
    return {"distrib_optim_sharding_type": dist_opt_format, "chained_optim_avoid_prefix": True}


def materialize_optimizer_state(optimizer) -> None:
    """Create the state of parameters that have not been stepped yet (a fresh optimizer, iteration 0).

    Without it such a checkpoint has no exp_avg/exp_avg_sq/step entries and cannot be loaded. Adam's
    lazy initialisation creates exactly these values (zeros, step 0) on its first step, so doing it early
    changes nothing numerically.
    """
    for sub in getattr(optimizer, "chained_optimizers", [optimizer]):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        empty = [p for g in inner.param_groups for p in g["params"] if len(inner.state[p]) == 0]
        if not empty:
            continue
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for p in empty:
                inner.state[p]["step"] = torch.tensor(0.0)
                inner.state[p]["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                inner.state[p]["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif getattr(sub, "init_state_fn", None) is not None:
            sub.init_state_fn(inner, getattr(sub, "config", None))


def restore_zero_steps(optim_state: Any) -> None:
    """megatron-core 0.16.1 stores Adam's shared step only when it is truthy (``if step:``), so a checkpoint
    saved at step 0 has per-param exp_avg/exp_avg_sq but no step and torch Adam's load_state_dict raises
    KeyError 'step'. Put the missing step (0) back into the loaded optimizer state dict."""
    if isinstance(optim_state, (list, tuple)):
        for v in optim_state:
            restore_zero_steps(v)
        return
    if not isinstance(optim_state, dict):
        return
    state = optim_state.get("state")
    if isinstance(state, dict) and "param_groups" in optim_state and "common_step" not in state:
        per_param = [v for v in state.values() if isinstance(v, dict)]
        if per_param and all("exp_avg" in v and "step" not in v for v in per_param):
            state["common_step"] = torch.tensor(0.0)
    for v in optim_state.values():
        if isinstance(v, (dict, list, tuple)):
            restore_zero_steps(v)


def uses_distributed_optimizer(optimizer) -> bool:
    """Whether a megatron optimizer (or any part of a chained one) is a ``DistributedOptimizer``."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    return any(isinstance(o, DistributedOptimizer) for o in getattr(optimizer, "chained_optimizers", [optimizer]))


def _optimizer_differences(info: dict, optimizer, layout: dict[str, int]) -> list[str]:
    """What differs between the saving run's optimizer setup and this one (from checkpoint_info; ``layout``: this
    run's parallel layout)."""
    out = []
    saved_dist = info.get("distributed_optimizer")
    now_dist = uses_distributed_optimizer(optimizer)
    if saved_dist is not None and bool(saved_dist) != now_dist:
        out.append(f"the checkpoint's optimizer state is from {'the distributed' if saved_dist else 'a plain'} "
                   f"optimizer but this run uses {'the distributed' if now_dist else 'a plain'} one: "
                   f"{'add' if saved_dist else 'drop'} --use-distributed-optimizer to match")
    saved_layout = info.get("layout") or {}
    if saved_layout.get("ep", layout["ep"]) != layout["ep"]:
        out.append(f"expert-parallel size changed ({saved_layout['ep']} -> {layout['ep']}; "
                   f"--expert-model-parallel-size)")
    return out


def optimizer_error(ckpt: Path, detail: str, info: dict, optimizer, layout: dict[str, int]) -> CheckpointError:
    """Why the saved optimizer state of ``ckpt`` does not fit this run (``layout``: its parallel layout)."""
    diffs = _optimizer_differences(info, optimizer, layout)
    why = "; ".join(diffs) if diffs else f"the optimizer state does not fit this run ({detail})"
    return CheckpointError(f"cannot load the optimizer state of {ckpt}: {why}. Pass --no-load-optim to load the "
                           f"model weights only (the optimizer then starts fresh).")
