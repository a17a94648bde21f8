"""A save interrupted at any point never becomes what --load picks; missing, incomplete and corrupt
checkpoints are CheckpointErrors that say what is wrong."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.rl.runtime import versions
from megatron.rl.training.checkpoint import paths as checkpoint_paths
from megatron.rl.training.checkpoint.save_load import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint

SCRIPTS = Path(__file__).parent / "scripts"
TRACKER = "latest_checkpointed_iteration.txt"


@pytest.fixture(scope="module")
def saved(dist1, tmp_path_factory):
    """A save dir holding one complete checkpoint (iteration 1) + the model/optimizer that wrote it."""
    tiny = dist1
    root = tmp_path_factory.mktemp("ckpt") / "save"
    arch = tiny.Arch()
    chunks, opt, sched = tiny.build(arch, False)
    tiny.train_step(chunks, opt, sched, 0)
    save_checkpoint(root, 1, chunks, opt, sched, run_state={"step": 1}, model_args=arch.model_args())
    return root, arch, (chunks, opt, sched), tiny.eval_loss(chunks)


def copy_of(saved, tmp_path) -> Path:
    dst = tmp_path / "save"
    shutil.copytree(saved[0], dst)
    return dst


def load_into_fresh(tiny, arch, root, **kw):
    chunks, opt, sched = tiny.build(arch, False, seed=11)
    info = load_checkpoint(root, chunks, opt, sched, model_args=arch.model_args(), **kw)
    return info, tiny.eval_loss(chunks)


def test_interrupted_save_is_never_loaded_and_is_cleaned(dist1, saved, tmp_path, monkeypatch, caplog):
    """In-process stand-in for a kill in the middle of a save: every shard is written, the completion
    marker is not (the slow test below does it with a real SIGKILL)."""
    tiny = dist1
    root = copy_of(saved, tmp_path)
    chunks, opt, sched = saved[2]
    from megatron.core.dist_checkpointing import serialization

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")

    monkeypatch.setattr(serialization, "save_config", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 2, chunks, opt, sched)
    monkeypatch.undo()
    partial = [p for p in root.iterdir() if ".tmp-" in p.name]
    assert len(partial) == 1 and partial[0].name.startswith("iter_0000002.tmp-")
    assert list(partial[0].glob("*.distcp")) and not (partial[0] / "metadata.json").exists()
    assert (root / TRACKER).read_text().strip() == "1" and latest_checkpoint(root) == root / "iter_0000001"
    info, loss = load_into_fresh(tiny, saved[1], root)
    assert info.iteration == 1 and loss == saved[3]

    with caplog.at_level("WARNING", logger=checkpoint_paths.__name__):
        save_checkpoint(root, 3, chunks, opt, sched)
    assert "interrupted checkpoint save" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000003", TRACKER]


@pytest.mark.slow
def test_sigkilled_save_is_never_loaded_and_is_cleaned(dist1, tmp_path, caplog):
    tiny = dist1
    root, out = tmp_path / "save", tmp_path / "loss.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "log.txt"
    # own session + output to a file: the killed process leaves helper processes of the torch_dist writer
    # (multiprocessing manager) behind; they must neither hold our pipes open nor outlive the test
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, str(SCRIPTS / "save_then_die.py"), str(root), str(out)],
                                env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rc = proc.wait(timeout=300)
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert rc == -signal.SIGKILL, log.read_text()[-4000:]
    partial = [p.name for p in root.iterdir() if ".tmp-" in p.name]
    assert len(partial) == 1 and partial[0].startswith("iter_0000002.tmp-")
    assert not (root / "iter_0000002").exists() and (root / TRACKER).read_text().strip() == "1"

    assert latest_checkpoint(root) == root / "iter_0000001"
    arch = tiny.Arch()
    info, loss = load_into_fresh(tiny, arch, root)
    assert info.iteration == 1 and info.run_state == {"step": 1}
    assert loss == json.loads(out.read_text())["eval_loss"]

    chunks, opt, sched = tiny.build(arch, False)
    with caplog.at_level("WARNING", logger=checkpoint_paths.__name__):
        save_checkpoint(root, 3, chunks, opt, sched)
    assert "interrupted checkpoint save" in caplog.text
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", "iter_0000003", TRACKER]


def test_failure_before_publish_keeps_previous(dist1, saved, tmp_path, monkeypatch):
    tiny = dist1
    root = copy_of(saved, tmp_path)
    chunks, opt, sched = saved[2]
    from megatron.core import dist_checkpointing

    def broken_save(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(dist_checkpointing, "save", broken_save)
    with pytest.raises(CheckpointError, match="disk full.*previous checkpoint is untouched"):
        save_checkpoint(root, 2, chunks, opt, sched)
    monkeypatch.undo()
    assert (root / TRACKER).read_text().strip() == "1" and not (root / "iter_0000002").exists()
    info, loss = load_into_fresh(tiny, saved[1], root)
    assert info.iteration == 1 and loss == saved[3]


def test_kill_between_publish_and_tracker_update(dist1, saved, tmp_path, monkeypatch):
    tiny = dist1
    root = copy_of(saved, tmp_path)
    chunks, opt, sched = saved[2]

    def killed(*a, **k):
        raise KeyboardInterrupt("killed")  # what a signal would leave: the new dir is in place, tracker not

    monkeypatch.setattr(checkpoint_paths, "write_tracker", killed)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(root, 2, chunks, opt, sched)
    monkeypatch.undo()
    assert checkpoint_paths.is_complete(root / "iter_0000002")
    assert latest_checkpoint(root) == root / "iter_0000001"
    assert load_into_fresh(tiny, saved[1], root)[0].iteration == 1


def test_resave_same_iteration_replaces_it(dist1, saved, tmp_path):
    tiny = dist1
    root = copy_of(saved, tmp_path)
    arch = saved[1]
    chunks, opt, sched = tiny.build(arch, False, seed=3)
    tiny.train_step(chunks, opt, sched, 0)
    save_checkpoint(root, 1, chunks, opt, sched, run_state={"step": "again"})
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000001", TRACKER]
    info, loss = load_into_fresh(tiny, arch, root)
    assert info.run_state == {"step": "again"} and loss == tiny.eval_loss(chunks) != saved[3]


def _no_tracker(root):
    (root / TRACKER).unlink()


def _corrupt_tracker(root):
    (root / TRACKER).write_text("iter_1\n")


def _tracker_to_missing(root):
    (root / TRACKER).write_text("7\n")


def _incomplete(root):
    (root / "iter_0000001" / "metadata.json").unlink()


# a file of the checkpoint besides the shards: the common state (0.16.1) or torch DCP metadata (0.19)
UNSHARDED_FILE = ".metadata" if versions.is_0_19() else "common.pt"


def _corrupt_common(root):
    (root / "iter_0000001" / UNSHARDED_FILE).write_bytes(b"\x00garbage" * 10)


def _corrupt_shards(root):
    for f in (root / "iter_0000001").glob("*.distcp"):
        f.write_bytes(b"\x00" * 16)


@pytest.mark.parametrize("damage, message", [
    (_no_tracker, r"no latest_checkpointed_iteration.txt in .*save: complete checkpoints present: \[1\]"),
    (_corrupt_tracker, r"corrupt tracker file .*found 'iter_1\\n'"),
    (_tracker_to_missing, r"names 7 but .*iter_0000007 does not exist.*Complete checkpoints present: \[1\]"),
    (_incomplete, r"iter_0000001 is incomplete or corrupt: missing metadata.json"),
    # the checksum manifest catches these first (test_checkpoint_integrity.py covers loads without it)
    (_corrupt_common, rf"iter_0000001/{re.escape(UNSHARDED_FILE)} has 80 bytes.*the checkpoint is corrupt"),
    (_corrupt_shards, r"iter_0000001/\S+\.distcp has 16 bytes.*the checkpoint is corrupt"),
], ids=["no-tracker", "corrupt-tracker", "tracker-to-missing", "incomplete", "corrupt-common", "corrupt-shards"])
def test_broken_checkpoints_raise(dist1, saved, tmp_path, damage, message):
    root = copy_of(saved, tmp_path)
    damage(root)
    with pytest.raises(CheckpointError, match=message):
        load_into_fresh(dist1, saved[1], root)


def test_missing_or_empty_dir(dist1, saved, tmp_path):
    assert latest_checkpoint(tmp_path / "nope") is None and latest_checkpoint(tmp_path) is None
    with pytest.raises(CheckpointError, match=r"nope does not exist"):
        load_into_fresh(dist1, saved[1], tmp_path / "nope")
    with pytest.raises(CheckpointError, match=r"no latest_checkpointed_iteration.txt .*no complete checkpoint"):
        load_into_fresh(dist1, saved[1], tmp_path)
