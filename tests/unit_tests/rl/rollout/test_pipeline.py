"""RolloutPipeline with a fake backend: ordering (G vs B), lag bound, drain, cancellation, no group lost or
duplicated over 1,000 random schedules, per-token policy versions with partial rollouts."""
from __future__ import annotations

import asyncio
import random

import pytest

from megatron.rl.inference.api import InferenceRequest, InferenceResponse, InferenceInterface
from megatron.rl.rollout.pipeline import (VERSIONS_KEY, AsyncRolloutConfig, PhaseControl, RequestGate,
                                          RolloutPipeline)
from megatron.rl.base.types import RolloutGroup, TokenRollout


class FakeBackend:
    """Generates a group token by token; each token takes a random number of event-loop turns and records the
    pipeline's policy version when it is produced (the loop only runs while the pipeline generates, like the
    in-process engine, which is paused during updates)."""

    def __init__(self, rng: random.Random, group_size: int = 2, max_tokens: int = 6, max_turns_per_token: int = 4,
                 lengths: dict[int, int] | None = None):
        self.rng = rng
        self.group_size = group_size
        self.max_tokens = max_tokens
        self.max_turns = max_turns_per_token
        self.lengths = lengths  # scripted lengths by group draw order
        self.pipeline: RolloutPipeline | None = None
        self.drawn = 0
        self.calls: list[tuple[int, int]] = []
        self.cancelled = 0
        self.running = 0
        self.peak_running = 0

    async def produce(self, batch: int, num_groups: int):
        self.calls.append((batch, num_groups))
        draws = list(range(self.drawn, self.drawn + num_groups))
        self.drawn += num_groups
        return await asyncio.gather(*(self._group(d) for d in draws))

    async def _group(self, draw: int) -> RolloutGroup:
        self.running += 1
        self.peak_running = max(self.peak_running, self.running)
        try:
            n = self.lengths[draw] if self.lengths else self.rng.randint(1, self.max_tokens)
            versions = []
            for _ in range(n):
                for _ in range(self.lengths and 1 or self.rng.randint(1, self.max_turns)):
                    await asyncio.sleep(0)
                versions.append(self.pipeline.version)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        # model_construct: no validation (thousands of schedules; the fields are right by construction)
        rollouts = [TokenRollout.model_construct(prompt=f"p{draw}", completion="x", reward=float(i), env_id="fake",
                                                 problem_id=str(draw), token_ids=[1] * (2 + n), status="ok",
                                                 generation_mask=[0, 0] + [1] * n, prompt_length=2,
                                                 metadata={VERSIONS_KEY: [-1, -1] + versions})
                    for i in range(self.group_size)]
        return RolloutGroup.model_construct(rollouts=rollouts, env_id="fake", problem_id=str(draw))


class RecordingControl(PhaseControl):
    def __init__(self):
        self.events: list[tuple] = []

    def start(self, version):
        self.events.append(("start", version))

    def stop(self, drained):
        self.events.append(("stop", drained))

    def close(self):
        self.events.append(("close",))


def _pipeline(backend: FakeBackend, P: int, control=None, **cfg) -> RolloutPipeline:
    p = RolloutPipeline(backend.produce, AsyncRolloutConfig(**cfg), groups_per_step=P,
                        group_size=backend.group_size, control=control)
    backend.pipeline = p
    return p


def _draw(fg) -> int:
    return int(fg.group.problem_id)


# ----------------------------------------------------------------------------------------------- ordering


def test_b_consumes_batches_in_submission_order_g_as_they_finish():
    # batch 0 = draws 0, 1 (slow), batch 1 = draws 2, 3 (fast); lag 1 puts both batches in flight at once.
    lengths = {0: 20, 1: 20, 2: 1, 3: 1, 4: 1, 5: 1, 6: 1, 7: 1}
    b = FakeBackend(random.Random(0), lengths=lengths)
    pipe = _pipeline(b, 2, generation_lag=1, consumption_granularity="B", submission_granularity="G")
    got = pipe.next_batch()
    assert [_draw(f) for f in got] == [0, 1] and [f.ticket.index for f in got] == [0, 1]
    pipe.advance()
    assert [_draw(f) for f in pipe.next_batch()] == [2, 3]
    pipe.close()

    b = FakeBackend(random.Random(0), lengths=lengths)
    pipe = _pipeline(b, 2, generation_lag=1, consumption_granularity="G", submission_granularity="G")
    assert sorted(_draw(f) for f in pipe.next_batch()) == [2, 3]  # the fast ones, not in submission order
    pipe.advance()
    # version 1: draws 0 and 1 are due (submitted at 0, lag 1): waited for even though 4, 5 are faster
    assert sorted(_draw(f) for f in pipe.next_batch()) == [0, 1]
    pipe.close()


def test_lag_zero_b_is_one_agent_call_per_iteration_with_the_iteration_as_batch():
    b = FakeBackend(random.Random(1), group_size=3)
    pipe = _pipeline(b, 4, submission_granularity="B")
    for it in range(3):
        got = pipe.next_batch()
        assert [_draw(f) for f in got] == list(range(4 * it, 4 * it + 4))
        assert not pipe.inflight and not pipe.finished  # lag 0: nothing ahead, nothing left
        pipe.advance()
    assert b.calls == [(0, 4), (1, 4), (2, 4)]
    pipe.close()


# ----------------------------------------------------------------------------------------------- drain / partial


def test_without_partial_rollouts_the_pipeline_drains_before_each_update():
    control = RecordingControl()
    b = FakeBackend(random.Random(2), max_tokens=12)
    pipe = _pipeline(b, 3, control=control, generation_lag=2, consumption_granularity="G",
                     submission_granularity="G")
    for _ in range(5):
        got = pipe.next_batch()
        assert not pipe.inflight, "groups still in flight at an update"
        for f in got:  # drained: every token was generated by the version that submitted the group
            for r in f.group.rollouts:
                assert set(r.metadata[VERSIONS_KEY][2:]) == {f.ticket.version}
        pipe.advance()
    pipe.close()
    assert control.events[:2] == [("start", 0), ("stop", True)]
    assert all(e == ("stop", True) for e in control.events if e[0] == "stop")


def test_partial_rollouts_continue_across_updates_with_the_new_version():
    control = RecordingControl()
    b = FakeBackend(random.Random(3), max_tokens=12)
    pipe = _pipeline(b, 2, control=control, generation_lag=1, partial_rollouts=True, consumption_granularity="G",
                     submission_granularity="G")
    spanning = 0
    for _ in range(8):
        got = pipe.next_batch()
        for f in got:
            vs = set(f.group.rollouts[0].metadata[VERSIONS_KEY][2:])
            assert min(vs) >= f.ticket.version and max(vs) <= pipe.version
            spanning += len(vs) > 1
        pipe.advance()
    assert spanning > 0, "no group continued across an update"
    assert all(e == ("stop", False) for e in control.events if e[0] == "stop")  # paused, never stopped
    pipe.close()


# ----------------------------------------------------------------------------------------------- shutdown


def test_close_cancels_in_flight_groups_and_returns_what_was_never_trained():
    control = RecordingControl()
    b = FakeBackend(random.Random(4), max_tokens=30)
    pipe = _pipeline(b, 2, control=control, generation_lag=2, partial_rollouts=True, submission_granularity="G",
                     consumption_granularity="G")
    trained = {f.ticket.uid for f in pipe.next_batch()}
    inflight = len(pipe.inflight)
    assert inflight > 0
    left = pipe.close()
    assert b.cancelled == inflight and b.running == 0
    assert {t.uid for t in left}.isdisjoint(trained) and len(left) == 4  # (lag + 1) x P - P outstanding
    assert control.events[-1] == ("close",)
    with pytest.raises(RuntimeError, match="closed"):
        pipe.next_batch()


def test_agent_error_is_raised_from_next_batch():
    async def produce(batch, n):
        raise ValueError("environment down")

    pipe = RolloutPipeline(produce, AsyncRolloutConfig(generation_lag=1), groups_per_step=2, group_size=2)
    with pytest.raises(ValueError, match="environment down"):
        pipe.next_batch()
    pipe.close()


# ----------------------------------------------------------------------------------------------- random schedules


def _random_config(rng: random.Random) -> tuple[dict, int]:
    P = rng.randint(1, 4)
    cfg = dict(generation_lag=rng.randint(0, 3), partial_rollouts=rng.random() < 0.5,
               submission_granularity=rng.choice("RGB"), consumption_granularity=rng.choice("GB"))
    if rng.random() < 0.4 and cfg["submission_granularity"] == "G":
        cfg["max_inflight_requests"] = rng.randint(1, 6)  # group_size 1: 1..6 groups
    return cfg, P


def test_no_group_lost_or_duplicated_and_lag_bound_holds_over_1000_random_schedules():
    seen_partial_span = seen_g_reorder = 0
    for seed in range(1000):
        rng = random.Random(seed)
        cfg, P = _random_config(rng)
        b = FakeBackend(rng, group_size=1, max_tokens=rng.randint(1, 6), max_turns_per_token=2)
        pipe = _pipeline(b, P, **cfg)
        lag, iters = cfg["generation_lag"], rng.randint(1, 5)
        trained: list[str] = []
        for v in range(iters):
            got = pipe.next_batch()
            assert len(got) == P, (seed, cfg)
            outstanding = pipe.outstanding()
            assert len(outstanding) <= (lag + 1) * P, (seed, cfg)
            for f in got:
                assert 0 <= v - f.ticket.version <= lag, ("lag bound", seed, cfg, v, f.ticket)
                vs = f.group.rollouts[0].metadata[VERSIONS_KEY][2:]
                assert all(f.ticket.version <= x <= v for x in vs), (seed, cfg)
                if not cfg["partial_rollouts"]:
                    assert set(vs) == {f.ticket.version}, (seed, cfg)
                seen_partial_span += len(set(vs)) > 1
            if cfg["consumption_granularity"] == "B":
                assert [f.ticket.index for f in got] == list(range(v * P, (v + 1) * P)), (seed, cfg)
            else:
                seen_g_reorder += [f.ticket.index for f in got] != sorted(f.ticket.index for f in got)
            if not cfg["partial_rollouts"]:
                assert not pipe.inflight, (seed, cfg)
            if cfg.get("max_inflight_requests"):
                assert b.peak_running <= cfg["max_inflight_requests"], (seed, cfg)
            trained += [f.ticket.uid for f in got]
            pipe.advance()
        left = [t.uid for t in pipe.close()]
        submitted = [f"g{i}" for i in range(b.drawn)]
        assert len(trained) == len(set(trained)), ("duplicated", seed, cfg)
        assert sorted(trained + left) == sorted(submitted), ("lost", seed, cfg)
        assert b.running == 0, (seed, cfg)
    assert seen_partial_span > 0 and seen_g_reorder > 0  # the schedules did exercise both


# ----------------------------------------------------------------------------------------------- request gate


class _SlowInner(InferenceInterface):
    def __init__(self):
        self.running = 0
        self.peak = 0

    async def agenerate(self, requests):
        n = sum(r.generation_args.n for r in requests)
        self.running += n
        self.peak = max(self.peak, self.running)
        for _ in range(3):
            await asyncio.sleep(0)
        self.running -= n
        return [InferenceResponse(text="a", token_ids=[1, 2], prompt_length=1, finish_reason="stop")] * n


def test_request_gate_caps_requests_in_the_backend():
    inner = _SlowInner()
    gate = RequestGate(inner, max_requests=5)

    async def main():
        reqs = [[InferenceRequest(prompt="x", generation_args={"n": n})] for n in (2, 2, 2, 3, 1, 4)]
        return await asyncio.gather(*(gate.agenerate(r) for r in reqs))

    out = asyncio.run(main())
    assert [len(o) for o in out] == [2, 2, 2, 3, 1, 4]
    assert inner.peak <= 5 and gate.peak <= 5 and gate.in_use == 0
    assert inner.peak >= 4  # it did run requests concurrently
