"""The tracker is never trusted alone: a tracker that is not what the writer writes, or one behind complete
checkpoints of later iterations, is refused by name in every loader (resume, --eval-only,
--pretrained-checkpoint, the Hugging Face converter, the inference server) before any model is built."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatron.rl.base.errors import UserError
from megatron.rl.training.checkpoint.paths import (TRACKER_FILENAME, CheckpointError, latest_checkpoint,
                                                   read_tracker, resolve_checkpoint_dir, write_tracker)

REPO_ROOT = Path(__file__).resolve().parents[5]
STALE = r"names iteration 1 but complete checkpoints of later iterations exist: \[2, 12\].*--load-newest-checkpoint"


def _save_dir(root: Path, iterations=(1, 2, 12), tracker: str = "1") -> Path:
    """A save directory whose iter_* directories hold the files that make a checkpoint complete."""
    root.mkdir(parents=True, exist_ok=True)
    for it in iterations:
        d = root / f"iter_{it:07d}"
        d.mkdir()
        for name in ("metadata.json", ".metadata", "common.pt"):
            (d / name).write_bytes(b"{}")
    (root / TRACKER_FILENAME).write_text(tracker)
    return root


def test_tracker_must_be_what_the_writer_writes(tmp_path):
    root = _save_dir(tmp_path / "c", iterations=(12,))
    for good, value in [("12", 12), ("12\n", 12), ("release\n", "release")]:
        (root / TRACKER_FILENAME).write_text(good)
        assert read_tracker(root) == value
    write_tracker(root, 12)
    assert read_tracker(root) == 12
    for bad in ["", " 12", "12 \n", "012", "12\n\n", "+12", "1_2", "12\r\n", "1e1"]:
        (root / TRACKER_FILENAME).write_text(bad)
        with pytest.raises(CheckpointError, match="corrupt tracker file"):
            read_tracker(root)


def test_tracker_behind_newer_complete_checkpoints_is_refused(tmp_path, caplog):
    root = _save_dir(tmp_path / "c")
    (root / "iter_0000013").mkdir()  # incomplete: not a reason to refuse, never a candidate
    for load in (latest_checkpoint, resolve_checkpoint_dir):
        with pytest.raises(CheckpointError, match=STALE):
            load(root)
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint_dir(root, newest=True) == root / "iter_0000012"
    assert "loading the newest, 12" in caplog.text
    (root / TRACKER_FILENAME).write_text("12")
    assert resolve_checkpoint_dir(root) == root / "iter_0000012"


def test_a_save_killed_before_its_tracker_update_loads_the_tracker(tmp_path, caplog):
    root = _save_dir(tmp_path / "c", iterations=(1,), tracker="1")
    old = (root / TRACKER_FILENAME).stat().st_mtime_ns
    os.utime(root / TRACKER_FILENAME, ns=(old - 10**9, old - 10**9))
    _save_dir(root, iterations=(2,), tracker="1")  # published, then killed: the tracker was not rewritten
    os.utime(root / TRACKER_FILENAME, ns=(old - 10**9, old - 10**9))
    with caplog.at_level(logging.WARNING):
        assert resolve_checkpoint_dir(root) == root / "iter_0000001"
    assert "save of iteration 2 was interrupted" in caplog.text
    (root / TRACKER_FILENAME).write_text("1")  # written after the save: damaged or edited, refused
    with pytest.raises(CheckpointError, match="names iteration 1 but complete checkpoints of later"):
        resolve_checkpoint_dir(root)


def _train_cfg(*extra: str):
    from megatron.rl.training.config import parse_args

    return parse_args(["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
                       "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "1",
                       "--train-iters", "1", *extra], world_size=1)


def test_resume_and_eval_only_refuse_a_stale_tracker(tmp_path):
    from megatron.rl.training.run import resolve_load_dir

    root = _save_dir(tmp_path / "c")
    cfg = _train_cfg("--load", str(root), "--save", str(root))
    for required in (True, False):  # training resume; --eval-only asks with required=False
        with pytest.raises(CheckpointError, match=STALE):
            resolve_load_dir(cfg, required=required)
    assert resolve_load_dir(_train_cfg("--load", str(root), "--load-newest-checkpoint")) == str(root)


def test_pretrained_checkpoint_refuses_a_stale_tracker(tmp_path):
    from megatron.rl.training.checkpoint.save_load import load_checkpoint

    root = _save_dir(tmp_path / "c")
    with pytest.raises(CheckpointError, match=STALE):  # what --pretrained-checkpoint (and every load) calls first
        load_checkpoint(root, [], load_optimizer=False, load_rng=False)
    from megatron.rl.training.checkpoint.args import merge_checkpoint_args
    from megatron.rl.training.config import build_parser

    with pytest.raises(UserError, match=STALE):  # --use-checkpoint-args reads the flags from it first
        merge_checkpoint_args(["--pretrained-checkpoint", str(root), "--use-checkpoint-args"], build_parser())


def test_hf_converter_refuses_a_stale_tracker(tmp_path):
    sys.path.insert(0, str(REPO_ROOT))
    from tools.checkpoint_conversion.megatron_to_hf import ConversionError, convert_megatron_to_hf

    root = _save_dir(tmp_path / "c")
    with pytest.raises(ConversionError, match=STALE):
        convert_megatron_to_hf(root, tmp_path / "hf")


@pytest.mark.parametrize("tracker, named", [("1", "later iterations exist: [2, 12]"), ("", "corrupt tracker file")])
def test_inference_server_reports_a_bad_tracker_in_one_line(tmp_path, tracker, named):
    root = _save_dir(tmp_path / "c", tracker=tracker)
    proc = subprocess.run([sys.executable, "-m", "megatron.rl.server.inference", "--backend", "megatron", "--",
                           "--load", str(root)], capture_output=True, text=True, timeout=300, cwd=REPO_ROOT,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT), "MEGATRON_RL_FORCE_CPU": "1"})
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and len([ln for ln in lines if ln.startswith("error:")]) == 1
    assert named in lines[-1] and lines[-1].startswith("error: --backend megatron: ")
