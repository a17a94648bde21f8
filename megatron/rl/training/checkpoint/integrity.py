"""Checks that a checkpoint's bytes and values are the ones that were saved, and that it fits the resuming run.

A checksum manifest (``checksums.json``, written before publishing, verified before any tensor is read;
``--no-verify-checkpoint-checksums`` skips it), a scan of loaded values (finite; Adam's second moment
non-negative), and the stored iteration against its directory name. Every function that touches
``torch.distributed`` is collective and raises on every rank together.

Details: docs/training.md.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from pathlib import Path
from typing import Any, Iterable

import torch

from megatron.rl.training.checkpoint.paths import CheckpointError

logger = logging.getLogger(__name__)

__all__ = ["MANIFEST_FILENAME", "MANIFEST_INFO_KEY", "VERIFY_FLAG", "hash_file", "write_manifest",
           "verify_manifest", "check_missing_manifest", "check_finite_state", "check_iteration_matches_dir"]

MANIFEST_FILENAME = "checksums.json"
#: the key of a checkpoint's ``checkpoint_info`` (its common state) recording that the save wrote a manifest
MANIFEST_INFO_KEY = "checksum_manifest"
VERIFY_FLAG = "--no-verify-checkpoint-checksums"
_CHUNK = 8 << 20
_ITER_DIR = re.compile(r"^iter_(\d{7,})$")
_warned_no_manifest = False

try:  # optional: about 10x faster than blake2b
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None


def _hasher(algorithm: str):
    if algorithm == "xxh3_128":
        if xxhash is None:
            raise CheckpointError("the checkpoint's manifest uses xxh3_128 but the xxhash package is not installed: "
                                  f"pip install xxhash, or pass {VERIFY_FLAG}")
        return xxhash.xxh3_128()
    if algorithm == "blake2b":
        return hashlib.blake2b(digest_size=16)
    raise CheckpointError(f"unknown checksum algorithm {algorithm[:40]!r} in the checkpoint's manifest")


def default_algorithm() -> str:
    return "xxh3_128" if xxhash is not None else "blake2b"


def hash_file(path: Path, algorithm: str) -> str:
    """Hex digest of a file's bytes."""
    h = _hasher(algorithm)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(ckpt_dir: Path) -> list[str]:
    return sorted(str(p.relative_to(ckpt_dir)) for p in ckpt_dir.rglob("*")
                  if p.is_file() and p.name != MANIFEST_FILENAME)


def _world() -> tuple[int, int]:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    return 0, 1


def _gather(obj: Any) -> list[Any]:
    rank, world = _world()
    if world == 1:
        return [obj]
    out: list[Any] = [None] * world
    torch.distributed.all_gather_object(out, obj)
    return out


def _raise_on_all_ranks(local_error: str | None) -> None:
    """Every rank raises CheckpointError if any rank found a problem (the first rank's message)."""
    errors = [e for e in _gather(local_error) if e]
    if errors:
        raise CheckpointError(errors[0])


# ------------------------------------------------------------------------------------------- manifest

def write_manifest(ckpt_dir: Path) -> None:
    """Hash every file of ``ckpt_dir`` (shared across ranks) and write ``checksums.json`` there. Collective.

    Call after every rank finished writing and before the directory is published.
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = _world()
    algorithm = default_algorithm()
    names = _files(ckpt_dir) if rank == 0 else None
    if world > 1:
        box = [names]
        torch.distributed.broadcast_object_list(box, src=0)
        names = box[0]
    mine, error = {}, None
    try:
        for name in names[rank::world]:
            path = ckpt_dir / name
            mine[name] = {"size": path.stat().st_size, "hash": hash_file(path, algorithm)}
    except OSError as e:
        error = f"cannot hash {ckpt_dir} for its checksum manifest: {e}"
    parts = _gather((mine, error))
    _raise_on_all_ranks(next((err for _, err in parts if err), None))
    if rank == 0:
        files = {k: v for part, _ in parts for k, v in part.items()}
        tmp = ckpt_dir / (MANIFEST_FILENAME + ".tmp")
        with open(tmp, "w") as f:
            json.dump({"algorithm": algorithm, "files": dict(sorted(files.items()))}, f, indent=0)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, ckpt_dir / MANIFEST_FILENAME)
    if world > 1:
        torch.distributed.barrier()


def _read_manifest(ckpt_dir: Path) -> dict | None:
    path = ckpt_dir / MANIFEST_FILENAME
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        if not isinstance(files, dict) or not isinstance(manifest["algorithm"], str):
            raise ValueError("malformed")
        return manifest
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path} is unreadable or malformed ({type(e).__name__}): the checkpoint cannot be "
                              f"verified; restore it from a copy, or pass {VERIFY_FLAG} to load it anyway") from e


def verify_manifest(ckpt_dir: Path) -> bool:
    """Check every file listed in the manifest (size, then hash), and that it lists every file. Collective.

    Returns False when the checkpoint has no manifest (then call :func:`check_missing_manifest` with its
    metadata); raises CheckpointError naming the first bad or unlisted file otherwise.
    """
    ckpt_dir = Path(ckpt_dir)
    rank, world = _world()
    error, manifest = None, None
    try:
        manifest = _read_manifest(ckpt_dir)
    except CheckpointError as e:
        error = str(e)
    _raise_on_all_ranks(error)
    if manifest is None:
        return False
    names = sorted(manifest["files"])
    try:
        if rank == 0:
            unlisted = sorted(set(_files(ckpt_dir)) - set(names))
            if unlisted:
                shown = ", ".join(unlisted[:5]) + (f" and {len(unlisted) - 5} more" if len(unlisted) > 5 else "")
                raise CheckpointError(f"checkpoint {ckpt_dir} holds {len(unlisted)} file(s) its {MANIFEST_FILENAME} "
                                      f"does not list: {shown} (added or renamed after the save)")
        for name in names[rank::world]:
            want = manifest["files"][name]
            path = ckpt_dir / name
            if not path.is_file():
                raise CheckpointError(f"checkpoint {ckpt_dir} is missing {name} (listed in {MANIFEST_FILENAME})")
            size = path.stat().st_size
            if size != want.get("size"):
                raise CheckpointError(f"checkpoint file {path} has {size} bytes, {want.get('size')} when saved")
            if hash_file(path, manifest["algorithm"]) != want.get("hash"):
                raise CheckpointError(f"checkpoint file {path} does not match its checksum (the bytes changed "
                                      f"after the save)")
    except CheckpointError as e:
        error = f"{e}: the checkpoint is corrupt. Restore it from a copy or load an earlier iteration; " \
                f"{VERIFY_FLAG} skips this check"
    except OSError as e:
        error = f"cannot read checkpoint {ckpt_dir} to verify it: {e}"
    _raise_on_all_ranks(error)
    return True


def check_missing_manifest(ckpt_dir: Path, checkpoint_info: dict) -> None:
    """The checkpoint has no manifest: CheckpointError when its ``checkpoint_info`` says the save wrote one (it
    was deleted or lost, and the files cannot be verified), else a one-time warning (saved before manifests
    existed). Every rank reads the same metadata, so every rank raises together."""
    global _warned_no_manifest
    if checkpoint_info.get(MANIFEST_INFO_KEY):
        raise CheckpointError(
            f"checkpoint {ckpt_dir} has no {MANIFEST_FILENAME}, but it was saved with one: the manifest was deleted "
            f"or lost, so its files cannot be verified. Restore the checkpoint from a copy, or pass {VERIFY_FLAG} "
            f"to load it unverified")
    if not _warned_no_manifest and _world()[0] == 0:
        logger.warning("checkpoint %s has no %s (saved before checksum manifests existed): its files are not "
                       "verified", ckpt_dir, MANIFEST_FILENAME)
    _warned_no_manifest = True


# ------------------------------------------------------------------------------------------- value scan

def _named_tensors(obj: Any, prefix: str) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _named_tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _named_tensors(v, f"{prefix}[{i}]")


def _optimizer_tensors(optimizer) -> Iterable[tuple[str, torch.Tensor]]:
    """(name, tensor) of the optimizer's per-parameter state and fp32 main params, on this rank."""
    for j, sub in enumerate(getattr(optimizer, "chained_optimizers", [optimizer])):
        inner = getattr(sub, "optimizer", None)
        if inner is None:
            continue
        for g, group in enumerate(inner.param_groups):
            for p_i, p in enumerate(group["params"]):
                yield f"optimizer[{j}].param_groups[{g}].params[{p_i}]", p.data
                for key, value in inner.state.get(p, {}).items():
                    if isinstance(value, torch.Tensor):
                        yield f"optimizer[{j}].state[{g}/{p_i}].{key}", value


def _bad_tensor(name: str, t: torch.Tensor) -> str | None:
    if not (t.is_floating_point() or t.is_complex()) or t.numel() == 0:
        return None
    finite = torch.isfinite(t)
    if not bool(finite.all()):
        return f"{name} has {int((~finite).sum())} non-finite value(s) of {t.numel()}"
    if name.endswith("exp_avg_sq") and bool((t < 0).any()):
        return f"{name} (Adam's second moment) has negative values"
    return None


def check_finite_state(ckpt: Path, model_chunks, optimizer=None) -> None:
    """CheckpointError on every rank when any rank's loaded parameters or optimizer state hold NaN/Inf (or a
    negative Adam second moment). Collective."""
    error = None
    with torch.no_grad():
        named = [(f"model{i}.{k}", p) for i, m in enumerate(model_chunks) for k, p in m.named_parameters()]
        if optimizer is not None:
            named += list(_optimizer_tensors(optimizer))
        for name, t in named:
            error = _bad_tensor(name, t)
            if error:
                break
    if error:
        error = (f"checkpoint {ckpt} loaded corrupt values: {error}. Restore the checkpoint from a copy or load an "
                 f"earlier iteration (training on it would produce NaN losses)")
    _raise_on_all_ranks(error)


# ------------------------------------------------------------------------------------------- consistency

def check_iteration_matches_dir(ckpt: Path, iteration: Any) -> None:
    """The iteration stored inside ``iter_XXXXXXX`` must be XXXXXXX (a copied or renamed directory would
    otherwise resume at the wrong step, with the wrong data position and LR)."""
    m = _ITER_DIR.match(Path(ckpt).name)
    if m is None or iteration is None:
        return
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise CheckpointError(f"checkpoint {ckpt} holds an invalid iteration {str(iteration)[:40]!r}: the "
                              f"checkpoint is corrupt")
    if iteration != int(m.group(1)):
        raise CheckpointError(
            f"checkpoint {ckpt} holds iteration {iteration} but its directory name says {int(m.group(1))}: the "
            f"directory was renamed or its contents replaced. Restore the right checkpoint, or rename the directory "
            f"to iter_{iteration:07d} (and update latest_checkpointed_iteration.txt) if the contents are right")
