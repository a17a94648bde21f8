"""Durable rollout bank: record format (round trip, torn tail, mid-file corruption), atomic compaction, the resume
set (consumption marks past the checkpoint are not trained), and the bank under the pipeline with simulated
crashes: over random schedules every completed group is trained exactly once and no prompt is drawn twice."""
from __future__ import annotations

import dataclasses
import logging
import os
import random

import pytest
import torch

from megatron.rl.base.types import RolloutGroup, TokenRollout
from megatron.rl.rollout.bank import (MAGIC, BankSession, GroupRecord, RolloutBank, RolloutBankCorruptError,
                                      RolloutBankError, encode_record, resume_plan, scan_records)
from megatron.rl.rollout.pipeline import (AsyncRolloutConfig, FinishedGroup, GroupTicket, RolloutPipeline,
                                          SubmissionState)
from tests.unit_tests.rl.rollout.test_pipeline import FakeBackend

LAYOUT = {"groups_per_step": 2, "group_size": 2, "data_parallel_size": 1, "world_size": 1}


def _group(i: int) -> RolloutGroup:
    rollouts = [TokenRollout(prompt=f"p{i}", completion=f"c{i}{k}", reward=0.1 * k + 1 / 3, env_id="e",
                             problem_id=str(i), token_ids=[5, 6, 7 + k], generation_mask=[0, 1, 1], prompt_length=1,
                             logprobs=[0.0, -0.123456789012345, -1e-9 * (k + 1)],
                             metadata={"policy_versions": [-1, i, i + 1], "finish_reason": "stop"})
                for k in range(2)]
    return RolloutGroup(rollouts=rollouts, env_id="e", problem_id=str(i))


def _record(i: int, finished: int | None = None) -> GroupRecord:
    return GroupRecord(f"g{i}", i, i // 2, i // 2, i // 2 if finished is None else finished, _group(i),
                       {"drawn": i + 1})


# ----------------------------------------------------------------------------------------------- format


def test_round_trip_keeps_groups_exactly(tmp_path):
    bank = RolloutBank(tmp_path / "b.log")
    bank.compact(0, keep=[], agent_state=None, layout=LAYOUT)  # every bank file starts as a compaction
    for i in range(3):
        bank.append_group(_record(i))
    bank.mark_consumed(1, ["g0", "g1"])
    bank.close()
    again = RolloutBank(tmp_path / "b.log")
    assert again.groups() == [_record(i) for i in range(3)]  # pydantic equality: every float bit for bit
    assert type(again.groups()[0].group.rollouts[0]) is TokenRollout
    assert again.consumed() == {"g0", "g1"}
    assert [r["kind"] for r in again.records] == ["checkpoint"] + ["group"] * 3 + ["consumed"]


@pytest.mark.parametrize("cut", ["header", "half", "all_but_one", "zeros", "zero_tail"])
def test_a_torn_last_record_is_truncated_with_a_warning(tmp_path, caplog, cut):
    path = tmp_path / "b.log"
    bank = RolloutBank(path)
    bank.compact(0, keep=[], agent_state=None, layout=LAYOUT)  # every bank file starts as a compaction
    bank.append_group(_record(0))
    bank.mark_consumed(1, ["g0"])
    bank.close()
    intact = path.read_bytes()
    tail = encode_record(_record(1).to_json())
    torn = {"header": tail[:6], "half": tail[: len(tail) // 2], "all_but_one": tail[:-1],
            "zeros": b"\0" * 100, "zero_tail": tail[:-8] + b"\0" * 8}[cut]
    path.write_bytes(intact + torn)
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.bank"):
        bank = RolloutBank(path)
    assert "torn last record" in caplog.text
    assert path.read_bytes() == intact
    assert [g.uid for g in bank.groups()] == ["g0"] and bank.consumed() == {"g0"}
    bank.append_group(_record(2))  # appending goes on after the truncated tail
    bank.close()
    assert [g.uid for g in RolloutBank(path).groups()] == ["g0", "g2"]


@pytest.mark.parametrize("where", ["payload_bit", "crc_bit", "magic"])
def test_a_complete_last_record_with_a_bad_checksum_is_named_corruption(tmp_path, caplog, where):
    """A flipped bit in a whole, synced last record is damage after the write, not a torn write."""
    path = tmp_path / "b.log"
    bank = RolloutBank(path)
    bank.compact(0, keep=[], agent_state=None, layout=LAYOUT)
    bank.append_group(_record(0))
    bank.close()
    data = bytearray(path.read_bytes())
    last = data.rfind(MAGIC)
    pos = {"payload_bit": len(data) - 30, "crc_bit": last + 9, "magic": last}[where]
    data[pos] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(RolloutBankCorruptError, match=f"the last record \\(byte {last} to {len(data)}\\) is "
                                                      "complete but .*not torn by a crash"):
        RolloutBank(path)
    assert "torn" not in caplog.text and path.read_bytes() == bytes(data)  # nothing truncated


@pytest.mark.parametrize("where", ["payload", "length", "magic"])
def test_damage_before_an_intact_record_is_a_named_corruption_error(tmp_path, where):
    path = tmp_path / "b.log"
    bank = RolloutBank(path)
    for i in range(3):
        bank.append_group(_record(i))
    bank.close()
    data = bytearray(path.read_bytes())
    second = data.find(MAGIC, 1)
    pos = {"payload": second + 40, "length": second + 6, "magic": second + 1}[where]
    data[pos] ^= 0x55
    path.write_bytes(bytes(data))
    with pytest.raises(RolloutBankCorruptError, match=f"record at byte {second} is damaged but an intact record"):
        RolloutBank(path)
    assert path.read_bytes() == bytes(data)  # nothing truncated on a corruption error


def test_scan_of_an_empty_file_and_of_garbage():
    assert scan_records(b"") == ([], 0)
    with pytest.raises(RolloutBankCorruptError, match="byte 0 of 17 is damaged and no intact checkpoint record"):
        scan_records(b"not a bank at all")  # no record of a compaction: not a file a crash left


def _compacted(path, appended=0):
    """A bank file as a run leaves it: compacted (groups g0, g1 and the checkpoint record), then ``appended``
    groups written through."""
    bank = RolloutBank(path)
    for i in range(2):
        bank.append_group(_record(i))
    bank.compact(1, keep=["g0", "g1"], agent_state={"drawn": 2}, layout=LAYOUT)
    for i in range(2, 2 + appended):
        bank.append_group(_record(i))
    bank.close()
    return bytearray(path.read_bytes())


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "zeroed", "cut_after_the_groups"])
def test_damage_to_what_compaction_wrote_is_corruption_not_a_torn_tail(tmp_path, damage):
    """Compaction's atomic rename writes the file whole: damage to its last record is not a crash mid-write."""
    path = tmp_path / "b.log"
    data = _compacted(path)
    last = data.rfind(MAGIC)  # the checkpoint record
    if damage == "flipped_byte":
        data[last + 20] ^= 0x01
    elif damage == "truncated":
        data = data[:-7]
    elif damage == "zeroed":
        data = bytearray(len(data))
    else:
        data = data[:last]
    path.write_bytes(bytes(data))
    with pytest.raises(RolloutBankCorruptError, match="and no intact checkpoint record comes before it"):
        RolloutBank(path)
    assert path.read_bytes() == bytes(data)  # nothing truncated on a corruption error
    # the same damage to a record appended after the compaction is a torn tail
    path.unlink()
    data = _compacted(path, appended=1)
    path.write_bytes(bytes(data[:-7]))
    assert [g.uid for g in RolloutBank(path).groups()] == ["g0", "g1"]


def _disk_fills_after(monkeypatch, room: int):
    """os.write writes at most ``room`` more bytes in all, then fails as a full disk does (ENOSPC)."""
    import errno

    real = os.write
    left = [room]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data[:left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)


def test_a_full_disk_is_a_named_error_and_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = tmp_path / "b.log"
    before = bytes(_compacted(path, appended=1))
    bank = RolloutBank(path)
    _disk_fills_after(monkeypatch, 50)  # half a record goes to disk, then the disk is full
    with pytest.raises(RolloutBankError, match=r"the disk is full .* while appending a group record; the file is as"):
        bank.append_group(_record(3))
    assert path.read_bytes() == before  # the half record was cut off again
    _disk_fills_after(monkeypatch, 50)
    with pytest.raises(RolloutBankError, match="the disk is full .* while compacting it"):
        bank.compact(2, keep=["g2"], agent_state=None, layout=LAYOUT)
    assert path.read_bytes() == before and sorted(os.listdir(tmp_path)) == ["b.log"]  # no .tmp debris
    monkeypatch.undo()
    bank.append_group(_record(3))  # space again: the bank goes on where it was
    bank.close()
    assert [g.uid for g in RolloutBank(path).groups()] == ["g0", "g1", "g2", "g3"]


# ----------------------------------------------------------------------------------------------- compaction


def test_compaction_keeps_exactly_the_unconsumed_groups_and_closes_with_a_checkpoint_record(tmp_path):
    path = tmp_path / "b.log"
    bank = RolloutBank(path)
    for i in range(6):
        bank.append_group(_record(i))
    bank.mark_consumed(1, ["g0", "g1"])
    bank.mark_consumed(2, ["g2", "g3"])
    bank.compact(2, keep=["g4", "g5"], agent_state={"drawn": 6}, layout=LAYOUT)
    for b in (bank, RolloutBank(path)):
        assert [g.uid for g in b.groups()] == ["g4", "g5"] and b.consumed() == set()
        assert b.records[-1] == {"kind": "checkpoint", "iteration": 2, "agent_state": {"drawn": 6},
                                 "layout": LAYOUT, "attempt": 0, "submission": None}
    assert sorted(os.listdir(tmp_path)) == ["b.log"]  # the temporary file was renamed over it


def test_compaction_is_atomic_a_crash_before_the_rename_leaves_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "b.log"
    bank = RolloutBank(path)
    bank.compact(0, keep=[], agent_state=None, layout=LAYOUT)
    for i in range(4):
        bank.append_group(_record(i))
    bank.mark_consumed(1, ["g0", "g1"])
    before = path.read_bytes()

    def crash(*a, **k):
        raise OSError("killed before the rename")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(OSError, match="killed"):
        bank.compact(1, keep=["g2", "g3"], agent_state=None, layout=LAYOUT)
    monkeypatch.undo()
    assert path.read_bytes() == before
    assert [g.uid for g in RolloutBank(path).groups()] == ["g0", "g1", "g2", "g3"]


# ----------------------------------------------------------------------------------------------- resume set


def _records(*items) -> list[dict]:
    out = []
    for it in items:
        if isinstance(it, int):
            out.append(_record(it).to_json())
        else:
            out.append(it)
    return out


def _consumed(iteration, *uids):
    return {"kind": "consumed", "iteration": iteration, "uids": list(uids)}


def _ckpt(iteration, drawn):
    return {"kind": "checkpoint", "iteration": iteration, "agent_state": {"drawn": drawn}, "layout": LAYOUT}


def test_marks_after_the_checkpoint_are_not_trained_and_those_groups_are_restored():
    # compacted at checkpoint 1 (g2, g3 generated ahead), then iterations 2 and 3 trained and groups up to g7
    # completed; killed before checkpoint 2: the training of 2 and 3 was lost with the weights.
    recs = _records(2, 3, _ckpt(1, 4), 4, 5, _consumed(2, "g2", "g3"), 6, _consumed(3, "g4", "g5"), 7)
    plan = resume_plan(recs, 1)
    assert plan.trained == set()
    assert [g.uid for g in plan.restore] == ["g2", "g3", "g4", "g5", "g6", "g7"]
    assert plan.agent_state == {"drawn": 8}  # the newest record: past g7's prompt
    assert not plan.discarded
    # the same file when checkpoint 3 was published and the kill came before its compaction: 2 and 3 trained
    plan = resume_plan(recs, 3)
    assert plan.trained == {"g2", "g3", "g4", "g5"} and [g.uid for g in plan.restore] == ["g6", "g7"]
    assert plan.agent_state is None  # every record predates checkpoint 3: its own agent state is the newest


def test_resume_agent_state_rules():
    # nothing completed after checkpoint 2's own compaction: that record's state
    plan = resume_plan(_records(4, 5, _ckpt(2, 6)), 2)
    assert [g.uid for g in plan.restore] == ["g4", "g5"] and plan.agent_state == {"drawn": 6}
    # crashed after checkpoint 3 was published but before its compaction: every record is older than the
    # checkpoint, whose own agent state wins (None); the marks up to 3 are trained
    plan = resume_plan(_records(_ckpt(2, 6), 4, 5, _consumed(3, "g4", "g5"), 6), 3)
    assert plan.agent_state is None and [g.uid for g in plan.restore] == ["g6"]
    # a fresh bank (crash before the first checkpoint): everything completed is restored
    plan = resume_plan(_records(0, 1, _consumed(1, "g0", "g1"), 2), 0)
    assert [g.uid for g in plan.restore] == ["g0", "g1", "g2"] and plan.agent_state == {"drawn": 3}
    # compacted at 3 but checkpoint 2 is loaded: the groups trained at 3 are gone, so the bank is dropped
    plan = resume_plan(_records(6, 7, _ckpt(3, 8)), 2)
    assert plan.discarded and plan.restore == [] and "compacted at iteration 3" in plan.note


class Agent:
    def __init__(self, drawn: int = 0):
        self.drawn = drawn

    def state_dict(self):
        return {"drawn": self.drawn}

    def load_state_dict(self, s):
        self.drawn = s["drawn"]


def test_session_start_compacts_restores_and_checks_the_layout(tmp_path, caplog):
    path = tmp_path / "b.log"
    s = BankSession(RolloutBank(path), Agent(), LAYOUT)
    assert s.start(0, resuming=False) == ([], {"next_index": 0, "resubmit": [], "skip": []})
    for i in range(4):
        s.agent.drawn = i + 1
        s.completed(f"g{i}", i, i // 2, i // 2, i // 2, _group(i))
    s.consumed(1, ["g0", "g1"])
    s.checkpoint_saved(1, {"next_index": 4, "resubmit": [], "skip": []})
    s.consumed(2, ["g2", "g3"])  # trained, then killed before checkpoint 2
    s.close()
    agent = Agent(drawn=2)  # checkpoint 1's agent state
    s2 = BankSession(RolloutBank(path), agent, LAYOUT)
    restored, sub = s2.start(1, resuming=True)
    assert [g.uid for g in restored] == ["g2", "g3"] and sub == {"next_index": 4, "resubmit": [], "skip": []}
    assert agent.drawn == 4
    assert s2.ledger()["restored"] == ["g2", "g3"]
    s2.close()
    with pytest.raises(RolloutBankError, match="was written with .* but this run has"):
        BankSession(RolloutBank(path), Agent(), {**LAYOUT, "group_size": 4}).start(1, resuming=True)
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.bank"):
        assert BankSession(RolloutBank(path), Agent(), LAYOUT).start(0, resuming=False)[0] == []
    assert "does not resume" in caplog.text and RolloutBank(path).groups() == []


def _session_saved_with_two_untrained(path):
    """A session that saved checkpoint 1 with g2, g3 completed but untrained; returns what the checkpoint records."""
    s = BankSession(RolloutBank(path), Agent(), LAYOUT)
    s.start(0, resuming=False)
    for i in range(4):
        s.completed(f"g{i}", i, i // 2, i // 2, i // 2, _group(i))
    s.consumed(1, ["g0", "g1"])
    recorded = s.durable_groups()
    s.checkpoint_saved(1, {"next_index": 4, "resubmit": [], "skip": []})
    s.close()
    return recorded


@pytest.mark.parametrize("damage", ["emptied", "deleted", "cut"])
def test_a_bank_with_fewer_groups_than_the_checkpoint_recorded_says_so(tmp_path, caplog, damage):
    path = tmp_path / "b.log"
    recorded = _session_saved_with_two_untrained(path)
    assert recorded == 2
    if damage == "emptied":
        path.write_bytes(b"")
    elif damage == "deleted":
        path.unlink()
    else:  # the first group record cut away, as a truncation to a compacted file's second record would leave it
        records = [r for r in RolloutBank(path).records if r.get("uid") != "g2"]
        path.write_bytes(b"".join(encode_record(r) for r in records))
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.bank"):
        restored, _ = BankSession(RolloutBank(path), Agent(), LAYOUT).start(1, resuming=True, recorded=recorded)
    found = 1 if damage == "cut" else 0
    assert len(restored) == found
    lines = [r.getMessage() for r in caplog.records if "checkpoint 1 recorded" in r.getMessage()]
    assert len(lines) == 1 and f"{found} durable group(s) found but checkpoint 1 recorded 2: {2 - found} " in lines[0]


def test_an_intact_bank_resumes_without_a_loss_report(tmp_path, caplog):
    path = tmp_path / "b.log"
    recorded = _session_saved_with_two_untrained(path)
    with caplog.at_level(logging.WARNING, logger="megatron.rl.rollout.bank"):
        restored, _ = BankSession(RolloutBank(path), Agent(), LAYOUT).start(1, resuming=True, recorded=recorded)
    assert [g.uid for g in restored] == ["g2", "g3"] and "recorded" not in caplog.text


def test_a_non_empty_bank_with_the_bank_off_is_an_error_naming_the_flag(tmp_path):
    from megatron.rl.base.errors import ConfigError
    from megatron.rl.rollout.async_source import check_bank_left_unused

    save = tmp_path / "save"
    _session_saved_with_two_untrained(save / "rollout_bank" / "bank-rank0.log")
    off, on = AsyncRolloutConfig(), AsyncRolloutConfig(durable_rollout_bank=True)
    with pytest.raises(ConfigError, match=r"holds 2 completed, untrained group\(s\).*--rl-durable-rollout-bank is off"):
        check_bank_left_unused(off, str(save), resuming=True)
    check_bank_left_unused(on, str(save), resuming=True)  # the bank restores them
    check_bank_left_unused(off, str(save), resuming=False)  # a new run: nothing of it to lose
    (save / "rollout_bank" / "bank-rank0.log").write_bytes(b"")
    check_bank_left_unused(off, str(save), resuming=True)  # an empty bank loses nothing


# ----------------------------------------------------------------------------------------------- under the pipeline


class Crash(Exception):
    pass


class Run:
    """One attempt of a run: pipeline + bank + fake agent (``backend.drawn`` is the prompt position), crashing
    once ``crash_after`` groups completed (right after the last one was made durable)."""

    def __init__(self, path, cfg, P, rng, start: int, agent_state: dict | None, resuming: bool, crash_after=None):
        self.backend = FakeBackend(rng, group_size=1, max_tokens=rng.randint(1, 6), max_turns_per_token=2)
        if agent_state:
            self.backend.drawn = agent_state["drawn"]
        self.bank = BankSession(RolloutBank(path), self, {**LAYOUT, "groups_per_step": P})
        self.start_draw = None
        self.produced: dict[str, str] = {}
        self.crash_after = crash_after
        groups, sub = self.bank.start(start, resuming)
        restored = [FinishedGroup(GroupTicket(g.index, g.batch, g.submitted, g.attempt), g.group, g.finished, 0)
                    for g in groups]
        self.restored = [f.ticket.uid for f in restored]
        self.first_draw = self.backend.drawn

        def on_finished(f):
            self.bank.completed(f.ticket.uid, f.ticket.index, f.ticket.batch, f.ticket.version, f.finished_version,
                                f.group, f.ticket.attempt)
            self.produced[f.ticket.uid] = f.group.problem_id
            if self.crash_after is not None and len(self.produced) >= self.crash_after:
                raise Crash()

        async def produce(batch, n):  # validated groups (the fake's are model_construct-ed, without type names)
            return [RolloutGroup(rollouts=[TokenRollout(**r.model_dump(exclude={"type_name"})) for r in g.rollouts],
                                 env_id=g.env_id, problem_id=g.problem_id)
                    for g in await self.backend.produce(batch, n)]

        self.pipe = RolloutPipeline(produce, AsyncRolloutConfig(**cfg), groups_per_step=P,
                                    group_size=1, start_version=start, restored=restored, on_finished=on_finished,
                                    attempt=self.bank.attempt,
                                    submission=SubmissionState(sub["next_index"], tuple(sub["resubmit"]),
                                                               tuple(sub["skip"])))
        self.backend.pipeline = self.pipe

    # the "agent" whose state the bank snapshots
    def state_dict(self):
        return {"drawn": self.backend.drawn}

    def load_state_dict(self, s):
        self.backend.drawn = s["drawn"]


def test_crash_and_resume_trains_every_completed_group_once_over_random_schedules(tmp_path):
    """Up to three attempts per schedule, each killed after a random number of completions (a kill can also come
    before the first checkpoint, or right after a resume), then one that runs to the end."""
    from tests.unit_tests.rl.rollout.test_pipeline import _random_config

    restored_total = crashes_total = 0
    for seed in range(100):
        rng = random.Random(seed)
        cfg, P = _random_config(rng)
        path = tmp_path / f"bank{seed}.log"
        total, save_every = rng.randint(3, 6), rng.randint(1, 2)
        checkpoint, ckpt_agent = 0, None
        trained: dict[int, list[str]] = {}  # iteration -> uids, as the surviving lineage saw it
        produced: dict[str, str] = {}
        for attempt in range(4):
            crash_after = rng.randint(1, (total + 2) * P) if attempt < 3 else None
            run = Run(path, cfg, P, rng, checkpoint, ckpt_agent, resuming=attempt > 0, crash_after=crash_after)
            ctx = (seed, attempt, cfg, P, checkpoint)
            expected = set(produced) - {u for it in trained if it <= checkpoint for u in trained[it]}
            assert set(run.restored) == expected, ("restored", ctx)
            restored_total += len(run.restored)
            trained = {it: u for it, u in trained.items() if it <= checkpoint}  # the rest was lost
            crashed = False
            for v in range(checkpoint, total):
                try:
                    got = run.pipe.next_batch()
                except Crash:
                    crashed = True
                    break
                assert all(v - f.ticket.version <= cfg["generation_lag"] for f in got), ("lag bound", ctx)
                uids = [f.ticket.uid for f in got]
                run.bank.consumed(v + 1, uids)
                trained[v + 1] = uids
                run.pipe.advance()
                if (v + 1) % save_every == 0 or v + 1 == total:
                    checkpoint, ckpt_agent = v + 1, run.state_dict()
                    run.bank.checkpoint_saved(v + 1, dataclasses.asdict(run.pipe.submission_state()))
            run.pipe.close()
            assert not set(run.produced) & set(produced), ("a restored group was generated again", ctx)
            produced.update(run.produced)
            if not crashed:
                break
            crashes_total += 1
            run.bank.close()
        left = {g.uid for g in run.bank.bank.groups()} - run.bank.bank.consumed()
        run.bank.close()
        kept = [u for it in sorted(trained) for u in trained[it]]
        assert sorted(trained) == list(range(1, total + 1)), ctx
        assert len(kept) == len(set(kept)) == total * P, ("trained twice or missing", ctx)
        assert set(kept) | left == set(produced), ("a completed group was lost", ctx)
        assert not set(kept) & left, ctx
        assert len(set(produced.values())) == len(produced), ("a prompt was drawn twice", ctx)
    assert restored_total > 100 and crashes_total > 100  # the schedules did crash and restore


def test_routes_survive_the_bank_and_a_resumed_run_packs_the_same_routes(tmp_path):
    """MoE routing replay after a crash: a restored group's rollouts carry their routes bit for bit, so the resumed
    run's trainer replays exactly what the lost run would have."""
    import numpy as np

    from megatron.rl.base.routes import Routes
    from megatron.rl.rollout.sequences import groups_to_sequences
    from megatron.rl.sequence_packing_utils import build_packed_batch, plan_packing

    rng = np.random.default_rng(0)
    group = _group(0)
    for r in group.rollouts:  # [layers, tokens, k], -1 for the last token
        r.routes = Routes.from_tensor(np.concatenate([rng.integers(0, 300, (4, 2, 2)), -np.ones((4, 1, 2), int)], 1),
                                      num_experts=300)
    s = BankSession(RolloutBank(tmp_path / "b.log"), Agent(), LAYOUT)
    s.start(0, resuming=False)
    s.completed("g0", 0, 0, 0, 0, group)
    s.close()  # killed before the group was consumed
    restored, _ = BankSession(RolloutBank(tmp_path / "b.log"), Agent(), LAYOUT).start(0, resuming=True)
    assert [g.uid for g in restored] == ["g0"]
    assert [r.routes for r in restored[0].group.rollouts] == [r.routes for r in group.rollouts]

    def packed(groups):
        seqs = groups_to_sequences(groups)
        info = plan_packing([len(q.token_ids) for q in seqs], 8, 4)
        return build_packed_batch(info, list(range(info.num_bins)), [q.token_ids for q in seqs],
                                  [q.loss_mask for q in seqs], 0,
                                  token_aligned={"routes": [q.routes for q in seqs]}).token_values["routes"]

    assert torch.equal(packed([restored[0].group]), packed([group]))
