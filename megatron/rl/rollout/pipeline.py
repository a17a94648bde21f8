"""Asynchronous rollouts: a persistent producer of rollout groups with a bounded generation lag.

:class:`RolloutPipeline` keeps groups in flight across iterations: a group submitted at policy version ``s`` is
trained at a version ``c`` with ``c - s <= --rl-generation-lag``; it consumes by batch or by group
(``--rl-consumption-granularity``), submits by batch, group or request (``--rl-submission-granularity``), and
drains or pauses the backend at every update (``--rl-partial-rollouts``). Its event loop runs only inside
:meth:`RolloutPipeline.next_batch` and :meth:`close`, so nothing of it runs while the trainer updates the
weights. It does not gather across ranks or train. Why the lag bound holds and how ranks stay matched:
docs/rollouts.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from typing import Awaitable, Callable, Sequence

from megatron.rl.base.types import RolloutGroup, TokenRollout
from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.inference.forwarding import ForwardingInference
from megatron.rl.inference.validation import sample_count
from megatron.rl.rollout.async_config import AsyncRolloutConfig

log = logging.getLogger(__name__)

VERSIONS_KEY = "policy_versions"  # TokenRollout.metadata: policy version per token (-1 where not generated)


@dataclasses.dataclass(frozen=True)
class GroupTicket:
    """A group's place in the pipeline: submission ``index`` (from 0), its ``batch`` (``index // P``), the
    policy ``version`` it was submitted at and the ``attempt`` of the run that submitted it (0, then one more at
    every resume with a durable rollout bank: a resumed run submits some indices again, see
    :mod:`megatron.rl.rollout.bank`, and uids must stay unique)."""

    index: int
    batch: int
    version: int
    attempt: int = 0

    @property
    def uid(self) -> str:
        return f"g{self.index}" if not self.attempt else f"g{self.index}.r{self.attempt}"


@dataclasses.dataclass(frozen=True)
class SubmissionState:
    """Where submission stands, for a durable rollout bank to resume it: the next new index, the indices below it
    that must be submitted again (in flight when recorded: lost if they never completed) and the indices from
    ``next_index`` on that must never be submitted (already completed: restored or trained)."""

    next_index: int
    resubmit: tuple[int, ...] = ()
    skip: tuple[int, ...] = ()


@dataclasses.dataclass
class FinishedGroup:
    ticket: GroupTicket
    group: RolloutGroup
    finished_version: int  # the policy version when its last token was generated
    order: int  # completion order on this producer


# produce(batch, num_groups): the agent call for ``num_groups`` groups of ``batch`` (seeds derive from the batch).
Produce = Callable[[int, int], Awaitable[Sequence[RolloutGroup]]]


class PhaseControl:
    """What the backend does around a generation phase; the default does nothing (e.g. a remote server).

    ``start(version)``: generation resumes with the weights of ``version``. ``stop(drained)``: the phase ended;
    ``drained`` says no request is in flight (the engine may free its KV cache), otherwise the in-flight requests
    must not advance until the next ``start`` (the trainer is about to change the weights). ``close()``: shutdown.
    """

    def start(self, version: int) -> None:
        pass

    def stop(self, drained: bool) -> None:
        pass

    def close(self) -> None:
        pass


class RolloutPipeline:
    """A persistent producer of rollout groups (see the module docstring).

    Args:
        produce: the agent call for ``num_groups`` groups of a batch (see :data:`Produce`).
        config: the async-rollout flags.
        groups_per_step: ``P`` on this producer (``--grpo-prompts-per-step / DP``).
        group_size: rollouts per group (requests per group, for ``--rl-max-inflight-requests``).
        control: pauses / stops the backend between phases.
        start_version: the policy version of the loaded weights (the resumed iteration).
        restored: groups completed before a crash and not trained into the loaded weights (the durable rollout
            bank): finished from the start, with their original tickets; their submission indices are not
            generated again.
        on_finished: called with each group as it completes (the bank writes it through), not for restored ones.
        attempt: stamped on the tickets this pipeline submits (see :class:`GroupTicket`).
        submission: where submission stood when the bank last recorded it (default: the resumed version's first
            batch); with ``G`` consumption the groups trained by then are not a prefix of the indices.
    """

    def __init__(self, produce: Produce, config: AsyncRolloutConfig, groups_per_step: int, group_size: int,
                 control: PhaseControl | None = None, start_version: int = 0,
                 restored: Sequence[FinishedGroup] = (), on_finished: Callable[[FinishedGroup], None] | None = None,
                 attempt: int = 0, submission: SubmissionState | None = None):
        if groups_per_step < 1:
            raise ValueError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.config = config
        self.groups_per_step = groups_per_step
        self.group_size = group_size
        self.version = start_version
        self._produce = produce
        self._control = control or PhaseControl()
        self._loop = asyncio.new_event_loop()
        self._progress = asyncio.Event()
        # Indices are counted from the resumed version's first batch, so batch numbers equal iterations.
        self._next_index = start_version * groups_per_step
        self._inflight: dict[asyncio.Task, list[GroupTicket]] = {}
        self._finished: dict[int, FinishedGroup] = {}
        self._completions = 0
        self._errors: list[BaseException] = []
        self._closed = False
        self._on_finished = on_finished
        self._attempt = attempt
        for f in sorted(restored, key=lambda f: f.ticket.index):
            self._finished[f.ticket.index] = dataclasses.replace(f, order=self._completions)
            self._completions += 1
        if submission is not None:
            self._next_index = submission.next_index
        # never submitted again: restored (finished) or already trained
        self._skip = {i for i in [*self._finished, *(submission.skip if submission else ())] if i >= self._next_index}
        self._resubmit = sorted({*(submission.resubmit if submission else ())} - set(self._finished))

    # ------------------------------------------------------------------ state

    @property
    def inflight(self) -> list[GroupTicket]:
        return sorted((t for ts in self._inflight.values() for t in ts), key=lambda t: t.index)

    @property
    def finished(self) -> list[FinishedGroup]:
        return sorted(self._finished.values(), key=lambda f: f.ticket.index)

    def outstanding(self) -> list[GroupTicket]:
        """Submitted and not yet consumed (in flight or finished), in submission order."""
        return sorted([*self.inflight, *(f.ticket for f in self._finished.values())], key=lambda t: t.index)

    # ------------------------------------------------------------------ one iteration

    def next_batch(self) -> list[FinishedGroup]:
        """Run generation until this version's ``P`` groups are ready; returns them (the caller trains on them and
        then calls :meth:`advance`)."""
        if self._closed:
            raise RuntimeError("the rollout pipeline is closed")
        self._control.start(self.version)
        # With partial rollouts the backend is always paused, never stopped, between phases, even when nothing is
        # in flight: whether a group has finished at this instant can differ between the ranks of one engine
        # (rewards run in threads), and stopping is collective over them.
        drained = False
        try:
            batch = self._loop.run_until_complete(self._next_batch())
            drained = not self.config.partial_rollouts
        finally:
            self._control.stop(drained)
        return batch

    def advance(self) -> None:
        """The weights were updated: generation from now on is by version ``version + 1``."""
        self.version += 1

    async def _next_batch(self) -> list[FinishedGroup]:
        self._refill()
        while (selected := self._select()) is None:
            await self._wait_for_progress()
            self._refill()
        for f in selected:
            del self._finished[f.ticket.index]
        if not self.config.partial_rollouts:  # drain: nothing in flight may see the update
            while self._inflight:
                await self._wait_for_progress()
        return selected

    async def _wait_for_progress(self) -> None:
        if not self._inflight:
            raise RuntimeError("rollout pipeline stalled: nothing in flight and no batch ready (a bug)")
        await self._progress.wait()
        self._progress.clear()
        self._raise_failures()

    # ------------------------------------------------------------------ submission

    def _limit(self) -> int:
        """One past the highest submission index allowed at this version (the lag bound)."""
        return (self.version + self.config.generation_lag + 1) * self.groups_per_step

    def _group_slots(self) -> int | None:
        cap = self.config.max_inflight_requests
        if not cap or self.config.submission_granularity == "R":  # R: RequestGate caps requests instead
            return None
        return cap // self.group_size - sum(len(ts) for ts in self._inflight.values())

    def submission_state(self) -> SubmissionState:
        """See :class:`SubmissionState` (for the durable rollout bank)."""
        inflight = [t.index for ts in self._inflight.values() for t in ts]
        return SubmissionState(self._next_index, tuple(sorted({*inflight, *self._resubmit})),
                               tuple(sorted(self._skip)))

    def _submit(self, tickets: list[GroupTicket]) -> None:
        task = self._loop.create_task(self._run(tickets))
        self._inflight[task] = tickets

    def _refill(self) -> None:
        P = self.groups_per_step
        while self._resubmit and self._resubmit[0] < self._limit():  # lost in a crash: before any new index
            slots = self._group_slots()
            if slots is not None and slots < 1:
                return
            i = self._resubmit.pop(0)
            self._submit([GroupTicket(index=i, batch=i // P, version=self.version, attempt=self._attempt)])
        while self._next_index < self._limit():
            i = self._next_index
            if i in self._skip:
                self._skip.discard(i)
                self._next_index += 1
                continue
            if self.config.submission_granularity == "B":
                # The rest of the batch (all of it, except after a resume mid-batch), up to a restored group.
                count = min([(i // P + 1) * P, *(j for j in self._skip if j > i)]) - i
            else:
                count = 1
            slots = self._group_slots()
            if slots is not None and slots < count:
                return
            self._submit([GroupTicket(index=i + k, batch=i // P, version=self.version, attempt=self._attempt)
                          for k in range(count)])
            self._next_index += count

    async def _run(self, tickets: list[GroupTicket]) -> None:
        try:
            groups = list(await self._produce(tickets[0].batch, len(tickets)))
            if len(groups) != len(tickets):
                raise RuntimeError(f"the agent returned {len(groups)} groups for {len(tickets)} requested")
            for t, g in zip(tickets, groups):
                annotate_versions(g, t.version, self.version)
                finished = FinishedGroup(t, g, self.version, self._completions)
                if self._on_finished is not None:  # before it can be consumed: the bank writes it through
                    self._on_finished(finished)
                self._finished[t.index] = finished
                self._completions += 1
        except asyncio.CancelledError:
            raise
        except Exception as e:  # an agent error is the run's error: raised from next_batch
            self._errors.append(e)
        finally:
            self._inflight.pop(asyncio.current_task(), None)
            self._progress.set()

    # ------------------------------------------------------------------ consumption

    def _select(self) -> list[FinishedGroup] | None:
        self._raise_failures()
        P, v = self.groups_per_step, self.version
        if self.config.consumption_granularity == "B":
            indices = range(v * P, (v + 1) * P)
            if all(i in self._finished for i in indices):
                return [self._finished[i] for i in indices]
            return None
        # G: earliest deadline (submission version) first, then completion order.
        ready = sorted(self._finished.values(), key=lambda f: (f.ticket.version, f.order))
        if len(ready) < P:
            return None
        lag = self.config.generation_lag
        outstanding = [t.version + lag for t in self.outstanding()]
        for k in range(lag + 1):  # after this step, at most k x P outstanding groups may be due by version v + k
            due = sum(d <= v + k for d in outstanding)
            ready_due = sum(f.ticket.version + lag <= v + k for f in ready)
            if min(P, ready_due) < due - k * P:
                return None
        return ready[:P]

    def _raise_failures(self) -> None:
        if self._errors:
            raise self._errors[0]

    # ------------------------------------------------------------------ shutdown

    def close(self) -> list[GroupTicket]:
        """Cancel everything in flight and stop the backend; returns the tickets that were never trained."""
        if self._closed:
            return []
        self._closed = True
        left = self.outstanding()
        tasks = list(self._inflight)
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
        finally:
            self._control.close()
            self._loop.close()
        if left:
            log.info("rollout pipeline closed with %d groups not trained (%d in flight)", len(left), len(tasks))
        return left


def annotate_versions(group: RolloutGroup, submitted: int, finished: int) -> None:
    """Give every token rollout of ``group`` its policy version per token, unless the backend already did.

    A group that finished at the version it was submitted at saw no update: every generated token has that
    version (exact). One that spanned updates (partial rollouts) without per-token versions from the backend gets
    its submission version, the oldest it can be (staleness is then an upper bound).
    """
    for r in group.rollouts:
        if isinstance(r, TokenRollout) and VERSIONS_KEY not in r.metadata:
            r.metadata[VERSIONS_KEY] = [submitted if m else -1 for m in r.generation_mask]
    if submitted != finished:
        log.debug("group submitted at version %d finished at %d without per-token versions", submitted, finished)


class RequestGate(ForwardingInference):
    """``--rl-submission-granularity R``: at most ``max_requests`` requests (samples) in the backend at once.

    Wraps the backend the agents generate with; a call owing ``n`` samples waits until ``n`` slots are free (first
    come, first served), so groups can be drawn ahead while requests enter the engine as slots free.
    """

    def __init__(self, inner: InferenceInterface, max_requests: int):
        if max_requests < 1:
            raise ValueError(f"max_requests must be >= 1, got {max_requests}")
        super().__init__(inner)
        self.max_requests = max_requests
        self.in_use = 0
        self.peak = 0
        self._cond: asyncio.Condition | None = None

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        n = min(sum(sample_count(r) for r in requests), self.max_requests)
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: self.in_use + n <= self.max_requests)
            self.in_use += n
            self.peak = max(self.peak, self.in_use)
        try:
            return await self.inner.agenerate(requests)
        finally:
            async with self._cond:
                self.in_use -= n
                self._cond.notify_all()


