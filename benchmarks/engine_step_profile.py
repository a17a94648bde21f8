"""Where one engine step goes: a prefill step and a decode step at N requests, split into model work and host work.

The grpo_vs_trl "small" shape (4 layers, hidden 256, 4 heads / 2 KV groups, FFN 688, vocabulary 384, fp32, random
weights) behind ``MegatronInference``, as ``benchmarks/decode_step.py`` builds it. For every N of ``--requests``,
N requests (prompts of 5-20 tokens, T = 1, ``--new-tokens`` each, no end-of-sequence) are generated
``--rounds`` times; the first step that prefills all N prompts and the decode steps with all N rows are measured,
split by phase on the engine thread:

- ``admit``: our scheduler handing queued requests to megatron-core (``add_request`` per request);
- ``context init``: megatron-core's per-step input preparation (``_dynamic_step_context_init``: token and position
  ids, attention metadata);
- ``forward``: the model's forward (megatron-core's modules; the attention kernel is ours on CPU);
- ``sample``: our sampler and the step's log-probs;
- ``bookkeeping``: megatron-core's per-step request bookkeeping (``_dynamic_step_context_bookkeeping``);
- ``engine rest``: the rest of megatron-core's ``async_step`` (scheduling, finished-request records);
- ``ours rest``: the rest of our step (stop checks, handing finished requests back).

Two measures per phase, medians over the measured steps:

- **thread CPU ms** (``time.thread_time`` on the engine thread): what the phase costs, but inflated on a loaded
  machine;
- **load-independent counts**: torch operators dispatched (``TorchDispatchMode``: one per kernel launch on a GPU)
  and Python function calls (``sys.setprofile``), measured in a separate pass so they do not slow the timed one.
  These do not move with the machine's load: use them to compare code changes on a shared machine.

    python benchmarks/engine_step_profile.py [--requests 16 64 128 256] [--new-tokens 8] [--rounds 2]
        [--group-size 8 --prompt-tokens 96 120] [--off share_prompt_prefill batched_admission keep_cpu_kv_buffer packed_weights]
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402
import decode_step as D  # noqa: E402

PHASES = ("admit", "context init", "forward", "sample", "bookkeeping", "engine rest", "ours rest")


class _OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class StepProbe:
    """Wraps the engine's phase methods (class-level, engine thread only) and records one dict per step."""

    def __init__(self):
        self.mode = "time"  # "time" | "count"
        self.steps: list[dict] = []
        self._current: dict | None = None
        self._stack: list[str] = []
        self._calls = 0
        self._ops: _OpCounter | None = None
        self._engine_thread: int | None = None

    # --- measuring
    def _now(self) -> float:
        if self.mode == "time":
            return time.thread_time()
        return float(self._calls * 1_000_000 + (self._ops.count if self._ops else 0))

    def _profile(self, frame, event, arg):
        if event == "call":
            self._calls += 1

    def wrap(self, owner, name: str, phase: str, is_async: bool = False):
        original = getattr(owner, name)
        probe = self

        def enter():
            if probe._current is None:
                return None
            probe._stack.append(phase)
            return probe._now()

        def leave(start):
            if start is None:
                return
            probe._stack.pop()
            spent = probe._now() - start
            probe._current[phase] = probe._current.get(phase, 0.0) + spent
            if probe._stack:  # nested: the outer phase does not count it twice
                outer = probe._stack[-1]
                probe._current[outer] = probe._current.get(outer, 0.0) - spent

        if is_async:
            async def wrapped(*a, **k):
                start = enter()
                try:
                    return await original(*a, **k)
                finally:
                    leave(start)
        else:
            def wrapped(*a, **k):
                start = enter()
                try:
                    return original(*a, **k)
                finally:
                    leave(start)
        setattr(owner, name, wrapped)

    def start(self):
        """Open the record of the next step (at its first admission, or at the step itself)."""
        if self._current is not None:
            return
        self._current = {}
        if self.mode == "count":
            self._calls = 0
            self._ops = _OpCounter()
            self._ops.__enter__()
            sys.setprofile(self._profile)

    def end_step(self):
        if self.mode == "count":
            sys.setprofile(None)
            self._ops.__exit__(None, None, None)
        self.steps.append(self._current)
        self._current = None


def install(probe: StepProbe):
    from megatron.core.inference.engines import DynamicInferenceEngine

    from megatron.rl.inference.engine.build import SamplingController
    from megatron.rl.inference.engine.session import EngineStepper

    probe.wrap(EngineStepper, "add", "admit")
    probe.wrap(SamplingController, "_dynamic_step_context_init", "context init")
    probe.wrap(SamplingController, "_dynamic_step_forward_logits", "forward")
    probe.wrap(SamplingController, "_dynamic_step_sample_logits", "sample")
    probe.wrap(SamplingController, "_dynamic_step_calculate_log_probs", "sample")
    probe.wrap(SamplingController, "_dynamic_step_context_bookkeeping", "bookkeeping")
    probe.wrap(DynamicInferenceEngine, "async_step", "engine rest", is_async=True)
    add, step, init = EngineStepper.add, EngineStepper.step, SamplingController._dynamic_step_context_init

    def probed_init(self):
        # the step's rows: what is active once the step has scheduled the waiting requests
        context = self.inference_wrapped_model.inference_context
        if probe._current is not None:
            probe._current.update(rows=context.total_request_count - context.paused_request_count,
                                  decode=bool(context.is_decode_only()))
        return init(self)

    SamplingController._dynamic_step_context_init = probed_init

    def probed_add(self, job):
        probe.start()
        return add(self, job)

    async def probed_step(self):
        probe.start()
        start = probe._now()
        probe._stack.append("ours rest")
        try:
            return await step(self)
        finally:
            probe._stack.pop()
            probe._current["ours rest"] = probe._current.get("ours rest", 0.0) + probe._now() - start
            probe.end_step()

    EngineStepper.add, EngineStepper.step = probed_add, probed_step


def split(value: float, mode: str) -> tuple[float, float]:
    """(Python calls, torch ops) of a count-mode total; (ms, 0) of a time-mode one."""
    if mode == "time":
        return value * 1e3, 0.0
    calls, ops = divmod(round(value), 1_000_000)
    return float(calls), float(ops)


def run(requests: int, new_tokens: int, rounds: int, backend, tokenizer, probe: StepProbe, group_size: int = 1,
        lengths: tuple[int, int] = (5, 20)) -> dict:
    prompts = D.workload(requests, group_size=group_size, lengths=lengths)
    result = {"phase ms": []}
    for mode in ("time", "count"):
        probe.mode = mode
        records: list[dict] = []
        for _ in range(rounds):
            probe.steps.clear()
            start = time.perf_counter()
            D.run_megatron(backend, tokenizer, [], prompts, new_tokens, requests)
            if mode == "time":  # the whole phase: a shared prompt's followers may prefill in a later step
                result["phase ms"].append((time.perf_counter() - start) * 1e3)
            # admission happens between steps: it is charged to the step that follows it
            records += [s for s in probe.steps if s["rows"] == requests]
        prefill = [s for s in records if not s["decode"]]
        decode = [s for s in records if s["decode"]]
        for kind, steps in (("prefill", prefill[:1] if mode == "count" else prefill), ("decode", decode)):
            if not steps:
                continue
            out = result.setdefault(kind, {})
            for phase in PHASES:
                values = [split(s.get(phase, 0.0), mode) for s in steps]
                if mode == "time":
                    out[phase + " ms"] = statistics.median(v[0] for v in values)
                else:
                    out[phase + " calls"] = statistics.median(v[0] for v in values)
                    out[phase + " ops"] = statistics.median(v[1] for v in values)
            out["steps"] = len(steps)
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[16, 64, 128, 256])
    p.add_argument("--new-tokens", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--group-size", type=int, default=1, help="each prompt submitted this many times (a GRPO group)")
    p.add_argument("--prompt-tokens", type=int, nargs=2, default=[5, 20], metavar=("MIN", "MAX"))
    p.add_argument("--off", nargs="*", default=[], choices=["share_prompt_prefill", "batched_admission",
                                                            "keep_cpu_kv_buffer", "packed_weights"],
                   help="engine features to turn off (EngineSettings fields)")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    settings = None
    if a.off:
        from megatron.rl.inference.engine.build import EngineSettings

        settings = dataclasses.replace(EngineSettings.for_device("cpu"), **{f: False for f in a.off})
    backend, tokenizer, _ = D.build_megatron(settings)
    probe = StepProbe()
    install(probe)
    results = {n: run(n, a.new_tokens, a.rounds, backend, tokenizer, probe, a.group_size, tuple(a.prompt_tokens))
               for n in a.requests}
    print(f"engine step by phase ({D.LAYERS} layers, hidden {D.HIDDEN}, {D.HEADS} heads / {D.KV_GROUPS} KV groups, "
          f"FFN {D.FFN}; {torch.get_num_threads()} threads; medians; prompts of {a.prompt_tokens[0]}-"
          f"{a.prompt_tokens[1]} tokens in groups of {a.group_size}; off: {', '.join(a.off) or 'nothing'})")
    print(C.machine_line())
    print("whole generation (ms, median of rounds): " + ", ".join(
        f"{n} requests {statistics.median(r['phase ms']):.1f}" for n, r in results.items()))
    for kind in ("prefill", "decode"):
        rows = []
        for n, r in results.items():
            if kind not in r:
                continue
            m = r[kind]
            total = [sum(m[f"{ph} {u}"] for ph in PHASES) for u in ("ms", "calls", "ops")]
            host_ms = total[0] - m["forward ms"]
            rows.append([str(n)] + [f"{m[f'{ph} ms']:.2f} / {m[f'{ph} calls']:.0f} / {m[f'{ph} ops']:.0f}"
                                    for ph in PHASES]
                        + [f"{total[0]:.2f} / {total[1]:.0f} / {total[2]:.0f}", f"{host_ms / max(total[0], 1e-9):.0%}"])
        print(C.format_table(["requests", *(f"{ph} (ms / py calls / torch ops)" for ph in PHASES), "step total",
                              "outside forward (share of ms)"], rows, title=f"{kind} step"))
    C.teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
