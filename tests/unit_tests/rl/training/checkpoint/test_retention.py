"""--save-retain-last / --save-retain-best: which checkpoints stay, that the one a run resumes from always stays,
and that a kill -9 in the middle of a deletion leaves a loadable set."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron.rl.base.errors import ConfigError
from megatron.rl.training.checkpoint import paths
from megatron.rl.training.checkpoint.retention import (RetentionPolicy, apply_retention, read_scores, record_score,
                                                       retained)
from tests.conftest import REPO_ROOT


def _policy(last=None, best=None):
    return RetentionPolicy.from_flags("save", last, best)


def test_retained_keeps_the_newest_the_best_and_the_tracked():
    its = [10, 20, 30, 40, 50]
    scores = {10: 0.2, 20: 0.9, 30: 0.5, 40: 0.1, 50: 0.3}
    assert retained(its, _policy(last=2), scores, 50) == {40, 50}
    assert retained(its, _policy(last=2, best=["eval/pass@1", "1"]), scores, 50) == {20, 40, 50}
    assert retained(its, _policy(best=["eval/pass@1", "2"]), scores, 50) == {20, 30, 50}  # + the latest
    assert retained(its, _policy(best=["min:loss", "1"]), scores, 50) == {40, 50}
    # the tracker names an older checkpoint (a run that will resume from it): it stays
    assert retained(its, _policy(last=1), scores, 30) == {30, 50}
    assert retained(its, _policy(last=1, best=["m", "1"]), {}, 50) == {50}  # nothing scored: newest only
    assert _policy() is None


@pytest.mark.parametrize("last, best, match", [(0, None, "--save-retain-last=0"),
                                               (None, ["eval/pass@1", "x"], "--save-retain-best eval/pass@1 x"),
                                               (None, ["eval/pass@1", "0"], "count >= 1")])
def test_bad_values_name_the_flag(last, best, match):
    with pytest.raises(ConfigError, match=match):
        _policy(last, best)
    with pytest.raises(ConfigError, match="pass --save DIR"):
        RetentionPolicy.from_flags(None, 2, None)


def _fake_checkpoints(root: Path, iterations, files_per_ckpt: int = 3) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for it in iterations:
        d = root / paths.checkpoint_dir_name(it)
        d.mkdir()
        for name in (*paths.REQUIRED_FILES, *(f"shard_{i}.distcp" for i in range(files_per_ckpt))):
            (d / name).write_text(name)
    paths.write_tracker(root, max(iterations))


def test_apply_retention_deletes_the_rest_and_forgets_their_scores(tmp_path):
    _fake_checkpoints(tmp_path, [1, 2, 3, 4])
    policy = _policy(last=1, best=["eval/pass@1", "1"])
    for it, value in ((1, 0.1), (2, 0.8), (3, 0.5), (4, float("nan"))):
        record_score(tmp_path, policy, it, {"eval/pass@1": value, "reward_mean": 0.0})
    assert read_scores(tmp_path) == {1: 0.1, 2: 0.8, 3: 0.5}  # NaN: no score
    assert apply_retention(tmp_path, policy) == [1, 3]
    assert paths.complete_iterations(tmp_path) == [2, 4] and not paths.partial_dirs(tmp_path)
    assert read_scores(tmp_path) == {2: 0.8}
    assert apply_retention(tmp_path, None) == [] and apply_retention(tmp_path, policy) == []


_KILL_SCRIPT = textwrap.dedent("""
    import os, shutil, signal, sys
    from pathlib import Path
    from megatron.rl.training.checkpoint.retention import RetentionPolicy, apply_retention

    def rmtree_then_die(path, ignore_errors=False):
        files = sorted(Path(path).iterdir())
        for f in files[: len(files) // 2]:  # half of the directory is gone when the kill lands
            f.unlink()
        os.kill(os.getpid(), signal.SIGKILL)

    shutil.rmtree = rmtree_then_die
    apply_retention(sys.argv[1], RetentionPolicy(keep_last=2))
""")


def test_kill_during_deletion_leaves_a_loadable_set(tmp_path):
    root = tmp_path / "save"
    _fake_checkpoints(root, [10, 20, 30, 40], files_per_ckpt=6)
    proc = subprocess.run([sys.executable, "-c", _KILL_SCRIPT, str(root)], cwd=REPO_ROOT, capture_output=True,
                          env={**os.environ, "PYTHONPATH": str(REPO_ROOT)}, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    # the first deletion was cut off half-way: the loader sees the tracked checkpoint, complete, and the half-deleted
    # one only as a leftover it never loads
    assert paths.resolve_checkpoint_dir(root) == root / "iter_0000040"
    assert paths.complete_iterations(root) == [20, 30, 40]
    [leftover] = paths.partial_dirs(root)
    assert leftover.name.startswith("iter_0000010" + paths.TRASH_INFIX)
    assert len(list(leftover.iterdir())) < len(paths.REQUIRED_FILES) + 6
    # the next retention pass finishes the job; the next save's clean-up removes the leftover
    assert apply_retention(root, RetentionPolicy(keep_last=2)) == [20]
    assert paths.remove_partial_dirs(root) == [leftover]
    assert sorted(p.name for p in root.iterdir()) == ["iter_0000030", "iter_0000040", paths.TRACKER_FILENAME]
    assert paths.read_tracker(root) == 40
