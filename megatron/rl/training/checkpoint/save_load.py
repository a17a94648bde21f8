"""Save and load training checkpoints with megatron-core's ``dist_checkpointing`` (torch_dist backend).

Sharded: ``model``, ``optimizer``, ``rng_state``; common: ``iteration``, ``opt_param_scheduler``, ``run_state``,
``model_args``, ``checkpoint_info``. Model and optimizer are global tensors, so a checkpoint loads under another
TP/PP/DP layout (the RNG state is then dropped). Publishing is atomic (:mod:`.paths`), integrity checked
(:mod:`.integrity`). Every rank must call :func:`save_checkpoint` / :func:`load_checkpoint` (collective), after
process groups are initialised.

What a checkpoint holds: docs/training.md.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch.distributed.checkpoint.api import CheckpointException

from megatron.rl import runtime
from megatron.rl.runtime.checkpoint_writer import use_in_process_write_results
from megatron.rl.training.checkpoint import integrity, paths
from megatron.rl.training.checkpoint.model_checks import check_model_args, check_padded_vocab
from megatron.rl.training.checkpoint.optimizer_state import (materialize_optimizer_state, optimizer_error,
                                                             optimizer_metadata, restore_zero_steps,
                                                             uses_distributed_optimizer)
from megatron.rl.training.checkpoint.paths import CheckpointError, latest_checkpoint
from megatron.rl.training.checkpoint.schedule import check_scheduler_matches
from megatron.rl.training.checkpoint.rng import (RNG_KEY, capture_rng_state, parallel_layout, restore_rng_state,
                                                 rng_sharded_object)

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
DIST_OPT_FORMATS = ("fully_reshardable", "dp_reshardable")

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "LoadedCheckpoint", "CheckpointError",
           "DIST_OPT_FORMATS"]


@dataclasses.dataclass
class LoadedCheckpoint:
    """What :func:`load_checkpoint` restored.

    iteration: the saved iteration (``"release"`` checkpoints give 0); None if the checkpoint has none.
    run_state: the caller's json-able dict from save time ({} if none).
    path: the checkpoint directory that was loaded.
    loaded_optimizer / loaded_scheduler / loaded_rng: which optional parts were restored.
    model_args: the architecture flags stored with the checkpoint ({} if none).
    """

    iteration: int | None
    run_state: dict
    path: Path
    loaded_optimizer: bool = False
    loaded_scheduler: bool = False
    loaded_rng: bool = False
    model_args: dict = dataclasses.field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- helpers

def _require_distributed() -> None:
    if not torch.distributed.is_initialized():
        raise CheckpointError("checkpointing needs torch.distributed initialised (a 1-process group is enough); "
                              "call initialize_megatron() first")


def _rank() -> int:
    return torch.distributed.get_rank()


def _rank0_then_share(fn: Callable[[], Any]) -> Any:
    """Run ``fn`` on rank 0 and give every rank its result; an exception on rank 0 is raised on all ranks
    as a CheckpointError (instead of leaving the other ranks waiting in a collective)."""
    box: list[Any] = [None]
    if _rank() == 0:
        try:
            box[0] = ("ok", fn())
        except Exception as e:  # noqa: BLE001 - re-raised on every rank below
            logger.exception("checkpoint: rank 0 failed")
            box[0] = ("error", f"{type(e).__name__}: {e}")
    if torch.distributed.get_world_size() > 1:
        torch.distributed.broadcast_object_list(box, src=0)
    status, value = box[0]
    if status == "error":
        raise CheckpointError(value)
    return value


def _unwrap(chunks: Sequence[torch.nn.Module]) -> list[torch.nn.Module]:
    from megatron.core.utils import unwrap_model

    return unwrap_model(list(chunks))


def _model_sharded_state(chunks: Sequence[torch.nn.Module]) -> dict[str, Any]:
    models = _unwrap(chunks)
    if len(models) == 1:
        return {"model": models[0].sharded_state_dict()}
    return {f"model{i}": m.sharded_state_dict() for i, m in enumerate(models)}


def _json_roundtrip(value: dict | None, name: str) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(f"{name} must be json-serialisable (plain dicts/lists/str/numbers/bools): {e}") from e


def _errors() -> tuple[type[BaseException], ...]:
    # torch DCP wraps per-rank failures in CheckpointException, which derives from BaseException

    return (Exception, CheckpointException)


def _describe(e: BaseException) -> str:
    """One line for an exception; DCP's multi-rank tracebacks are reduced to their final line."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"


def _cuda_rng() -> bool:

    return runtime.cuda_usable()


# ------------------------------------------------------------------------------------------------- save

def save_checkpoint(save_dir: str | os.PathLike, iteration: int | str, model_chunks: Sequence[torch.nn.Module],
                    optimizer=None, opt_param_scheduler=None, run_state: dict | None = None,
                    model_args: dict | None = None, dist_opt_format: str = "fully_reshardable", *,
                    save_rng: bool = True) -> Path:
    """Save a checkpoint of ``iteration`` under ``save_dir`` and publish it atomically. Collective.

    Args:
        save_dir: the save directory (created if missing); the checkpoint goes to ``iter_%07d`` (or
            ``release`` when ``iteration == "release"``: the model-only form conversion tools write).
        iteration: completed training iterations (int >= 0) or ``"release"``.
        model_chunks: the model, one module per virtual-pipeline chunk (DDP/Float16Module wrappers ok).
        optimizer: a megatron optimizer (``get_megatron_optimizer``); None saves no optimizer state.
        opt_param_scheduler: an ``OptimizerParamScheduler``; its state_dict goes to common state.
        run_state: json-able dict returned by :func:`load_checkpoint` (data position, consumed samples...).
        model_args: json-able architecture flags compared on load (keep parallel sizes out of it).
        dist_opt_format: distributed-optimizer format, ``"fully_reshardable"`` (reshards across DP/TP/PP)
            or ``"dp_reshardable"`` (faster, DP changes only). Ignored for other optimizers.
        save_rng: store each rank's RNG states (``--no-save-rng`` turns it off; never for "release").

    Returns: the published checkpoint directory. Raises CheckpointError if the save fails on any rank
    (the previous checkpoint and the tracker are then untouched).
    """
    _require_distributed()
    if dist_opt_format not in DIST_OPT_FORMATS:
        raise ValueError(f"dist_opt_format must be one of {DIST_OPT_FORMATS}, got {dist_opt_format!r} "
                         f"('fully_sharded_model_space' fails to load in megatron-core 0.16.1)")
    name = paths.checkpoint_dir_name(iteration)
    run_state, model_args = _json_roundtrip(run_state, "run_state"), _json_roundtrip(model_args, "model_args")
    root = Path(save_dir)
    t0 = time.perf_counter()

    def prepare() -> str:
        root.mkdir(parents=True, exist_ok=True)
        paths.remove_partial_dirs(root)
        tmp = root / paths.tmp_dir_name(iteration, paths.new_stamp())
        tmp.mkdir()
        return str(tmp)

    tmp_dir = Path(_rank0_then_share(prepare))
    opt_meta = optimizer_metadata(dist_opt_format)
    state = _save_state(model_chunks, optimizer, opt_param_scheduler, iteration, run_state, model_args,
                        dist_opt_format, save_rng, opt_meta)
    _write_on_every_rank(state, tmp_dir, opt_meta, root / name)
    integrity.write_manifest(tmp_dir)  # inside the temp dir: published together with the checkpoint
    final = root / name
    _rank0_then_share(lambda: paths.publish(tmp_dir, final))
    _rank0_then_share(lambda: paths.write_tracker(root, iteration))
    torch.distributed.barrier()
    if _rank() == 0:
        logger.info("saved checkpoint %s (iteration %s) in %.2f s", final, iteration, time.perf_counter() - t0)
    return final


def _save_state(model_chunks: Sequence[torch.nn.Module], optimizer, opt_param_scheduler, iteration: int | str,
                run_state: Any, model_args: Any, dist_opt_format: str, save_rng: bool, opt_meta: dict) -> dict:
    """The sharded state a save writes: the model, the optimizer, RNG, the scheduler and the common entries."""
    state = _model_sharded_state(model_chunks)
    contents = sorted(state)
    if optimizer is not None:
        materialize_optimizer_state(optimizer)
        state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=False, metadata=opt_meta)
        contents.append("optimizer")
    if save_rng and iteration != paths.RELEASE:  # a release is model-only: nothing to resume
        state[RNG_KEY] = rng_sharded_object(capture_rng_state(include_cuda=_cuda_rng()))
        contents.append(RNG_KEY)
    if opt_param_scheduler is not None:
        state["opt_param_scheduler"] = opt_param_scheduler.state_dict()
        contents.append("opt_param_scheduler")
    state["iteration"] = 0 if iteration == paths.RELEASE else iteration
    state["run_state"] = run_state
    state["model_args"] = model_args
    state["checkpoint_info"] = {"format_version": FORMAT_VERSION, "contents": contents,
                                "layout": parallel_layout(), "dist_opt_format": dist_opt_format,
                                "release": iteration == paths.RELEASE,
                                integrity.MANIFEST_INFO_KEY: integrity.MANIFEST_FILENAME}
    if optimizer is not None:
        state["checkpoint_info"]["distributed_optimizer"] = uses_distributed_optimizer(optimizer)
    return state


def _write_on_every_rank(state: dict, tmp_dir: Path, opt_meta: dict, final: Path) -> None:
    """Write ``state`` into ``tmp_dir``; a CheckpointError on every rank if any rank failed (nothing published)."""
    from megatron.core import dist_checkpointing

    use_in_process_write_results()  # no Manager process that a SIGKILL would orphan
    try:
        dist_checkpointing.save(state, str(tmp_dir), content_metadata=opt_meta)
        ok = True
        err = ""
    except _errors() as e:  # every rank must agree before anything is published
        logger.exception("checkpoint save into %s failed", tmp_dir)
        ok, err = False, _describe(e)
    flags = torch.tensor([0 if ok else 1], dtype=torch.int64, device="cuda" if _cuda_rng() else "cpu")
    torch.distributed.all_reduce(flags)  # every rank learns whether any rank failed
    if int(flags.item()) != 0:
        raise CheckpointError(f"saving {final} failed on {int(flags.item())} rank(s)"
                              f"{': ' + err if err else ''}; the previous checkpoint is untouched "
                              f"(partial dir {tmp_dir} is removed by the next save)")


# ------------------------------------------------------------------------------------------------- load

def _load_common(ckpt: Path) -> dict:
    from megatron.core import dist_checkpointing

    try:
        return dist_checkpointing.load_common_state_dict(str(ckpt))
    except _errors() as e:  # any failure here means an unreadable checkpoint
        raise CheckpointError(f"cannot read the common state of checkpoint {ckpt} ({_describe(e)}); "
                              f"the directory is corrupt or not a torch_dist checkpoint") from e


def _saved_contents(ckpt: Path, common: dict) -> set[str]:
    info = common.get("checkpoint_info")
    if info:
        return set(info["contents"])
    # a checkpoint written by another tool: look at which sharded keys it holds
    from megatron.core import dist_checkpointing

    keys = dist_checkpointing.load_tensors_metadata(str(ckpt)).keys()
    found = {"model"}
    if any(k.startswith("optimizer.") for k in keys):
        found.add("optimizer")
    if "opt_param_scheduler" in common:
        found.add("opt_param_scheduler")
    return found


def load_checkpoint(load_dir: str | os.PathLike, model_chunks: Sequence[torch.nn.Module], optimizer=None,
                    opt_param_scheduler=None, *, load_optimizer: bool = True, load_rng: bool = True,
                    strict: bool = True, model_args: dict | None = None,
                    verify_checksums: bool = True, newest: bool = False) -> LoadedCheckpoint:
    """Load the latest checkpoint of ``load_dir`` into the given model/optimizer/scheduler. Collective.

    Args:
        load_dir: a save directory (its tracker names the checkpoint) or a checkpoint directory itself.
        model_chunks: freshly built model chunks of the *current* parallel layout (may differ from the
            layout at save time); their parameters are overwritten.
        optimizer / opt_param_scheduler: restored when given and ``load_optimizer`` (the optimizer's main
            params are refreshed from the loaded model when the optimizer state is not loaded).
        load_optimizer: False loads the model only (release checkpoints, --finetune, --no-load-optim).
        load_rng: restore per-rank RNG states (only possible when the parallel layout is unchanged).
        strict: every model key must be in the checkpoint and vice versa.
        model_args: this run's architecture flags; any key stored with a different value raises.
        verify_checksums: check the files against the checksum manifest before reading them
            (``--no-verify-checkpoint-checksums`` turns it off); the NaN/Inf scan of loaded values always runs.
        newest: a tracker behind complete checkpoints of later iterations loads the newest of them, with a
            warning, instead of raising (``--load-newest-checkpoint``).

    Returns: LoadedCheckpoint. Raises CheckpointError for a missing/corrupt/incomplete checkpoint, a
    model_args mismatch, missing optimizer state with ``load_optimizer=True``, or tensors that do not fit.
    """
    t0 = time.perf_counter()
    ckpt = paths.resolve_checkpoint_dir(load_dir, newest)  # a bad directory is named before anything else
    _require_distributed()
    common, info, saved_args = _check_before_reading(ckpt, verify_checksums, model_args)
    contents = _saved_contents(ckpt, common)
    state = _model_sharded_state(model_chunks)
    want_opt = optimizer is not None and load_optimizer
    if want_opt:
        state["optimizer"] = _optimizer_sharded_state(ckpt, optimizer, state, common, info, contents)
    want_rng = _restores_rng(load_rng, contents, info)
    if want_rng:
        state[RNG_KEY] = rng_sharded_object(capture_rng_state(include_cuda=_cuda_rng()))
    loaded = _read_state(ckpt, state, strict, info, optimizer if want_opt else None)
    models = _unwrap(model_chunks)
    _restore_models(ckpt, loaded, models, strict)
    loaded_sched = False
    if want_opt:
        loaded_sched = _restore_optimizer(ckpt, loaded, common, info, optimizer, opt_param_scheduler)
    elif optimizer is not None:
        optimizer.reload_model_params()  # main (fp32) params must follow the loaded model params
    integrity.check_finite_state(ckpt, models, optimizer if want_opt else None)
    if want_rng:
        restore_rng_state(loaded[RNG_KEY], include_cuda=_cuda_rng())

    iteration = common.get("iteration")
    if info.get("release") or ckpt.name == paths.RELEASE:
        iteration = 0
    torch.distributed.barrier()
    if _rank() == 0:
        logger.info("loaded checkpoint %s (iteration %s; optimizer %s, rng %s) in %.2f s", ckpt, iteration,
                    want_opt, want_rng, time.perf_counter() - t0)
    return LoadedCheckpoint(iteration=iteration, run_state=common.get("run_state") or {}, path=ckpt,
                            loaded_optimizer=want_opt, loaded_scheduler=loaded_sched, loaded_rng=want_rng,
                            model_args=saved_args)


def _check_before_reading(ckpt: Path, verify_checksums: bool, model_args: dict | None) -> tuple[dict, dict, dict]:
    """(common state, checkpoint info, saved model args) once the files, the iteration and the architecture
    flags check out, before any tensor is read."""
    verified = verify_checksums and integrity.verify_manifest(ckpt)
    common = _load_common(ckpt)
    info = common.get("checkpoint_info") or {}
    if verify_checksums and not verified:
        integrity.check_missing_manifest(ckpt, info)
    integrity.check_iteration_matches_dir(ckpt, common.get("iteration"))
    saved_args = common.get("model_args") or {}
    if model_args:
        current_args = _json_roundtrip(model_args, "model_args")
        check_model_args(saved_args, current_args, ckpt)
        check_padded_vocab(ckpt, saved_args, current_args, info.get("layout") or {})
    return common, info, saved_args


def _optimizer_sharded_state(ckpt: Path, optimizer, state: dict, common: dict, info: dict, contents: set[str]) -> Any:
    """The optimizer's sharded state to load into, once the checkpoint is known to hold a matching one."""
    from megatron.core import dist_checkpointing

    if "optimizer" not in contents:
        raise CheckpointError(f"checkpoint {ckpt} has no optimizer state (a model-only/release checkpoint); "
                              f"load it with load_optimizer=False (--no-load-optim or --finetune)")
    if info.get("distributed_optimizer") is not None and \
            bool(info["distributed_optimizer"]) != uses_distributed_optimizer(optimizer):
        raise optimizer_error(ckpt, "", info, optimizer, parallel_layout())  # known before any tensor is read
    saved_meta = dist_checkpointing.load_content_metadata(preloaded_state_dict=common) or \
        optimizer_metadata("fully_reshardable")
    return optimizer.sharded_state_dict(state, is_loading=True, metadata=saved_meta)


def _restores_rng(load_rng: bool, contents: set[str], info: dict) -> bool:
    """Whether the saved RNG states are restored: asked for, saved, and saved under this parallel layout."""
    layout = parallel_layout()
    want_rng = load_rng and RNG_KEY in contents
    if want_rng and info.get("layout") != layout:
        want_rng = False
        if _rank() == 0:
            logger.info("RNG state not restored: saved under layout %s, now %s (generators keep this run's seeds)",
                        info.get("layout"), layout)
    return want_rng


def _read_state(ckpt: Path, state: dict, strict: bool, info: dict, optimizer) -> dict:
    """``state`` read from ``ckpt`` (``optimizer``: the one whose state is read, else None)."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.validation import StrictHandling

    try:
        return dist_checkpointing.load(
            state, str(ckpt), strict=StrictHandling.ASSUME_OK_UNEXPECTED if strict else StrictHandling.LOG_ALL)
    except _errors() as e:  # shape/key mismatches and unreadable shards surface here
        if optimizer is not None and "optimizer" in str(e):
            raise optimizer_error(ckpt, _describe(e), info, optimizer, parallel_layout()) from e
        raise CheckpointError(f"loading {ckpt} failed ({_describe(e)}). If the architecture changed, "
                              f"pass model_args to get the differing flag named") from e


def _restore_models(ckpt: Path, loaded: dict, models: list, strict: bool) -> None:
    keys = ["model"] if len(models) == 1 else [f"model{i}" for i in range(len(models))]
    for key, model in zip(keys, models):
        if key not in loaded:
            raise CheckpointError(f"checkpoint {ckpt} has no '{key}' entry (saved with a different number of "
                                  f"virtual pipeline chunks?)")
        try:
            model.load_state_dict(loaded[key], strict=strict)
        except RuntimeError as e:
            raise CheckpointError(f"checkpoint {ckpt} does not fit the model ({key}): {e}") from e


def _restore_optimizer(ckpt: Path, loaded: dict, common: dict, info: dict, optimizer, opt_param_scheduler) -> bool:
    """Load the optimizer's (and the scheduler's) state; returns whether the scheduler's was loaded."""
    restore_zero_steps(loaded["optimizer"])
    try:
        optimizer.load_state_dict(loaded["optimizer"])
    except (KeyError, ValueError, RuntimeError, IndexError, AssertionError) as e:
        raise optimizer_error(ckpt, _describe(e), info, optimizer, parallel_layout()) from e
    if opt_param_scheduler is not None and "opt_param_scheduler" in common:
        # named flags instead of megatron-core's bare AssertionError (after the optimizer: its errors first)
        opt_param_scheduler.load_state_dict(
            check_scheduler_matches(ckpt, common["opt_param_scheduler"], opt_param_scheduler))
        return True
    return False
