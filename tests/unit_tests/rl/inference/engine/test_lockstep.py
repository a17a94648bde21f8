"""The lockstep scheduler without an engine: simulated ranks (threads) sharing plans, a fake step function."""
from __future__ import annotations

import asyncio
import queue
import threading
import time

import pytest

from megatron.rl.inference.api import InferenceResponse
from megatron.rl.inference.engine.lockstep import Job, LockstepScheduler, Plan, connected_components


def _job(prompt: list[int], max_new_tokens: int = 3, temperature: float = 0.0, seed: int | None = None) -> Job:
    return Job(seq=-1, prompt_ids=list(prompt), max_new_tokens=max_new_tokens, temperature=temperature, top_k=0,
               top_p=1.0, seed=seed, stop=[], prompt_text=f"p{prompt}")


class FakeStepper:
    """An 'engine' that generates ``max_new_tokens`` tokens per request, one per step (token = prompt sum + i).

    Records what it saw, so ranks can be compared: the plan of every step and the batch it stepped.
    """

    def __init__(self, scheduler: LockstepScheduler, fail_at_step: int | None = None):
        self.scheduler = scheduler
        self.running: dict[int, tuple[Job, list[int]]] = {}
        self.added: list[int] = []
        self.batches: list[list[int]] = []
        self.fail_at_step = fail_at_step

    def has_unfinished(self) -> bool:
        return bool(self.running)

    def add(self, job: Job) -> None:
        self.added.append(job.seq)
        self.running[job.seq] = (job, [])

    async def step(self) -> None:
        if self.fail_at_step is not None and len(self.batches) == self.fail_at_step:
            raise RuntimeError("injected step failure")
        self.batches.append(sorted(self.running))
        for seq, (job, tokens) in list(self.running.items()):
            tokens.append(sum(job.prompt_ids) + len(tokens))
            if len(tokens) == job.max_new_tokens:
                del self.running[seq]
                self.scheduler.deliver(job, InferenceResponse(
                    text="", token_ids=job.prompt_ids + tokens, prompt_length=len(job.prompt_ids),
                    logprobs=[0.0] * len(tokens), finish_reason="length", prompt_text=job.prompt_text))


class SimulatedGroup:
    """``size`` ranks; rank 0 is the source. Plans go from the source to every other rank through queues."""

    def __init__(self, size: int, heartbeat_s: float = 5.0):
        self.inboxes = [queue.Queue() for _ in range(size)]
        self.shared: list[list[Plan]] = [[] for _ in range(size)]
        self.schedulers = [LockstepScheduler(rank == 0, self._share_for(rank), heartbeat_s=heartbeat_s)
                           for rank in range(size)]

    def _share_for(self, rank: int):
        def share(plan: Plan | None) -> Plan:
            if rank == 0:
                assert plan is not None
                for inbox in self.inboxes[1:]:
                    inbox.put(plan)
            else:
                assert plan is None  # non-source ranks never decide
                plan = self.inboxes[rank].get(timeout=30)
            self.shared[rank].append(plan)
            return plan

        return share

    def start(self, steppers: list[FakeStepper]) -> list[threading.Thread]:
        threads = []
        for scheduler, stepper in zip(self.schedulers, steppers):
            scheduler.start()
            t = threading.Thread(target=asyncio.run, args=(scheduler.run(stepper),), daemon=True)
            t.start()
            threads.append(t)
        return threads

    def stop(self, threads: list[threading.Thread]) -> None:
        for scheduler in self.schedulers:
            scheduler.request_stop()
        for t in threads:
            t.join(timeout=30)
            assert not t.is_alive(), "the step loop did not stop"
        for scheduler in self.schedulers:
            scheduler.stopped("stopped")


def _submit_all(scheduler: LockstepScheduler, jobs: list[Job], delay_s: float = 0.0,
                submitted: threading.Event | None = None) -> list[InferenceResponse]:
    async def go():
        loop = asyncio.get_running_loop()
        futures = []
        for job in jobs:
            futures.append(scheduler.submit(job, loop))
            if delay_s:
                await asyncio.sleep(delay_s)
        if submitted is not None:
            submitted.set()
        return await asyncio.gather(*futures)

    return asyncio.run(go())


def test_ranks_run_the_same_steps_and_get_the_same_responses_whatever_their_timing():
    group = SimulatedGroup(3)
    steppers = [FakeStepper(s) for s in group.schedulers]
    threads = group.start(steppers)
    prompts = [[1, 2], [3], [4, 5, 6], [7], [8, 9]]
    results: dict[int, list[InferenceResponse]] = {}
    # the source submits fast; the other ranks submit the same requests slowly (their calls arrive late)
    callers = [threading.Thread(target=lambda r=r: results.__setitem__(r, _submit_all(
        group.schedulers[r], [_job(p, max_new_tokens=2 + i) for i, p in enumerate(prompts)],
        delay_s=0.02 * r))) for r in range(3)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=60)
    group.stop(threads)
    # every rank added the same requests and stepped the same batches: the source's
    assert steppers[1].added == steppers[2].added == steppers[0].added == list(range(len(prompts)))
    assert steppers[1].batches == steppers[2].batches == steppers[0].batches
    assert group.shared[1] == group.shared[2] == group.shared[0]
    assert group.schedulers[0].steps == group.schedulers[1].steps == len(steppers[0].batches)
    for r in range(3):
        for i, (p, resp) in enumerate(zip(prompts, results[r])):
            assert resp.finish_reason == "length" and resp.token_ids == p + [sum(p) + k for k in range(2 + i)]


def test_a_non_source_request_that_differs_gets_an_error_not_the_source_completion():
    group = SimulatedGroup(2)
    steppers = [FakeStepper(s) for s in group.schedulers]
    threads = group.start(steppers)
    results = {}
    callers = [threading.Thread(target=lambda: results.__setitem__(0, _submit_all(group.schedulers[0],
                                                                                  [_job([1]), _job([2])]))),
               threading.Thread(target=lambda: results.__setitem__(1, _submit_all(group.schedulers[1],
                                                                                  [_job([1]), _job([9, 9])])))]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=60)
    group.stop(threads)
    assert [r.finish_reason for r in results[0]] == ["length", "length"]
    assert results[1][0].token_ids == results[0][0].token_ids
    assert results[1][1].finish_reason == "error" and "different requests as request #1" in results[1][1].error


def test_idle_source_shares_heartbeat_plans_and_stop_waits_for_in_flight_work():
    group = SimulatedGroup(2, heartbeat_s=0.05)
    steppers = [FakeStepper(s) for s in group.schedulers]
    threads = group.start(steppers)
    # idle: the source keeps sharing empty plans so waiting ranks never time out (waited for, not timed: a loaded
    # machine may run the engine thread late)
    deadline = time.monotonic() + 30
    while len(group.shared[1]) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    idle_plans = list(group.shared[1])
    assert len(idle_plans) >= 3 and all(p.jobs == [] and not p.stop for p in idle_plans)
    assert steppers[0].batches == []  # nothing stepped while idle

    results = {}
    submitted = [threading.Event(), threading.Event()]
    callers = [threading.Thread(target=lambda r=r: results.__setitem__(r, _submit_all(
        group.schedulers[r], [_job([5], max_new_tokens=6)], submitted=submitted[r]))) for r in range(2)]
    for c in callers:
        c.start()
    assert all(e.wait(10) for e in submitted)
    deadline = time.monotonic() + 10
    while not steppers[0].added and time.monotonic() < deadline:
        time.sleep(0.005)
    group.stop(threads)  # requested mid-generation: the loop finishes the request first
    for c in callers:
        c.join(timeout=10)
    assert [results[r][0].finish_reason for r in range(2)] == ["length", "length"]
    assert len(results[0][0].generated_token_ids) == 6
    last = group.shared[0][-1]
    assert last.stop and last.jobs == [] and group.shared[1][-1] == last  # every rank left on the same plan
    # after the stop, new requests fail at once instead of hanging
    late = _submit_all(group.schedulers[0], [_job([1])])[0]
    assert late.finish_reason == "error" and "not running" in late.error


def test_a_failing_step_fails_in_flight_and_queued_requests_and_refuses_new_ones():
    scheduler = LockstepScheduler(True, lambda plan: plan)
    stepper = FakeStepper(scheduler, fail_at_step=1)
    scheduler.start()
    errors = []

    def engine_thread():
        try:
            asyncio.run(scheduler.run(stepper))
        except RuntimeError as e:
            errors.append(e)
            scheduler.abort(f"inference engine failed: {e!r}")

    t = threading.Thread(target=engine_thread, daemon=True)
    t.start()
    out = _submit_all(scheduler, [_job([1], max_new_tokens=1), _job([2], max_new_tokens=4)])
    t.join(timeout=10)
    assert errors and out[0].finish_reason == "length"  # finished in the first step, before the failure
    assert out[1].finish_reason == "error" and "injected step failure" in out[1].error
    refused = _submit_all(scheduler, [_job([3])])[0]
    assert refused.finish_reason == "error" and "not running" in refused.error


def test_an_engine_that_never_started_fails_what_was_queued():
    scheduler = LockstepScheduler(True, lambda plan: plan)
    scheduler.start()

    async def go():
        loop = asyncio.get_running_loop()
        future = scheduler.submit(_job([1]), loop)
        scheduler.fail_queued("the inference engine failed to start: boom")
        return await asyncio.wait_for(future, 5)

    response = asyncio.run(go())
    assert response.finish_reason == "error" and "failed to start: boom" in response.error


@pytest.mark.parametrize("rank_sets,expected", [
    ([[0], [1], [2]], [[0], [1], [2]]),  # pure data parallel: everyone alone
    ([[0, 1], [0, 1], [2, 3], [2, 3]], [[0, 1], [2, 3]]),  # TP=2, DP=2
    # TP=2 groups {0,1},{2,3} joined by an EP group {1,2}: one lockstep group of four
    ([[0, 1], [0, 1, 2], [1, 2, 3], [2, 3]], [[0, 1, 2, 3]]),
])
def test_lockstep_groups_are_the_connected_components_of_communicating_ranks(rank_sets, expected):
    assert connected_components(rank_sets) == expected


def test_pause_holds_every_rank_without_steps_until_resumed():
    group = SimulatedGroup(2, heartbeat_s=0.05)
    steppers = [FakeStepper(s) for s in group.schedulers]
    resumed = []
    for stepper in steppers:
        stepper.resumed = lambda s=stepper: resumed.append(len(s.batches))
    threads = group.start(steppers)
    results = {}
    callers = [threading.Thread(target=lambda r=r: results.__setitem__(r, _submit_all(
        group.schedulers[r], [_job([5], max_new_tokens=40)]))) for r in range(2)]
    for c in callers:
        c.start()
    deadline = time.monotonic() + 10
    while len(steppers[0].batches) < 3 and time.monotonic() < deadline:
        time.sleep(0.001)
    for s in group.schedulers:
        s.request_pause()
    assert all(s.paused.wait(10) for s in group.schedulers)  # the source's pause plan reached every rank
    held = [len(s.batches) for s in steppers]
    time.sleep(0.2)
    assert [len(s.batches) for s in steppers] == held and held[0] == held[1]  # nobody steps while paused
    for s in group.schedulers:
        s.resume()
    for c in callers:
        c.join(timeout=30)
    group.stop(threads)
    assert resumed == [held[0], held[0]]  # each rank told its engine once, at the same step
    assert [len(results[r][0].generated_token_ids) for r in range(2)] == [40, 40]


def test_a_pause_right_after_a_resume_waits_for_a_new_hold():
    """Lag 1 makes a phase nearly instant: the trainer resumes and pauses again before the engine thread wakes.
    The pause must not be acknowledged by the previous hold's ``paused`` (the rank then went on unpaused while
    its engine thread still waited for the resume and its partner's engine stepped: a deadlock seen with a TP=2
    inference copy), and a non-source rank must not step before its own trainer resumed from the new hold."""
    class Idle:
        def has_unfinished(self):
            return False

        def add(self, job):
            raise AssertionError("no jobs")

        async def step(self):
            raise AssertionError("nothing to step")

        def resumed(self):
            pass

    sched, stepper = LockstepScheduler(True, lambda plan: plan, heartbeat_s=0.01), Idle()
    sched.start()
    engine = threading.Thread(target=lambda: asyncio.run(sched.run(stepper)), daemon=True)
    engine.start()
    sched.request_pause()
    assert sched.paused.wait(5)
    sched.resume()
    sched.request_pause()  # before the engine thread saw the resume
    assert not sched.paused.is_set()  # was still set: this pause returned at once without holding anything
    assert sched.paused.wait(5)  # the new hold
    sched.resume()
    sched.request_stop()
    engine.join(5)
    assert not engine.is_alive()


def test_deliver_many_wakes_each_callers_loop_once_and_hands_every_response_to_its_own_caller():
    scheduler = LockstepScheduler(True, lambda plan: plan)
    scheduler.start()
    jobs = [_job([i]) for i in range(5)]
    wakeups: list[int] = []

    async def submit_and_deliver():
        loop = asyncio.get_running_loop()
        original = loop.call_soon_threadsafe

        def counted(callback, *args):
            wakeups.append(len(args[0]) if args else 1)
            return original(callback, *args)

        loop.call_soon_threadsafe = counted
        futures = [scheduler.submit(job, loop) for job in jobs]
        responses = [InferenceResponse(text=str(job.seq), token_ids=job.prompt_ids, prompt_length=1, logprobs=[],
                                       finish_reason="length", prompt_text=job.prompt_text) for job in jobs]
        scheduler.deliver_many(list(zip(jobs, responses))[::-1])  # in any order
        return await asyncio.gather(*futures)

    results = asyncio.run(submit_and_deliver())
    assert [r.text for r in results] == [str(job.seq) for job in jobs]
    assert wakeups == [5]  # one pipe write for the five, not one each


def test_an_idle_engine_takes_submissions_arriving_back_to_back_into_one_first_step():
    """A rollout phase submits its groups one after another from one event loop (each group's requests are
    prepared before they are submitted): the first step must hold all of them, not just the first group.
    (A settle window of 1 s instead of 2 ms, capped at 60 s instead of 50 ms: the behaviour, not the production
    windows, so a loaded machine descheduling the caller between two groups cannot fail it.)"""
    scheduler = LockstepScheduler(True, lambda plan: plan, settle_s=1.0, settle_max_s=60.0)
    stepper = FakeStepper(scheduler)
    scheduler.start()
    engine = threading.Thread(target=lambda: asyncio.run(scheduler.run(stepper)), daemon=True)
    engine.start()

    async def groups():
        loop = asyncio.get_running_loop()
        futures = []
        for g in range(16):
            futures += [scheduler.submit(_job([g, i], max_new_tokens=2), loop) for i in range(8)]
            time.sleep(0.0005)  # preparing the next group's requests holds the caller's loop
        return await asyncio.gather(*futures)

    responses = asyncio.run(groups())
    scheduler.request_stop()
    engine.join(5)
    assert all(r.finish_reason == "length" for r in responses)
    assert len(stepper.batches[0]) == 128, [len(b) for b in stepper.batches]


def test_one_submit_many_enters_the_first_step_whole_whatever_the_settle_window():
    """One caller's batch (MegatronInference.agenerate) goes in with one submit_many: the first step holds all of it
    even with no settle window at all, where a stall of the caller between two submit calls could split it."""
    scheduler = LockstepScheduler(True, lambda plan: plan, settle_s=0.0, settle_max_s=0.0)
    stepper = FakeStepper(scheduler)
    scheduler.start()
    engine = threading.Thread(target=lambda: asyncio.run(scheduler.run(stepper)), daemon=True)
    engine.start()
    time.sleep(0.05)  # the engine thread is idle, waiting for work

    async def batch():
        loop = asyncio.get_running_loop()
        return await asyncio.gather(*scheduler.submit_many([(_job([i], max_new_tokens=2), None) for i in range(40)],
                                                           loop))

    responses = asyncio.run(batch())
    scheduler.request_stop()
    engine.join(5)
    assert [r.token_ids for r in responses] == [[i, i, i + 1] for i in range(40)]
    assert len(stepper.batches[0]) == 40, [len(b) for b in stepper.batches]


class CancellableStepper(FakeStepper):
    async def step(self) -> None:
        await super().step()
        await asyncio.sleep(0.001)  # a step takes a moment, as an engine's does

    def cancel(self, seq: int) -> None:
        job, _ = self.running.pop(seq)
        self.scheduler.deliver(job, InferenceResponse.failed("cancelled", job.prompt_text))


def test_a_cancelled_request_is_ended_on_every_rank_at_the_same_step_and_the_others_run_on():
    """The source's caller gives up on one request (its flag, or its future cancelled): the next plan carries it,
    every rank ends it before that step, and the other requests are untouched."""
    group = SimulatedGroup(2)
    steppers = [CancellableStepper(s) for s in group.schedulers]
    threads = group.start(steppers)
    flag = {"gone": False}
    results: dict[int, list[InferenceResponse]] = {}

    def caller(rank: int) -> None:
        async def go():
            loop = asyncio.get_running_loop()
            long = group.schedulers[rank].submit(_job([1], max_new_tokens=10_000), loop, cancelled=lambda: flag["gone"])
            short = group.schedulers[rank].submit(_job([2], max_new_tokens=5), loop)
            dropped = group.schedulers[rank].submit(_job([3], max_new_tokens=10_000), loop)
            if rank == 0:
                while len(steppers[0].batches) < 3:
                    await asyncio.sleep(0.001)
                flag["gone"] = True
                dropped.cancel()  # a caller's task cancelled: its future is
                return [await long, await short]
            return [await long, await short, await dropped]

        results[rank] = asyncio.run(go())

    callers = [threading.Thread(target=caller, args=(r,)) for r in range(2)]
    for c in callers:
        c.start()
    for c in callers:
        c.join(timeout=60)
    group.stop(threads)
    assert steppers[0].batches == steppers[1].batches and len(steppers[0].batches) < 10_000  # ended early
    cancels = [p.cancel for p in group.shared[0] if p.cancel]
    assert cancels == [[0, 2]] and [p.cancel for p in group.shared[1] if p.cancel] == cancels
    for r in range(2):
        long, short = results[r][:2]
        assert long.error == "cancelled" and short.finish_reason == "length" and len(short.generated_token_ids) == 5
    assert results[1][2].error == "cancelled"  # the other rank's caller of the dropped request is answered too
