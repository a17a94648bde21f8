"""Checkpoint directory layout: names, the tracker file, completeness checks and atomic publishing.

Megatron-LM's layout (``latest_checkpointed_iteration.txt``, ``iter_XXXXXXX/``, ``release/``). A save writes into
a ``.tmp-`` directory, renames it into place, then replaces the tracker atomically; a directory without
``metadata.json`` is never loaded. One job writes to a save directory at a time. Must not touch
torch.distributed: callers decide which rank runs what.

Layout and reasons: docs/training.md.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path

from megatron.rl.base.errors import UserError

logger = logging.getLogger(__name__)

TRACKER_FILENAME = "latest_checkpointed_iteration.txt"
RELEASE = "release"
# Written last by dist_checkpointing.save (rank 0, after every rank's shards): the completion marker.
COMPLETION_MARKER = "metadata.json"
# Also required: torch DCP's global metadata (written by the coordinator at the end) and, in megatron-core 0.16.1's
# format, the common state. megatron-core 0.19 writes the common state into the sharded files instead; its marker
# then names no "common_backend" (checkpoint_format).
REQUIRED_FILES = (COMPLETION_MARKER, ".metadata")
COMMON_FILE = "common.pt"
TMP_INFIX = ".tmp-"
TRASH_INFIX = ".replaced-"
_ITER_RE = re.compile(r"^iter_(\d{7,})$")
NEWEST_FLAG = "--load-newest-checkpoint"
_PARTIAL_RE = re.compile(r"^(iter_\d{7,}|release)(\.tmp-|\.replaced-)")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the path, the problem and the fix."""


def checkpoint_dir_name(iteration: int | str) -> str:
    """``iter_0000100`` for an int (zero-padded to 7 digits), ``release`` for ``"release"``."""
    if iteration == RELEASE:
        return RELEASE
    if isinstance(iteration, bool) or not isinstance(iteration, int) or iteration < 0:
        raise ValueError(f"checkpoint iteration must be an int >= 0 or 'release', got {iteration!r}")
    return f"iter_{iteration:07d}"


def tmp_dir_name(iteration: int | str, stamp: str) -> str:
    return f"{checkpoint_dir_name(iteration)}{TMP_INFIX}{stamp}"


def new_stamp() -> str:
    """Unique-enough suffix for temp directories: UTC time + pid of the rank that chose it."""
    return f"{time.strftime('%Y%m%dT%H%M%S', time.gmtime())}-{os.getpid()}"


def checkpoint_format(ckpt_dir: Path) -> str:
    """``"common.pt"`` (megatron-core 0.16.1: the common state in its own file, which the marker's
    ``common_backend`` announces), ``"sharded common"`` (0.19: the common state inside the sharded files) or ``""``
    when the completion marker is missing or unreadable."""
    if (Path(ckpt_dir) / COMMON_FILE).is_file():
        return COMMON_FILE
    try:
        marker = json.loads((Path(ckpt_dir) / COMPLETION_MARKER).read_text())
    except (OSError, ValueError):
        return ""
    if not isinstance(marker, dict):
        return ""
    return COMMON_FILE if "common_backend" in marker else "sharded common"


def missing_files(ckpt_dir: Path) -> list[str]:
    """Required files absent from ``ckpt_dir`` (empty list = a complete checkpoint directory)."""
    missing = [name for name in REQUIRED_FILES if not (ckpt_dir / name).is_file()]
    if checkpoint_format(ckpt_dir) == COMMON_FILE and not (ckpt_dir / COMMON_FILE).is_file():
        missing.append(COMMON_FILE)
    return missing


def is_complete(ckpt_dir: Path) -> bool:
    return ckpt_dir.is_dir() and not missing_files(ckpt_dir)


def partial_dirs(root: Path) -> list[Path]:
    """Leftovers of interrupted saves (``*.tmp-*``) or of interrupted replacements (``*.replaced-*``)."""
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _PARTIAL_RE.match(p.name))


def complete_iterations(root: Path) -> list[int]:
    """Iterations that have a complete ``iter_XXXXXXX`` directory under ``root`` (ascending)."""
    if not root.is_dir():
        return []
    its = []
    for p in root.iterdir():
        m = _ITER_RE.match(p.name)
        if m and is_complete(p):
            its.append(int(m.group(1)))
    return sorted(its)


_TRACKER_RE = re.compile(rb"^(0|[1-9][0-9]{0,18}|release)\n?\Z")


def read_tracker(root: Path) -> int | str | None:
    """The tracker's content: an int iteration, ``"release"``, or None when there is no tracker file.

    Raises CheckpointError unless the file holds exactly what :func:`write_tracker` writes: an int >= 0
    without leading zeros or spaces, or ``release``, and at most one newline after it.
    """
    tracker = root / TRACKER_FILENAME
    if not tracker.is_file():
        return None
    try:
        with open(tracker, "rb") as f:  # a few bytes; a huge or binary file is corrupt, not read whole
            raw = f.read(65)
    except OSError as e:
        raise CheckpointError(f"cannot read tracker file {tracker}: {e.strerror or e}") from None
    match = _TRACKER_RE.match(raw)
    if match is None:
        text = raw[:64].decode("utf-8", "replace") + ("..." if len(raw) > 64 else "")
        raise CheckpointError(
            f"corrupt tracker file {tracker}: expected an iteration number or 'release' (and a newline), found "
            f"{text[:80]!r}. Write the iteration of a complete checkpoint directory into it (complete ones: "
            f"{complete_iterations(root) or 'none'}), or point --load at a checkpoint directory.")
    value = match.group(1).decode()
    return RELEASE if value == RELEASE else int(value)


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # some filesystems do not allow opening directories
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_tracker(root: Path, iteration: int | str) -> None:
    """Atomically set the tracker to ``iteration``: write a temp file, fsync, ``os.replace``, fsync the dir."""
    checkpoint_dir_name(iteration)  # validates
    tmp = root / f"{TRACKER_FILENAME}{TMP_INFIX}{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(f"{iteration}\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / TRACKER_FILENAME)
    _fsync_dir(root)


def publish(tmp_dir: Path, final_dir: Path) -> None:
    """Rename a finished temp checkpoint into place, replacing an existing checkpoint of the same name.

    An existing ``final_dir`` is first renamed aside (``*.replaced-*``) and deleted after the new one is
    in place, so at every instant ``final_dir`` is either the old complete checkpoint or the new one
    (except the instant between the two renames, which a loader reports as 'missing').
    """
    missing = missing_files(tmp_dir)
    if missing:
        raise CheckpointError(f"refusing to publish {tmp_dir}: it lacks {missing} (the save did not finish)")
    trash = None
    if final_dir.exists():
        trash = final_dir.with_name(f"{final_dir.name}{TRASH_INFIX}{new_stamp()}")
        logger.warning("replacing existing checkpoint %s", final_dir)
        os.rename(final_dir, trash)
    os.rename(tmp_dir, final_dir)
    _fsync_dir(final_dir.parent)
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)


def remove_partial_dirs(root: Path) -> list[Path]:
    """Delete leftovers of interrupted saves under ``root`` (call on one rank, before starting a save)."""
    removed = []
    for p in partial_dirs(root):
        logger.warning("removing %s: left by an interrupted checkpoint save, never loaded", p)
        shutil.rmtree(p, ignore_errors=True)
        removed.append(p)
    return removed


def _interrupted_save(root: Path, newer: list[int]) -> bool:
    """True when the one newer checkpoint is a save killed between publishing its directory and rewriting the
    tracker: its completion marker was written after the tracker was. A tracker edited or damaged after the
    saves is newer than every checkpoint it is behind."""
    if len(newer) != 1:
        return False
    try:
        marker = (root / checkpoint_dir_name(newer[0]) / COMPLETION_MARKER).stat().st_mtime_ns
        tracker = (root / TRACKER_FILENAME).stat().st_mtime_ns
    except OSError:
        return False
    if marker < tracker:
        return False
    logger.warning("%s: the save of iteration %d was interrupted before the tracker named it; loading iteration "
                   "%s, as the tracker says (that save is written again)", root, newer[0],
                   read_tracker(root))
    return True


def _check_nothing_newer(root: Path, value: int | str, newest: bool) -> int | str:
    """``value``, unless complete checkpoints newer than it exist: then the newest with ``newest``, else an error.

    A tracker behind the directories it describes was damaged or edited; resuming from it would later write over
    the newer checkpoints, so it is never followed silently.
    """
    if value == RELEASE:
        return value
    newer = [i for i in complete_iterations(root) if i > value]
    if not newer or _interrupted_save(root, newer):
        return value
    if newest:
        logger.warning("%s names iteration %d but complete checkpoints of later iterations exist (%s): loading the "
                       "newest, %d (%s)", root / TRACKER_FILENAME, value, newer, newer[-1], NEWEST_FLAG)
        return newer[-1]
    raise CheckpointError(
        f"{root / TRACKER_FILENAME} names iteration {value} but complete checkpoints of later iterations exist: "
        f"{newer}. The tracker was damaged or edited; write the iteration to load into it, remove the later "
        f"directories, or pass {NEWEST_FLAG} to load the newest ({newer[-1]})")


def latest_checkpoint(load_dir: str | os.PathLike, newest: bool = False) -> Path | None:
    """The checkpoint directory ``--load load_dir`` would load, or None when there is none yet.

    ``load_dir`` may be a checkpoint directory itself (it holds ``metadata.json``) or a save directory
    with a tracker file. Returns None when ``load_dir`` does not exist or holds no tracker (nothing was
    ever published there). Raises CheckpointError when the tracker is corrupt or names a directory that
    is missing or incomplete: that is never silently replaced by an older checkpoint; and when complete
    checkpoints newer than the tracker exist, unless ``newest`` (``--load-newest-checkpoint``) picks the newest
    of them with a warning.
    """
    root = Path(load_dir)
    if not root.is_dir():
        return None
    if (root / COMPLETION_MARKER).is_file() or (root / COMMON_FILE).is_file():
        return root
    leftovers = partial_dirs(root)
    if leftovers:
        logger.info("ignoring %d partial checkpoint dir(s) in %s (interrupted saves): %s",
                    len(leftovers), root, ", ".join(p.name for p in leftovers))
    value = read_tracker(root)
    if value is None:
        return None
    value = _check_nothing_newer(root, value, newest)
    ckpt = root / checkpoint_dir_name(value)
    if not ckpt.is_dir():
        raise CheckpointError(
            f"{root / TRACKER_FILENAME} names {value!r} but {ckpt} does not exist. Complete checkpoints "
            f"present: {complete_iterations(root) or 'none'}; write one of them into the tracker file, "
            f"or load a checkpoint directory directly.")
    return ckpt


def resolve_checkpoint_dir(load_dir: str | os.PathLike, newest: bool = False) -> Path:
    """Like :func:`latest_checkpoint` but every 'nothing to load' case is a CheckpointError, and the
    directory found must be complete."""
    root = Path(load_dir)
    if not root.exists():
        raise CheckpointError(f"checkpoint directory {root} does not exist: check --load / --pretrained-checkpoint")
    if not root.is_dir():
        raise CheckpointError(f"checkpoint path {root} is not a directory")
    ckpt = latest_checkpoint(root, newest)
    if ckpt is None:
        found = complete_iterations(root)
        hint = (f"complete checkpoints present: {found}; write one into {TRACKER_FILENAME} or load "
                f"{root / checkpoint_dir_name(found[-1])} directly" if found else
                "it holds no complete checkpoint either; start without --load, or point it at a save directory")
        raise CheckpointError(f"no {TRACKER_FILENAME} in {root}: {hint}")
    missing = missing_files(ckpt)
    if missing:
        raise CheckpointError(
            f"checkpoint {ckpt} is incomplete or corrupt: missing {', '.join(missing)} (an interrupted save or a "
            f"partial copy). Point the tracker at a complete checkpoint (complete ones: "
            f"{complete_iterations(ckpt.parent) or 'none'}) or re-copy the directory.")
    check_readable_by_installed_release(ckpt)
    return ckpt


def check_readable_by_installed_release(ckpt: Path) -> None:
    """Refuse, in one line, a checkpoint in megatron-core 0.19's format when 0.16.1 is installed (0.16.1 reads the
    common state from its own file only; 0.19 reads both formats)."""
    from megatron.rl.runtime import versions

    if checkpoint_format(ckpt) == "sharded common" and versions.installed_release() == "0.16":
        raise CheckpointError(
            f"checkpoint {ckpt} was written by megatron-core 0.19 (its common state is inside the sharded files), "
            f"which megatron-core {versions.installed_version()} cannot read: load it with megatron-core 0.19.x "
            f"(Python 3.12), or convert it to Hugging Face there (tools/convert_megatron_to_hf.py)")
