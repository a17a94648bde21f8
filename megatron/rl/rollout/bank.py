"""Durable rollout bank: completed rollout groups survive a crash (``--rl-durable-rollout-bank``).

:class:`RolloutBank` appends every completed group of the asynchronous pipeline to a per-rank, checksummed,
fsync-ed log, marks the groups each iteration consumed, and on resume hands back the groups the loaded weights
never trained on, with the prompt positions and submission indices to continue from. It never guesses: a torn
last record is cut off, any other damage is :class:`RolloutBankCorruptError`. It does not generate or train.
The disk format and the resume rules: docs/rollouts.md.
"""
from __future__ import annotations

import dataclasses
import errno
import json
import logging
import os
import struct
import zlib
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron.rl.base.types import RolloutGroup
from megatron.rl.base.errors import RLError

log = logging.getLogger(__name__)

__all__ = ["RolloutBank", "BankSession", "RolloutBankError", "RolloutBankCorruptError", "GroupRecord", "ResumePlan",
           "encode_record", "scan_records", "resume_plan", "bank_path"]

MAGIC = b"RBK1"
_HEADER = struct.Struct("<4sII")  # magic, payload length, crc32(payload)
_MAX_PAYLOAD = 1 << 31


class RolloutBankError(RLError, RuntimeError):
    """The rollout bank cannot be used as it is (a layout mismatch, an unreadable directory, ...)."""


class RolloutBankCorruptError(RolloutBankError):
    """A bank file is damaged where a crash cannot have torn it (see the module docstring)."""


def bank_path(directory: str | os.PathLike, rank: int) -> Path:
    return Path(directory) / f"bank-rank{rank}.log"


# --------------------------------------------------------------------------- records


@dataclasses.dataclass(frozen=True)
class GroupRecord:
    """A completed group as the bank stores it (see the module docstring)."""

    uid: str
    index: int
    batch: int
    submitted: int
    finished: int
    group: RolloutGroup
    agent_state: dict | None = None
    attempt: int = 0

    def to_json(self) -> dict:
        return {"kind": "group", "uid": self.uid, "index": self.index, "batch": self.batch, "attempt": self.attempt,
                "submitted": self.submitted, "finished": self.finished, "agent_state": self.agent_state,
                "group": self.group.model_dump(mode="json")}

    @classmethod
    def from_json(cls, d: dict) -> "GroupRecord":
        return cls(uid=str(d["uid"]), index=int(d["index"]), batch=int(d["batch"]), submitted=int(d["submitted"]),
                   finished=int(d["finished"]), group=RolloutGroup.model_validate(d["group"]),
                   agent_state=d.get("agent_state"), attempt=int(d.get("attempt", 0)))


def encode_record(payload: dict) -> bytes:
    """One record: magic, length, crc32, JSON payload."""
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False).encode("utf-8")
    if len(data) >= _MAX_PAYLOAD:
        raise RolloutBankError(f"rollout bank record of {len(data)} bytes is too large")
    return _HEADER.pack(MAGIC, len(data), zlib.crc32(data)) + data


def _record_at(data: bytes, offset: int) -> tuple[dict, int] | None:
    """The record starting at ``offset`` and the offset after it, or None if none starts there intact."""
    if offset + _HEADER.size > len(data):
        return None
    magic, length, crc = _HEADER.unpack_from(data, offset)
    start, end = offset + _HEADER.size, offset + _HEADER.size + length
    if magic != MAGIC or end > len(data):
        return None
    body = data[start:end]
    if zlib.crc32(body) != crc:
        return None
    try:
        payload = json.loads(body)
    except ValueError:
        return None
    return (payload, end) if isinstance(payload, dict) and "kind" in payload else None


def scan_records(data: bytes, name: str = "rollout bank") -> tuple[list[dict], int]:
    """Parse a bank file's bytes: (records, length of the intact prefix).

    A damaged record after an intact ``"checkpoint"`` record and with no intact record after it is a torn tail
    (the prefix ends before it) when it is short or ends in zero bytes; one of its full length is corruption. Any other damage raises :class:`RolloutBankCorruptError` naming ``name`` and the
    offset: an intact record after it, or no ``"checkpoint"`` record before it (compaction wrote those bytes, and
    its atomic rename cannot tear them).
    """
    records: list[dict] = []
    offset = 0
    while offset < len(data):
        parsed = _record_at(data, offset)
        if parsed is None:
            later = data.find(MAGIC, offset + 1)
            while later != -1:
                if _record_at(data, later) is not None:
                    raise RolloutBankCorruptError(
                        f"{name}: the record at byte {offset} is damaged but an intact record follows at byte "
                        f"{later}; this is not a torn write from a crash. {_START_AFRESH}")
                later = data.find(MAGIC, later + 1)
            break
        records.append(parsed[0])
        offset = parsed[1]
    if data and not any(r["kind"] == "checkpoint" for r in records):
        where = (f"the record at byte {offset} of {len(data)} is damaged" if offset < len(data) else
                 f"the file ends at byte {len(data)}")
        raise RolloutBankCorruptError(
            f"{name}: {where} and no intact checkpoint record comes before it, so compaction wrote it (an atomic "
            f"rename: a crash cannot have torn or cut it). {_START_AFRESH}")
    if offset < len(data):
        _check_torn(data, offset, name)
    return records, offset


def _check_torn(data: bytes, offset: int, name: str) -> None:
    """Raise :class:`RolloutBankCorruptError` unless the damaged last record at ``offset`` is what a crash
    mid-write leaves: fewer bytes than its header declares (or a short header), or a tail of zero bytes (a file
    extended before its data reached the disk). A record of its full length that fails its checksum was written
    whole and synced; its bytes changed afterwards."""
    if offset + _HEADER.size > len(data) or data.endswith(b"\0"):
        return
    magic, length, _ = _HEADER.unpack_from(data, offset)
    if magic == MAGIC and offset + _HEADER.size + length > len(data):
        return
    what = "fails its checksum" if magic == MAGIC else "has no record header"
    raise RolloutBankCorruptError(
        f"{name}: the last record (byte {offset} to {len(data)}) is complete but {what}: the file was damaged "
        f"after it was written, not torn by a crash. {_START_AFRESH}")


_START_AFRESH = "Move the file away to start the bank afresh (its groups are then regenerated)."


# --------------------------------------------------------------------------- resume


@dataclasses.dataclass(frozen=True)
class ResumePlan:
    """What a run resumed from checkpoint ``iteration`` takes from the bank.

    restore: the completed, untrained groups, by submission index. trained: uids consumed at iterations
    ``<= iteration``. agent_state: the agents' state to load (None: keep the checkpoint's). submission: where the
    resumed pipeline submits (``next_index``, ``resubmit``, ``skip``: see
    :class:`~megatron.rl.rollout.pipeline.SubmissionState`), None for the default (the checkpoint's first batch).
    discarded: the bank did not match the checkpoint and was dropped (reason in ``note``).
    """

    iteration: int
    restore: list[GroupRecord]
    trained: frozenset[str]
    agent_state: dict | None
    submission: dict | None = None
    discarded: bool = False
    note: str = ""


def resume_plan(records: Sequence[dict], iteration: int) -> ResumePlan:
    """Pure: the groups to restore when resuming from checkpoint ``iteration`` (see the module docstring)."""
    marks = [i for i, r in enumerate(records) if r["kind"] == "checkpoint"]
    last_mark = records[marks[-1]] if marks else None
    if last_mark is not None and int(last_mark["iteration"]) > iteration:
        return ResumePlan(iteration, [], frozenset(), None, discarded=True,
                          note=f"the bank was compacted at iteration {last_mark['iteration']}, after the loaded "
                               f"checkpoint {iteration}: the groups consumed in between are gone")
    trained: set[str] = set()
    groups: dict[str, GroupRecord] = {}
    for r in records:
        if r["kind"] == "consumed" and int(r["iteration"]) <= iteration:
            trained.update(r["uids"])
        elif r["kind"] == "group":
            groups[r["uid"]] = GroupRecord.from_json(r)  # a uid written again (never expected): the later one
    restore = sorted((g for uid, g in groups.items() if uid not in trained), key=lambda g: g.index)
    agent_state = None
    start = marks[-1] if marks else -1
    if last_mark is None or int(last_mark["iteration"]) == iteration:
        # Records after the checkpoint's own compaction are later than the checkpoint: the newest wins.
        after = [r for r in records[start + 1:] if r["kind"] == "group"]
        if after:
            agent_state = after[-1].get("agent_state")
        elif last_mark is not None:
            agent_state = last_mark.get("agent_state")
    # else: compacted at an earlier checkpoint and the crash came before this checkpoint's compaction: every
    # record predates the checkpoint, whose own agent state is the newest.
    submission = None
    if last_mark is not None and last_mark.get("submission") is not None:
        # Indices in flight at the compaction come back unless they completed since; an index completed since
        # (restored or trained) is never submitted again.
        sub, done = last_mark["submission"], {g.index for g in groups.values()}
        nxt = int(sub["next_index"])
        submission = {"next_index": nxt, "resubmit": sorted(set(sub["resubmit"]) - done),
                      "skip": sorted(i for i in set(sub["skip"]) | done if i >= nxt)}
    return ResumePlan(iteration, restore, frozenset(trained), agent_state, submission)


# --------------------------------------------------------------------------- the file


def _write_error(path: Path, what: str, e: OSError) -> RolloutBankError:
    """The error of a failed write, saying so when the disk is full."""
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return RolloutBankError(f"rollout bank {path}: the disk is full ({os.strerror(e.errno)}) while {what}; the "
                                f"file is as before. Free space in {path.parent} or point --rl-rollout-bank-dir "
                                f"at another disk")
    return RolloutBankError(f"rollout bank {path}: {what} failed: {e}; the file is as before")


def _write_all(fd: int, blob: bytes) -> None:
    view = memoryview(blob)
    while view:
        view = view[os.write(fd, view):]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class RolloutBank:
    """One rank's bank file: open (truncating a torn tail), append groups and consumption marks, compact.

    Args:
        path: the file (see :func:`bank_path`); its directory is created.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            data = self.path.read_bytes() if self.path.exists() else b""
        except OSError as e:
            raise RolloutBankError(f"rollout bank {self.path}: {e} (check --rl-rollout-bank-dir)") from e
        self.records, intact = scan_records(data, str(self.path))
        if intact < len(data):
            log.warning("rollout bank %s: dropped a torn last record (%d of %d bytes intact; a crash mid-write: "
                        "that group was not durable and is regenerated)", self.path, intact, len(data))
            with open(self.path, "r+b") as f:
                f.truncate(intact)
                f.flush()
                os.fsync(f.fileno())
        self._fd: int | None = None

    # ------------------------------------------------------------------ reading

    def groups(self) -> list[GroupRecord]:
        return [GroupRecord.from_json(r) for r in self.records if r["kind"] == "group"]

    def consumed(self) -> set[str]:
        return {u for r in self.records if r["kind"] == "consumed" for u in r["uids"]}

    def _last_mark(self) -> dict:
        marks = [r for r in self.records if r["kind"] == "checkpoint"]
        return marks[-1] if marks else {}

    def layout(self) -> dict | None:
        return self._last_mark().get("layout")

    def attempt(self) -> int:
        """The attempt (run start) that last compacted this file; -1 for a new file."""
        return int(self._last_mark().get("attempt", -1))

    # ------------------------------------------------------------------ writing

    def _append(self, payload: dict) -> None:
        blob = encode_record(payload)
        if self._fd is None:
            created = not self.path.exists()
            try:
                self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
                if created:
                    _fsync_dir(self.path.parent)
            except OSError as e:
                raise _write_error(self.path, "opening it for appending", e) from e
        size = os.fstat(self._fd).st_size
        try:
            _write_all(self._fd, blob)
            os.fsync(self._fd)
        except OSError as e:
            try:  # cut a partly written record off again: a later record must not follow damage
                os.ftruncate(self._fd, size)
                os.fsync(self._fd)
            except OSError:
                self.close()  # the torn tail stays; it is truncated away on the next open
            raise _write_error(self.path, f"appending a {payload['kind']} record", e) from e
        self.records.append(payload)

    def append_group(self, record: GroupRecord) -> None:
        """Write-through: on disk (fsync-ed) when this returns."""
        self._append(record.to_json())

    def mark_consumed(self, iteration: int, uids: Iterable[str]) -> None:
        """The groups ``uids`` feed the update of ``iteration`` (1-based, see the module docstring)."""
        self._append({"kind": "consumed", "iteration": int(iteration), "uids": list(uids)})

    def compact(self, iteration: int, keep: Iterable[str], agent_state: dict | None, layout: dict,
                attempt: int = 0, submission: dict | None = None) -> None:
        """Atomically rewrite the file as: the groups in ``keep``, then a checkpoint record for ``iteration``
        (last, so that whatever is appended later is known to be newer than it)."""
        keep = set(keep)
        kept = [r for r in self.records if r["kind"] == "group" and r["uid"] in keep]
        head = {"kind": "checkpoint", "iteration": int(iteration), "agent_state": agent_state, "layout": layout,
                "attempt": int(attempt), "submission": submission}
        records = [*kept, head]
        blob = b"".join(encode_record(r) for r in records)
        tmp = self.path.with_name(self.path.name + ".tmp")
        self.close()
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                _write_all(fd, blob)
                os.fsync(fd)
            finally:
                os.close(fd)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise _write_error(self.path, "compacting it", e) from e
        os.replace(tmp, self.path)
        _fsync_dir(self.path.parent)
        self.records = records

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)


# --------------------------------------------------------------------------- the trainer's side


class BankSession:
    """One run's use of its bank file: :meth:`start` (restore + compact), :meth:`completed` (write-through),
    :meth:`consumed` (per iteration), :meth:`checkpoint_saved` (compact). ``agent`` is anything with JSON-able
    ``state_dict()`` / ``load_state_dict()`` (the prompt positions); ``layout`` is compared on resume.

    ``ledger()`` returns, and resets, what happened since the last call: the uids ``produced`` (uid -> problem
    id), ``consumed`` and ``restored`` (the trainer writes it to the metrics JSONL, the crash test reads it).
    """

    def __init__(self, bank: RolloutBank, agent: Any, layout: dict):
        self.bank = bank
        self.agent = agent
        self.layout = layout
        self._ledger: dict[str, Any] = {"produced": {}, "consumed": [], "restored": []}
        self.attempt = 0  # of this run: one more than the last run that wrote the file (uids stay unique)

    def durable_groups(self) -> int:
        """Completed groups on disk that no iteration consumed yet: what compaction at a checkpoint keeps, at
        least (a checkpoint records it, so a resume can tell when the file lost some)."""
        consumed = self.bank.consumed()
        return sum(1 for r in self.bank.records if r["kind"] == "group" and r["uid"] not in consumed)

    def start(self, iteration: int, resuming: bool, recorded: int | None = None) -> tuple[list[GroupRecord], dict]:
        """The groups to restore at checkpoint ``iteration`` and where the pipeline submits (loading the agents'
        newer prompt positions, if the bank has any); ``resuming`` False (a new run) drops what the bank holds.
        ``recorded``: the durable groups checkpoint ``iteration`` counted for this rank (fewer found is reported).
        Leaves the file compacted."""
        restore: list[GroupRecord] = []
        submission = {"next_index": iteration * self.layout["groups_per_step"], "resubmit": [], "skip": []}
        old = self.bank.groups()
        self.attempt = self.bank.attempt() + 1 if resuming else 0
        if not resuming:
            if old:
                log.warning("rollout bank %s: this run does not resume (no --load): the %d group(s) an earlier run "
                            "left there are dropped", self.bank.path, len(old))
        else:
            plan = resume_plan(self.bank.records, iteration)
            if plan.discarded:
                log.warning("rollout bank %s: %s; its %d group(s) are dropped and regenerated", self.bank.path,
                            plan.note, len(old))
            else:
                restore = plan.restore
                self._report_lost(iteration, len(restore), recorded)
                saved = self.bank.layout()
                if restore and saved is not None and saved != self.layout:
                    raise RolloutBankError(
                        f"rollout bank {self.bank.path} was written with {saved} but this run has {self.layout}: "
                        f"its groups do not fit (resume with the same --grpo-prompts-per-step, --grpo-group-size "
                        f"and data-parallel size, or move the bank directory away to regenerate them)")
                if plan.agent_state is not None:
                    self.agent.load_state_dict(plan.agent_state)
                if plan.submission is not None:
                    submission = plan.submission
                if restore:
                    log.info("rollout bank %s: restored %d completed group(s) not trained into checkpoint %d "
                             "(%d trained by then); %s", self.bank.path, len(restore), iteration,
                             len(plan.trained), ", ".join(g.uid for g in restore))
        self.bank.compact(iteration, [g.uid for g in restore], self.agent.state_dict(), self.layout, self.attempt,
                          submission)
        self._ledger["restored"] = [g.uid for g in restore]
        return restore, submission

    def _report_lost(self, iteration: int, found: int, recorded: int | None) -> None:
        if recorded is not None and found < recorded:
            log.warning("rollout bank %s: %d durable group(s) found but checkpoint %d recorded %d: %d completed "
                        "group(s) were lost (the file was emptied, deleted or cut) and are generated again",
                        self.bank.path, found, iteration, recorded, recorded - found)

    def completed(self, uid: str, index: int, batch: int, submitted: int, finished: int, group: RolloutGroup,
                  attempt: int = 0) -> None:
        self.bank.append_group(GroupRecord(uid, index, batch, submitted, finished, group, self.agent.state_dict(),
                                           attempt))
        self._ledger["produced"][uid] = group.problem_id

    def consumed(self, iteration: int, uids: Sequence[str]) -> None:
        self.bank.mark_consumed(iteration, uids)
        self._ledger["consumed"] = list(uids)

    def checkpoint_saved(self, iteration: int, submission: dict) -> None:
        """Checkpoint ``iteration`` is published: drop what it trained, keep the rest. ``submission``: the
        pipeline's :class:`~megatron.rl.rollout.pipeline.SubmissionState` as a dict."""
        consumed = self.bank.consumed()
        keep = [g.uid for g in self.bank.groups() if g.uid not in consumed]
        self.bank.compact(iteration, keep, self.agent.state_dict(), self.layout, self.attempt, submission)

    def ledger(self) -> dict[str, Any]:
        out, self._ledger = self._ledger, {"produced": {}, "consumed": [], "restored": []}
        return out

    def close(self) -> None:
        self.bank.close()
