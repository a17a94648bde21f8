"""Lockstep scheduling: every rank of a model-parallel group runs the same engine steps on the same requests.

The group's lowest rank (the source) shares a :class:`Plan` (which requests join, whether to stop) before each
step; every rank adds exactly those. The i-th request of a non-source rank is matched to the source's i-th; a
mismatch gets an error response, never someone else's completion. :class:`LockstepScheduler` knows nothing of
engines: it drives a :class:`Stepper`, and the plan is shared by a function (:func:`broadcast_plan` over gloo).
Callers :meth:`~LockstepScheduler.submit` from any thread; :meth:`~LockstepScheduler.run` runs on the engine
thread.

Details: docs/inference.md.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from typing import Any, Callable, Protocol, Sequence

import torch.distributed as dist

from megatron.rl.inference.api import InferenceResponse

__all__ = ["Job", "Plan", "Stepper", "LockstepScheduler", "broadcast_plan", "lockstep_group", "lockstep_rank_groups"]

# The source re-shares an empty plan this often while idle, so waiting ranks never hit the process group's
# collective timeout.
IDLE_HEARTBEAT_S = 5.0
# An idle engine that just got work waits until no request has arrived for this long (at most SETTLE_MAX_S)
# before its first step: a rollout phase submits its groups from one event loop, one after the other, and an
# engine thread that stepped as soon as the first woke it would prefill that group alone and the others in a
# second step (one extra step per phase; its cost: docs/benchmarks.md, "Figures behind code comments").
SETTLE_S = 0.002
SETTLE_MAX_S = 0.05


@dataclasses.dataclass
class Job:
    """One single-sample request on its way to the engine (what the source shares)."""

    seq: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str]
    prompt_text: str | None


@dataclasses.dataclass
class Plan:
    """What every rank does before the next step: add ``jobs``; ``stop`` = leave the loop (nothing in flight);
    ``pause`` = hold every request (no step) until resumed (asynchronous partial rollouts); ``cancel`` = end these
    requests in flight now (their callers left)."""

    jobs: list[Job]
    stop: bool
    pause: bool = False
    hold: int = 0  # with pause: the source's resume() count when it planned it (which hold this is)
    cancel: list[int] = dataclasses.field(default_factory=list)


class Stepper(Protocol):
    """The engine side of the loop. ``add`` and ``step`` hand finished requests to ``LockstepScheduler.deliver``."""

    def has_unfinished(self) -> bool: ...

    def add(self, job: Job) -> None: ...

    async def step(self) -> None: ...

    def resumed(self) -> None:
        """After a pause: the weights may have changed under the requests in flight."""

    def cancel(self, seq: int) -> None:
        """End request ``seq`` now (its caller left): deliver it failed, now or after the next step."""


SharePlan = Callable[["Plan | None"], Plan]


@dataclasses.dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    job: Job
    cancelled: Callable[[], bool] | None = None  # source: True once the caller no longer wants the response
    # (so is a cancelled future: the caller's task was cancelled)


class LockstepScheduler:
    """Request queue, waiting callers and the engine-step loop of one rank (see the module docstring).

    is_source: this rank decides the plans (the lockstep group's lowest rank; True when alone).
    share: called on the engine thread before each step with this rank's plan (None on non-source ranks);
        returns the source's plan. Collective over the lockstep group.
    """

    def __init__(self, is_source: bool, share: SharePlan, heartbeat_s: float = IDLE_HEARTBEAT_S,
                 settle_s: float = SETTLE_S, settle_max_s: float = SETTLE_MAX_S):
        self.is_source = is_source
        self._share = share
        self._heartbeat_s = heartbeat_s
        self._settle_s = settle_s
        self._settle_max_s = settle_max_s
        self._lock = threading.Condition()
        self._next_seq = 0
        self._queue: list[Job] = []  # source only: submitted, not yet in a plan
        self._waiters: dict[int, _Waiter] = {}
        self._early: dict[int, tuple[Job, InferenceResponse]] = {}  # non-source: finished before submitted
        self._in_flight: dict[int, Job] = {}  # handed to the stepper, not delivered yet (engine thread only)
        self._cancel_sent: set[int] = set()  # source: in-flight requests whose cancellation a plan carried
        self._accepting = False
        self._stop_requested = False
        self._pause_requested = False
        self.paused = threading.Event()  # set while the loop holds its requests (every rank of the group)
        self._resumes = 0  # resume() calls so far: a hold ends once this rank's trainer resumed after it began
        self._hold: int | None = None  # engine thread: the hold in force (Plan.hold), None while stepping
        self.steps = 0  # engine steps started since construction (a batching diagnostic)

    # ------------------------------------------------------------------ lifecycle (caller threads)

    def start(self) -> None:
        """Accept submissions (the engine thread is starting)."""
        with self._lock:
            self._accepting = True
            self._stop_requested = False

    def request_stop(self) -> None:
        """Let :meth:`run` return once everything in flight and queued has finished; refuse new submissions."""
        with self._lock:
            self._stop_requested = True
            self._pause_requested = False
            self._lock.notify_all()

    def request_pause(self) -> None:
        """Hold every request after the current step (source: the next plan says pause); see :attr:`paused`."""
        with self._lock:
            self._pause_requested = True
            self._lock.notify_all()

    def resume(self) -> None:
        # ``paused`` acknowledges one pause: cleared here, so that the next pause_generation waits for the next hold.
        # A stale event would let a phase shorter than the engine thread's wake-up (lag 1: the batch already
        # finished) return from the pause without pausing, while its engine thread still waits for this resume and
        # the partner's engine steps into a TP all-reduce: a deadlock.
        with self._lock:
            self._pause_requested = False
            self._resumes += 1
            self.paused.clear()
            self._lock.notify_all()

    def stopped(self, reason: str) -> None:
        """After :meth:`run` returned: refuse submissions, fail every caller still waiting with ``reason``."""
        with self._lock:
            self._accepting = False
            self._stop_requested = False
            leftovers = list(self._waiters.values())
            self._waiters.clear()
            self._early.clear()
        for waiter in leftovers:
            _resolve(waiter, InferenceResponse.failed(reason, waiter.job.prompt_text))

    def fail_queued(self, reason: str) -> None:
        """The engine never started: refuse submissions, fail what was queued for it with ``reason``."""
        with self._lock:
            self._accepting = False
            stranded = [self._waiters.pop(job.seq) for job in self._queue if job.seq in self._waiters]
            self._queue = []
        for waiter in stranded:
            _resolve(waiter, InferenceResponse.failed(reason, waiter.job.prompt_text))

    # ------------------------------------------------------------------ callers

    def submit(self, job: Job, loop: asyncio.AbstractEventLoop,
               cancelled: Callable[[], bool] | None = None) -> asyncio.Future:
        """Queue ``job`` (numbering it); the future resolves on ``loop`` with its response. On the source, once
        ``cancelled()`` is true every rank ends the request before the next step (see :meth:`Stepper.cancel`)."""
        return self.submit_many([(job, cancelled)], loop)[0]

    def submit_many(self, jobs: Sequence[tuple[Job, Callable[[], bool] | None]],
                    loop: asyncio.AbstractEventLoop) -> list[asyncio.Future]:
        """:meth:`submit` for several ``(job, cancelled)`` at once: they enter the queue together, so an idle
        engine's first step sees them all (one caller's batch is never split by a pause of the calling thread
        between two submissions)."""
        futures = []
        with self._lock:
            for job, cancelled in jobs:
                future = loop.create_future()
                futures.append(future)
                if not self._accepting or self._stop_requested:
                    future.set_result(InferenceResponse.failed("the inference engine is not running "
                                                               "(inference mode exited)", job.prompt_text))
                    continue
                job.seq = self._next_seq
                self._next_seq += 1
                waiter = _Waiter(loop, future, job, cancelled)
                if self.is_source:
                    self._waiters[job.seq] = waiter
                    self._queue.append(job)
                elif job.seq in self._early:
                    source_job, response = self._early.pop(job.seq)
                    _resolve(waiter, checked(job, source_job, response))
                else:
                    self._waiters[job.seq] = waiter
            if self.is_source and jobs:
                self._lock.notify_all()
        return futures

    # ------------------------------------------------------------------ engine thread

    def deliver(self, source_job: Job, response: InferenceResponse) -> None:
        """Hand a finished request's response to whoever submitted it on this rank."""
        self.deliver_many([(source_job, response)])

    def deliver_many(self, finished: Sequence[tuple[Job, InferenceResponse]]) -> None:
        """:meth:`deliver` for several finished requests, waking each caller's loop once for all of them."""
        ready = []
        with self._lock:
            for source_job, response in finished:
                self._in_flight.pop(source_job.seq, None)
                self._cancel_sent.discard(source_job.seq)
                waiter = self._waiters.pop(source_job.seq, None)
                if waiter is None:
                    if not self.is_source:
                        self._early[source_job.seq] = (source_job, response)
                    continue
                ready.append((waiter, source_job, response))
        _resolve_many([(waiter, checked(waiter.job, source_job, response)) for waiter, source_job, response in ready])

    def next_plan(self, idle: bool) -> Plan:
        """Source: take everything queued (waiting up to a heartbeat while idle); all ranks: agree on it."""
        plan = None
        if self.is_source:
            with self._lock:
                if self._pause_requested and self.paused.is_set():  # held: heartbeat until resumed
                    self._lock.wait(timeout=self._heartbeat_s)
                if self._pause_requested:
                    plan = Plan(jobs=[], stop=False, pause=True, hold=self._resumes)
                else:
                    if idle and not self._queue and not self._stop_requested:
                        self._lock.wait(timeout=self._heartbeat_s)
                    if idle and self._queue:
                        self._settle()
                    jobs, self._queue = self._queue, []
                    plan = Plan(jobs=jobs, stop=self._stop_requested and idle and not jobs)
                plan.cancel = self._cancellations(plan.jobs)
        return self._share(plan)

    def _cancellations(self, jobs: list[Job]) -> list[int]:
        """Source, lock held: the requests in flight or in ``jobs`` whose callers left, each once. Every rank adds
        a job of the plan before cancelling it, so all ranks answer it alike."""
        gone = [seq for seq, w in self._waiters.items()
                if w.future.cancelled() or (w.cancelled is not None and w.cancelled())]
        if not gone:
            return []
        planned = {job.seq for job in jobs}
        cancel = sorted(seq for seq in gone
                        if (seq in self._in_flight or seq in planned) and seq not in self._cancel_sent)
        self._cancel_sent.update(cancel)
        return cancel

    def _settle(self) -> None:
        """Wait (lock held, released while waiting) until the queue stops growing (at most ``settle_max_s``); see
        :data:`SETTLE_S`."""
        deadline = time.monotonic() + self._settle_max_s
        while not self._stop_requested and not self._pause_requested:
            seen, left = len(self._queue), deadline - time.monotonic()
            if left <= 0:
                return
            self._lock.wait(timeout=min(self._settle_s, left))
            if len(self._queue) == seen:
                return

    async def run(self, stepper: Stepper) -> None:
        """Step until a plan says stop. An exception propagates; then call :meth:`abort`."""
        while True:
            idle = not stepper.has_unfinished()
            plan = self.next_plan(idle)
            if plan.pause:
                for seq in plan.cancel:
                    stepper.cancel(seq)
                self._hold = plan.hold
                self.paused.set()
                continue
            if self._hold is not None:  # resumed: the weights changed under the requests in flight
                with self._lock:  # a non-source rank steps only once its own trainer resumed from this hold
                    # (every rank pauses and resumes once per update, so the ranks' resume counts agree)
                    while self._resumes <= self._hold and not self._stop_requested:
                        self._lock.wait(timeout=1.0)
                self._hold = None
                self.paused.clear()
                stepper.resumed()
            for job in plan.jobs:
                self._in_flight[job.seq] = job
                stepper.add(job)
            for seq in plan.cancel:
                stepper.cancel(seq)
            if stepper.has_unfinished():
                self.steps += 1
                await stepper.step()
            elif plan.stop:
                return

    def abort(self, reason: str) -> None:
        """The loop failed: fail everything in flight and queued; refuse submissions until restarted."""
        for job in list(self._in_flight.values()):
            self.deliver(job, InferenceResponse.failed(reason, job.prompt_text))
        with self._lock:
            queued, self._queue = self._queue, []
            self._stop_requested = True
        for job in queued:
            self.deliver(job, InferenceResponse.failed(reason, job.prompt_text))


def checked(local: Job, source: Job, response: InferenceResponse) -> InferenceResponse:
    """Non-source ranks: only hand back the source's completion when both ranks asked the same thing."""
    if local is source or (local.prompt_ids == source.prompt_ids and local.max_new_tokens == source.max_new_tokens
                           and local.temperature == source.temperature and local.seed == source.seed):
        return response
    return InferenceResponse.failed(
        f"model-parallel ranks submitted different requests as request #{local.seq} (this rank: "
        f"{len(local.prompt_ids)} prompt tokens; source rank: {len(source.prompt_ids)}): every rank of a "
        "tensor/pipeline/expert-parallel group must call agenerate with the same requests in the same order",
        local.prompt_text)


def _resolve(waiter: _Waiter, response: InferenceResponse) -> None:
    _resolve_many([(waiter, response)])


def _resolve_many(ready: Sequence[tuple[_Waiter, InferenceResponse]]) -> None:
    """Set each waiter's future on its own loop: one ``call_soon_threadsafe`` per loop (each is a pipe write)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Waiter, InferenceResponse]]] = {}
    for waiter, response in ready:
        by_loop.setdefault(waiter.loop, []).append((waiter, response))

    def set_results(pairs: list[tuple[_Waiter, InferenceResponse]]) -> None:
        for waiter, response in pairs:
            if not waiter.future.done():  # the caller may have been cancelled (e.g. a client disconnect)
                waiter.future.set_result(response)

    for loop, pairs in by_loop.items():
        try:
            loop.call_soon_threadsafe(set_results, pairs)
        except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
            pass


def broadcast_plan(group: Any, source: int) -> SharePlan:
    """Share plans over ``group`` (gloo) from global rank ``source``; None (a rank alone) shares nothing."""
    if group is None:
        return lambda plan: plan

    def share(plan: Plan | None) -> Plan:
        box = [plan]
        dist.broadcast_object_list(box, src=source, group=group)
        return box[0]

    return share


def lockstep_group() -> tuple[Any, int, int]:
    """The gloo group of ranks whose forwards communicate (union of TP, PP, EP groups), its source rank and size.

    Collective over the world. Returns (None, rank, 1) when this rank runs alone.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if world == 1:
        return None, rank, 1
    from megatron.core import parallel_state as ps

    mine: set[int] = {rank}
    getters = [ps.get_tensor_model_parallel_group, ps.get_pipeline_model_parallel_group,
               ps.get_expert_model_parallel_group, ps.get_expert_tensor_parallel_group]
    for getter in getters:
        try:
            group = getter(check_initialized=False)
        except (AssertionError, RuntimeError, TypeError):
            group = None
        if group is not None:
            mine.update(dist.get_process_group_ranks(group))
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, sorted(mine))
    members = connected_components([ranks for ranks in everyone])
    my_group = None
    for component in members:
        if len(component) < 2:
            continue
        group = dist.new_group(component, backend="gloo")  # every rank creates every group, in the same order
        if rank in component:
            my_group = group
    mine_component = next(c for c in members if rank in c)
    return my_group, min(mine_component), len(mine_component)


def connected_components(rank_sets: list[list[int]]) -> list[list[int]]:
    """Ranks ``0..len(rank_sets)-1`` joined when they share a set: sorted components, each sorted.

    ``rank_sets[r]`` is what rank ``r`` reported (itself and every rank its forward talks to).
    """
    parent = list(range(len(rank_sets)))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for ranks in rank_sets:
        for r in ranks[1:]:
            parent[find(r)] = find(ranks[0])
    components: dict[int, list[int]] = {}
    for r in range(len(rank_sets)):
        components.setdefault(find(r), []).append(r)
    return sorted(components.values())


def lockstep_rank_groups(world: int, tp: int, pp: int, ep: int = 1, expert_tp: int | None = None) -> list[list[int]]:
    """The lockstep groups of a layout, from its sizes alone (pure): sorted lists of global ranks, sorted.

    The same union of tensor-, pipeline-, expert- and expert-tensor-parallel groups as :func:`lockstep_group`,
    with the groups megatron-core's ``RankGenerator`` builds in its default order ``tp-cp-ep-dp-pp``.
    ``expert_tp`` defaults to ``tp`` (megatron-core's default). Without expert parallelism there is one
    group per data-parallel rank (the model-parallel group); with it, the EP group joins the ranks of
    ``ep`` data-parallel ranks into one group.
    """
    from megatron.core.parallel_state import RankGenerator

    etp = expert_tp or tp
    order = "tp-cp-ep-dp-pp"
    dense = RankGenerator(tp=tp, ep=1, dp=world // (tp * pp), pp=pp, cp=1, order=order)
    expert = RankGenerator(tp=etp, ep=ep, dp=world // (etp * ep * pp), pp=pp, cp=1, order=order)
    talks_to: list[set[int]] = [{r} for r in range(world)]
    for generator, kinds in ((dense, ("tp", "pp")), (expert, ("ep", "tp"))):
        for kind in kinds:
            for ranks in generator.get_ranks(kind):
                for r in ranks:
                    talks_to[r].update(ranks)
    return connected_components([sorted(s) for s in talks_to])
