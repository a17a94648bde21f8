"""The Megatron backend's engine context: eval mode, KV cache and engine thread, from enter to exit.

:class:`EngineSession` ``enter()`` puts the model in eval mode and starts an engine thread, which builds
megatron-core's dynamic engine (allocating the KV cache) and runs the
:class:`~megatron.rl.inference.engine.lockstep.LockstepScheduler` loop over it. ``exit()`` lets in-flight requests
finish, stops the thread, frees the KV cache (the context and its buffers are dropped) and restores the
model's train/eval mode, so training gets its memory back.

:class:`EngineStepper` adapts one live engine to the scheduler: admitting a request (its sampling spec goes
to the controller), stepping, stopping requests early at extra EOS ids and stop strings, and turning
finished records into responses with :func:`megatron.rl.inference.stopping.finish_response`.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from typing import Any, Callable

import copy
import torch

from megatron.rl.inference.api import CANCELLED, InferenceError, InferenceResponse
from megatron.rl.inference.engine.construct import free_context
from megatron.rl.inference.engine.build import EngineSettings, EngineTokenizer, SampleSpec, build_engine
from megatron.rl.inference.engine.lockstep import Job, LockstepScheduler
from megatron.rl.inference.engine.shared_prefill import forget_shared_prompts
from megatron.rl.inference.stopping import completes_stop, finish_response
from megatron.rl.runtime.cpu_threads import follow as follow_thread_budget
from megatron.rl.runtime import packed_linear, setup_runtime
from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode
from megatron.rl.runtime.packed_linear import PackedWeights
from megatron.rl.runtime.torch_attention import release_thread_buffers

log = logging.getLogger(__name__)

__all__ = ["EosIds", "PolicyVersion", "EngineSession", "EngineStepper"]


@dataclasses.dataclass
class PolicyVersion:
    """The version (trainer iteration) of the weights generating now; responses carry it per token once tracked."""

    current: int = 0
    tracked: bool = False


@dataclasses.dataclass(frozen=True)
class EosIds:
    """The tokenizer's end-of-sequence ids: the engine stops at ``termination``; the others we stop ourselves."""

    termination: int
    extra: frozenset[int]
    all: frozenset[int]

    @classmethod
    def of(cls, tokenizer: Any) -> "EosIds":
        eod = getattr(tokenizer, "eod", None)
        eos = set(getattr(tokenizer, "eos_token_ids", None) or ([] if eod is None else [eod]))
        termination = eod if eod in eos else (min(eos) if eos else -1)
        return cls(termination, frozenset(eos - {termination}), frozenset(eos))


class EngineStepper:
    """One live engine + controller, driven by the scheduler's loop (the ``Stepper`` protocol)."""

    def __init__(self, engine: Any, controller: Any, scheduler: LockstepScheduler, tokenizer: EngineTokenizer,
                 eos: EosIds, device_mode: Callable[[], Any], version: PolicyVersion,
                 packs: PackedWeights | None = None):
        self.engine = engine
        self.controller = controller
        self._scheduler = scheduler
        self._tokenizer = tokenizer
        self._eos = eos
        self._device_mode = device_mode
        self._version = version
        self._jobs: dict[int, Job] = {}
        # (policy version, generated tokens before it) per request: where the weights changed under it
        self._version_marks: dict[int, list[tuple[int, int]]] = {}
        self._cancelled: set[int] = set()  # ended by cancel(): answered CANCELLED when the engine finishes them
        self.packs = packs  # the engine thread's packed weights (runtime.packed_linear), dropped when they change

    def has_unfinished(self) -> bool:
        return self.engine.has_unfinished_requests()

    def add(self, job: Job) -> None:
        engine, controller = self.engine, self.controller
        generator = None
        if job.seed is not None and job.temperature > 0:
            generator = controller.make_generator(job.seed)
        controller.specs[job.seq] = SampleSpec(job.temperature, job.top_k, job.top_p, generator)
        self._jobs[job.seq] = job
        self._version_marks[job.seq] = [(self._version.current, 0)]
        if controller.route_recorder is not None:
            controller.route_recorder.begin(job.seq, len(job.prompt_ids) + 1)
        # The engine does not sample (SamplingController does); it only needs lengths, the EOS id and
        # one log-prob slot per generated token.
        params = _scalar_sampling_params()(temperature=1.0, top_k=0, top_p=0.0, return_log_probs=True,
                                skip_prompt_log_probs=True, num_tokens_to_generate=job.max_new_tokens,
                                termination_id=self._eos.termination)
        with self._device_mode():
            engine.add_request(job.seq, list(job.prompt_ids), params)
        if job.seq in engine.failed_request_ids:  # rejected at once: never stepped, so report it here
            engine.failed_request_ids.remove(job.seq)
            entry = engine.requests.pop(job.seq)
            self._scheduler.deliver_many([self._finish(entry.record)])

    async def step(self) -> None:
        follow_thread_budget()  # this thread's torch thread count follows the trainer's (other processes' load)
        result = await self.engine.async_step()
        # one hand-over for the step's finished requests: each wake-up of a caller's loop is a write to its pipe
        self._scheduler.deliver_many([self._finish(record) for record in result["finished_request_records"]])
        for rid in result["active_request_ids"]:
            if self._should_stop_early(self._jobs[rid], rid):
                self.engine.stop_word_finished_request_ids.add(rid)

    def cancel(self, seq: int) -> None:
        """End request ``seq`` (its caller left): a waiting one leaves the engine's queue now, an active one finishes
        at the next step (the engine's stop-word path), freeing its KV blocks; either is answered CANCELLED."""
        engine = self.engine
        if seq not in self._jobs:
            return  # finished already
        self._cancelled.add(seq)
        if seq in engine.waiting_request_ids and engine.context.chunked_prefill_request_id != seq:
            engine.waiting_request_ids.remove(seq)  # never scheduled (or evicted): no KV blocks to release
            self._scheduler.deliver_many([self._finish(engine.requests.pop(seq).record)])
        else:
            engine.stop_word_finished_request_ids.add(seq)

    def resumed(self) -> None:
        """Record, for every request in flight, that its tokens from here on are the current version's; requests
        admitted from here on share no prompt KV cached before the pause (the old weights')."""
        forget_shared_prompts(self.engine.context)
        if self.packs is not None:  # packed for the old weights
            self.packs.clear()
        for rid in self._jobs:
            entry = self.engine.requests.get(rid)
            if entry is not None:
                done = sum(len(r.generated_tokens) for r in entry.record.requests)
                self._version_marks[rid].append((self._version.current, done))

    def _finish(self, record: Any) -> tuple[Job, InferenceResponse]:
        """The job of a finished engine record and its response (delivered by the caller)."""
        from megatron.core.inference.inference_request import Status

        job = self._jobs.pop(record.request_id)
        marks = self._version_marks.pop(record.request_id)
        self.controller.specs.pop(record.request_id, None)
        recorder = self.controller.route_recorder
        if record.request_id in self._cancelled:
            self._cancelled.discard(record.request_id)
            if recorder is not None:
                recorder.drop(record.request_id)
            response = InferenceResponse.failed(CANCELLED, job.prompt_text)
        elif record.requests[-1].status == Status.FAILED:
            if recorder is not None:
                recorder.drop(record.request_id)
            reasons = [type(ev.payload).__name__ for r in record.requests for ev in r.events if ev.payload is not None]
            response = InferenceResponse.failed(
                f"the inference engine rejected this request ({', '.join(reasons) or 'no reason given'}); "
                f"prompt {len(job.prompt_ids)} tokens, max_tokens {job.max_new_tokens}", job.prompt_text)
        else:
            tokens = [int(t) for r in record.requests for t in r.generated_tokens]
            log_probs = [float(x) for r in record.requests for x in (r.generated_log_probs or [])]
            response = finish_response(job.prompt_ids, tokens, log_probs[:len(tokens)], eos_ids=self._eos.all,
                                       stops=job.stop, detokenize=self._tokenizer.detokenize,
                                       prompt_text=job.prompt_text)
            if self._version.tracked:  # asynchronous rollouts: the version of each token (marks are in order)
                response.policy_versions = [[v for v, start in marks if start <= i][-1]
                                            for i in range(len(response.generated_token_ids))]
            if recorder is not None:  # the MoE routes of every token (-1 for the last, never run through the model)
                response.routes = recorder.finish(record.request_id, len(response.token_ids))
        return job, response

    def _should_stop_early(self, job: Job, rid: int) -> bool:
        """After a step: did this request just sample a non-primary EOS id or complete a stop string?"""
        if not job.stop and not self._eos.extra:
            return False
        record = self.engine.requests[rid].record
        last = record.requests[-1].generated_tokens
        if last and last[-1] in self._eos.extra:
            return True
        if job.stop:
            triggers = self._tokenizer.stop_triggers(job.stop)
            if triggers is not None and last and last[-1] not in triggers:
                return False  # the newest token cannot complete a stop string: no detokenization
            tokens = [t for r in record.requests for t in r.generated_tokens]
            return completes_stop(tokens, job.stop, self._eos.all, self._tokenizer.detokenize, tail_only=True)
        return False


_SCALAR_PARAMS: list[type] = []


def _scalar_sampling_params() -> type:
    """megatron-core's ``SamplingParams`` for requests that set only scalar fields (no ``stop_words``).

    Every request deep-copies its ``SamplingParams`` on creation; a deep copy of a dataclass of scalars walks
    ~30 objects through ``copy.deepcopy`` (~0.1 ms of a ~0.3 ms admission), where a shallow copy is the same.
    """
    if not _SCALAR_PARAMS:

        from megatron.core.inference.sampling_params import SamplingParams

        class ScalarSamplingParams(SamplingParams):
            def __deepcopy__(self, memo: dict) -> "ScalarSamplingParams":
                assert not self.stop_words, "stop words are a list: use SamplingParams"
                return copy.copy(self)

        _SCALAR_PARAMS.append(ScalarSamplingParams)
    return _SCALAR_PARAMS[0]


class EngineSession:
    """Enter/exit of inference mode for one model: the engine thread, the KV cache and the model's train mode.

    ``build`` arguments (settings, max_sequence_length, pg_collection) go to
    :func:`~megatron.rl.inference.engine.build.build_engine` each time the session is entered.
    """

    def __init__(self, model: Any, gpt: torch.nn.Module, tokenizer: EngineTokenizer, eos: EosIds,
                 settings: EngineSettings, max_sequence_length: int, pg_collection: Any,
                 scheduler: LockstepScheduler, device: torch.device, cpu_layer: bool,
                 version: PolicyVersion | None = None):
        self.model = model
        self._gpt = gpt
        self._tokenizer = tokenizer
        self._eos = eos
        self.settings = settings
        self.max_sequence_length = max_sequence_length
        self._pg_collection = pg_collection
        self._scheduler = scheduler
        self._device = device
        self._cpu_layer = cpu_layer
        self.version = version or PolicyVersion()
        self._lock = threading.Lock()
        self.thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._start_error: BaseException | None = None
        self.failed = False  # the engine failed: the next request restarts it
        self._was_training = False
        # the live engine objects while entered (None otherwise)
        self.engine: Any = None
        self.context: Any = None
        self.controller: Any = None

    @property
    def active(self) -> bool:
        return self.thread is not None

    def enter(self) -> None:
        """eval(), start the engine thread (which allocates the KV cache). No-op when already active."""
        with self._lock:
            if self.thread is not None:
                return
            self.set_eval()
            self._ready.clear()
            self._start_error = None
            self._scheduler.start()
            self.thread = threading.Thread(target=self._thread_main, name="megatron-inference", daemon=True)
            self.thread.start()
        self._ready.wait()
        if self._start_error is not None:
            error, self._start_error = self._start_error, None
            self.thread.join()
            with self._lock:
                self.thread = None
            # what a concurrent caller submitted while the engine was being built
            self._scheduler.fail_queued(f"the inference engine failed to start: {error!r}")
            self.restore_train_mode()
            raise InferenceError(f"could not start the megatron-core inference engine: {error!r}") from error

    def exit(self) -> None:
        """Finish in-flight requests, stop the engine thread, free the KV cache, restore train mode.

        Collective over the lockstep group. No-op when not active.
        """
        with self._lock:
            thread = self.thread
            if thread is None:
                return
        self._scheduler.request_stop()
        thread.join()
        with self._lock:
            self.thread = None
            self.failed = False
        self._scheduler.stopped("inference mode was exited before this request finished")
        self.engine = self.context = self.controller = None
        self.restore_train_mode()

    def set_eval(self) -> None:
        self._was_training = self._gpt.training
        set_training(self.model, False)

    def restore_train_mode(self) -> None:
        if self._was_training:
            set_training(self.model, True)

    # ------------------------------------------------------------------ engine thread

    def _thread_main(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)  # the current CUDA device is per thread: use this rank's GPU
        if self._cpu_layer and not self.settings.cpu_fast_steps:
            setup_runtime()  # the CPU layer's device mode is thread-local: enter it for everything this thread runs
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        try:
            loop.run_until_complete(self._serve())
        finally:
            asyncio.set_event_loop(None)
            loop.close()

    async def _serve(self) -> None:
        try:
            with self._device_mode():
                engine, context, controller = build_engine(self.model, self._tokenizer, self.settings,
                                                           self.max_sequence_length, self._pg_collection)
        except BaseException as e:  # reported by enter()
            log.exception("building the megatron-core inference engine failed")
            self._start_error = e
            self._ready.set()
            return
        self.engine, self.context, self.controller = engine, context, controller
        self._ready.set()
        with packed_linear.packing(self.settings.packed_weights and self._device.type == "cpu") as packs:
            stepper = EngineStepper(engine, controller, self._scheduler, self._tokenizer, self._eos,
                                    self._device_mode, self.version, packs)
            try:
                await self._scheduler.run(stepper)
            except BaseException as e:
                log.exception("the megatron-core inference engine failed")
                self.failed = True  # before any caller hears of it, so its next call restarts the engine
                self._scheduler.abort(f"inference engine failed: {e!r}")
            finally:
                await _settle_engine_tasks()
                free_context(context)  # frees the KV cache even if something still holds the context
                release_thread_buffers()  # the attention's gather buffers go to the next phase's engine thread
                self.engine = self.context = self.controller = None
                drop_engine_objects(engine, controller, context, stepper)
                del engine, context, controller, stepper

    def _device_mode(self):
        """With ``cpu_fast_steps``: the CPU layer's device-rewriting mode, for construction and admission only.

        Engine steps then run without it (the mode costs a Python dispatch per torch call, about a third of a
        decode step of a small model); the step path only meets device helpers the layer patches globally
        (``torch.cuda.current_device``, streams, events). Admission and construction allocate with
        ``pin_memory=True`` / CUDA device literals, which need the mode.
        """
        if self._cpu_layer and self.settings.cpu_fast_steps:

            return CudaToCpuMode()
        return contextlib.nullcontext()


async def _settle_engine_tasks() -> None:
    """Let the tasks megatron-core scheduled on the engine's loop finish before its objects are emptied.

    Admitting a request schedules a task that notifies the engine's condition variable
    (``call_soon_threadsafe(create_task, ...)``); the last step's ones were still pending when the loop stopped,
    and ran on an engine whose attributes :func:`drop_engine_objects` had cleared ("no attribute '_cond'").
    """
    await asyncio.sleep(0)  # the scheduled callbacks create their tasks
    pending = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    if pending:
        await asyncio.wait(pending, timeout=1.0)


def drop_engine_objects(engine: Any, controller: Any, context: Any, *others: Any) -> None:
    """Empty the attribute dicts of a stopped engine's objects (engine, controller, context, model wrapper).

    megatron-core's engine and controller reference each other (bound-method callbacks, closures), so
    without this they and everything they hold (the context, sampling buffers, the wrapper) live until the
    cyclic garbage collector runs; a full ``gc.collect()`` here cost ~0.2 s per rollout phase. Emptying the
    dicts breaks every cycle through them at once. The objects are never used again.
    """
    wrapper = getattr(controller, "inference_wrapped_model", None)
    for obj in (engine, controller, context, wrapper, *others):
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict) and not isinstance(obj, torch.nn.Module):
            state.clear()


def set_training(model: Any, training: bool) -> None:
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        chunk.train(training)
