"""Acceptance test of the durable rollout bank: a real 1-process train_rl.py run with lag 1, partial
rollouts and the bank is SIGKILL-ed once the bank holds groups past its last checkpoint (some of them trained by
an update the kill then loses), and resumed to the end. Across both runs every group uid produced is trained
exactly once (or still waits in the bank at the end), none is generated twice, and no prompt is drawn twice.

The trainer writes each iteration's uids (``rollout_groups``: produced / consumed / restored) to the metrics
JSONL; what the killed iteration produced is read from the bank file the kill left behind.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron.rl.rollout.bank import bank_path, scan_records
from tests.conftest import REPO_ROOT

AGENTS = "tests.unit_tests.rl.rl_test_agents"
P, ITERS, SAVE_EVERY = 4, 8, 3
FLAGS = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "64",
         "--max-position-embeddings", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
         "--train-iters", str(ITERS), "--lr", "1e-3", "--lr-decay-style", "constant", "--seed", "11",
         "--grpo-prompts-per-step", str(P), "--grpo-group-size", "4", "--rl-max-new-tokens", "8",
         "--rl-use-sequence-packing", "--log-interval", "1", "--langrl-allow-imports", "--rl-prompts-per-eval", "0",
         "--rl-generation-lag", "1", "--rl-partial-rollouts", "--rl-submission-granularity", "G",
         "--rl-consumption-granularity", "G", "--rl-durable-rollout-bank", "--save-interval", str(SAVE_EVERY)]


def _cmd(tmp: Path) -> list[str]:
    env = tmp / "env.yaml"
    env.write_text(f'environments: [{{type: "{AGENTS}:HashReward", weight: 1}}]\n')
    ckpt = tmp / "ckpt"
    return [sys.executable, str(REPO_ROOT / "train_rl.py"), *FLAGS, "--langrl-env-config", str(env),
            "--rl-metrics-jsonl", str(tmp / "m.jsonl"), "--save", str(ckpt), "--load", str(ckpt)]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}


def _bank_records(tmp: Path) -> list[dict]:
    path = bank_path(tmp / "ckpt" / "rollout_bank", 0)
    return scan_records(path.read_bytes())[0] if path.exists() else []  # a torn tail is simply not counted


def _ready_to_kill(tmp: Path) -> bool:
    """A checkpoint exists, and after its compaction the bank has a consumption mark (trained, about to be
    lost) and a group completed after that mark."""
    if not (tmp / "ckpt" / "latest_checkpointed_iteration.txt").exists():
        return False
    recs = _bank_records(tmp)
    marks = [i for i, r in enumerate(recs) if r["kind"] == "checkpoint" and r["iteration"] > 0]
    if not marks:
        return False
    after = [r["kind"] for r in recs[marks[-1] + 1:]]
    return "consumed" in after and "group" in after[after.index("consumed"):]


def _ledgers(path: Path) -> dict[int, dict]:
    out = {}
    for line in path.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue  # torn by the kill
        if "rollout_groups" in rec:
            out[rec["iteration"]] = rec["rollout_groups"]
    return out


@pytest.mark.slow
def test_sigkill_during_collection_then_resume_trains_every_produced_group_once(tmp_path):
    cmd = _cmd(tmp_path)
    log1 = (tmp_path / "run1.log").open("w")
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=_env(), stdout=log1, stderr=subprocess.STDOUT,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        while not _ready_to_kill(tmp_path):
            assert proc.poll() is None, "run 1 ended before the kill:\n" + (tmp_path / "run1.log").read_text()[-4000:]
            assert time.monotonic() < deadline, "timed out waiting for groups past a checkpoint"
            time.sleep(0.002)
        os.killpg(proc.pid, signal.SIGKILL)  # the run and anything it started (this test started the session)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
        log1.close()
    assert proc.returncode == -signal.SIGKILL
    checkpoint = int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text())
    at_kill = _bank_records(tmp_path)
    ledgers1 = _ledgers(tmp_path / "m.jsonl")
    assert max(ledgers1, default=0) < ITERS, "run 1 finished before the kill"

    produced1 = {u: p for led in ledgers1.values() for u, p in led["produced"].items()}
    produced1.update({r["uid"]: r["group"]["problem_id"] for r in at_kill if r["kind"] == "group"})
    trained_by_ckpt = {u for r in at_kill if r["kind"] == "consumed" and r["iteration"] <= checkpoint
                       for u in r["uids"]}
    trained_by_ckpt |= {u for it, led in ledgers1.items() if it <= checkpoint for u in led["consumed"]}
    lost_training = [u for r in at_kill if r["kind"] == "consumed" and r["iteration"] > checkpoint
                     for u in r["uids"]]
    expected_restore = {r["uid"] for r in at_kill if r["kind"] == "group"} - trained_by_ckpt

    out = subprocess.run(cmd, cwd=REPO_ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, (out.stdout + out.stderr)[-6000:]
    ledgers = _ledgers(tmp_path / "m.jsonl")
    assert sorted(ledgers) == list(range(1, ITERS + 1))
    trained = [u for it in sorted(ledgers) for u in ledgers[it]["consumed"]]
    produced2 = {u: p for it, led in ledgers.items() if it > checkpoint for u, p in led["produced"].items()}
    restored = ledgers[checkpoint + 1]["restored"]
    end = _bank_records(tmp_path)
    left = {r["uid"] for r in end if r["kind"] == "group"}  # compacted at the final checkpoint: untrained only

    summary = (f"checkpoint {checkpoint}; produced {len(produced1)} before the kill + {len(produced2)} after; "
               f"trained {len(trained)} ({len(lost_training)} trained after the checkpoint and lost); restored "
               f"{len(restored)} from the bank; {len(left)} left in the bank at the end")
    print(summary)
    assert len(trained) == len(set(trained)) == ITERS * P, ("a group trained twice", summary)
    assert not set(produced1) & set(produced2), ("a group generated twice", summary)
    assert set(trained) | left == set(produced1) | set(produced2), ("a completed group lost", summary)
    assert not set(trained) & left, summary
    assert set(restored) == expected_restore and expected_restore, summary
    assert set(lost_training) <= set(restored) and lost_training, summary  # its training was lost, not the group
    assert set(restored) <= set(trained), summary
    problems = [*produced1.values(), *produced2.values()]
    assert len(problems) == len(set(problems)), ("a prompt drawn twice", summary)
    assert f"restored {len(restored)} completed group(s)" in out.stdout + out.stderr
