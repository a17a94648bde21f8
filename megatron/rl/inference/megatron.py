"""The default inference backend: megatron-core's dynamic engine around the training model itself.

``MegatronInference(model, tokenizer)`` serves :class:`~megatron.rl.inference.api.InferenceRequest` s
with megatron-core's ``DynamicInferenceEngine`` (paged KV cache, continuous batching) running the
*training* model's weights in place: no copy, no refit when training and inference are colocated.

Inference mode
    ``enter_inference_mode()`` puts the model in eval mode, allocates the engine's KV cache and starts
    an engine thread; ``exit_inference_mode()`` waits for in-flight requests, stops the thread, frees
    the KV cache (the context and its buffers are dropped) and restores the model's train/eval mode,
    so training gets its memory back. ``agenerate`` enters inference mode by itself when needed;
    ``with backend.inference_mode(): ...`` brackets a rollout phase. Never train while it is active.

Batching
    Every request submitted (from any coroutine, thread or event loop) goes to one queue; the engine
    thread adds everything queued before each step, so requests arriving while a batch runs join it at
    the next step. Many concurrent ``agenerate`` calls therefore share batches.

Model parallelism (TP / PP / EP)
    All ranks whose forward passes communicate (the union of the tensor-, pipeline- and
    expert-parallel groups; "the lockstep group") must run the same engine steps on the same requests.
    Every rank of a lockstep group calls ``agenerate`` with the same requests in the same order (e.g.
    each runs the same agents on the same data); the group's lowest rank is the *source*: before each
    step it broadcasts which requests join (tokens and sampling settings) over a dedicated gloo group,
    and every rank adds exactly those, so batches agree even when the ranks' calls arrive at different
    times. Sampling happens on every rank from identical gathered logits with identically seeded
    generators, so every rank returns identical responses. The i-th request submitted on a non-source
    rank is matched to the source's i-th; a non-source request whose prompt differs from the source's
    gets an error response instead of someone else's completion. With expert parallelism the lockstep
    group spans the EP ranks too, so they all serve the source's requests. ``exit_inference_mode`` is
    collective over the lockstep group. Pure data-parallel ranks are independent.

Log-probs and sampling
    See :mod:`megatron.rl.inference.megatron_sampling`: tokens are sampled by us (temperature, top-k,
    top-p, per-request seeds) and ``logprobs`` are under ``softmax(logits / T)`` before truncation
    (T = 1 for greedy), which equals a teacher-forced training forward at that temperature.

Lengths
    A prompt that leaves no room for one generated token within ``max_sequence_length`` (or an empty
    one) is a per-request error; otherwise ``max_tokens`` is clamped to the room left and such a
    request ends with ``finish_reason="length"``.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from pydantic import ValidationError

from megatron.rl.inference.api import (
    GenerationArgs,
    InferenceError,
    InferenceInterface,
    InferenceRequest,
    InferenceResponse,
    expand_checked,
)
from megatron.rl.inference.chat_template import render_chat
from megatron.rl.inference.megatron_engine import (
    EngineSettings,
    EngineTokenizer,
    SampleSpec,
    build_engine,
    unwrap_gpt_model,
)
from megatron.rl.runtime import setup_runtime
from megatron.rl.runtime.openmp import release_thread_pool

log = logging.getLogger(__name__)

__all__ = ["MegatronInference", "EngineSettings"]

# The source re-broadcasts an empty plan this often while idle, so waiting ranks never hit the
# process group's collective timeout.
_IDLE_HEARTBEAT_S = 5.0


@dataclasses.dataclass
class _Job:
    """One single-sample request on its way to the engine (what the source broadcasts)."""

    seq: int
    prompt_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int | None
    stop: list[str]
    prompt_text: str
    # (policy version, generated tokens before it): where the weights changed under this request
    version_marks: list[tuple[int, int]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Plan:
    jobs: list[_Job]
    stop: bool
    pause: bool = False  # partial rollouts: hold every request (no step) until resumed


@dataclasses.dataclass
class _Waiter:
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    job: _Job


class _RequestError(ValueError):
    pass


@InferenceInterface.register("megatron")
class MegatronInference(InferenceInterface):
    """In-process megatron-core dynamic-engine backend over the training model.

    Args:
        model: the training GPTModel (or a one-element list of model chunks; DDP / Float16Module
            wrappers are fine). Its parameters are used in place.
        tokenizer: a :class:`megatron.rl.training.tokenizer.Tokenizer` (tokenize, detokenize, offsets,
            vocab_size, eod, optional eos_token_ids / apply_chat_template).
        settings: KV-cache and batch sizes; default :meth:`EngineSettings.for_device`.
        max_sequence_length: prompt + generated tokens per request; default the model's
            ``max_sequence_length``.
        process_groups: for an inference copy with its own layout, its
            :class:`~megatron.rl.inference_layout.InferenceGroups` (process groups, lockstep group and
            source); None = the training layout from megatron-core's ``parallel_state``.

    ``torch.distributed`` and megatron-core's ``parallel_state`` must be initialised (one process
    is fine). Construction is collective over all ranks when the world has more than one rank.
    """

    def __init__(self, model: Any, tokenizer: Any, settings: EngineSettings | None = None,
                 max_sequence_length: int | None = None, process_groups: Any = None):
        runtime = setup_runtime()
        self._cpu_layer = runtime.cpu_layer_active
        self._device = runtime.device
        if not dist.is_initialized():
            raise InferenceError("MegatronInference needs torch.distributed and megatron-core parallel_state "
                                 "initialised (call megatron.rl.training.initialize.initialize_megatron first)")
        self.model = model
        self._gpt = unwrap_gpt_model(model)
        self.tokenizer = tokenizer
        self._engine_tokenizer = EngineTokenizer(tokenizer)
        self.settings = settings or EngineSettings.for_device(runtime.device)
        self.max_sequence_length = int(max_sequence_length or self.settings.max_sequence_length
                                       or self._gpt.max_sequence_length)
        eod = getattr(tokenizer, "eod", None)
        eos = set(getattr(tokenizer, "eos_token_ids", None) or ([] if eod is None else [eod]))
        self._termination_id = eod if eod in eos else (min(eos) if eos else -1)
        self._extra_eos = eos - {self._termination_id}
        self._eos = eos
        self._pg_collection = getattr(process_groups, "pg_collection", None)
        if process_groups is None:
            self._group, self._source, self._group_size = _lockstep_group()
        else:
            self._group, self._source = process_groups.lockstep_group, process_groups.lockstep_source
            self._group_size = 1 if self._group is None else dist.get_world_size(self._group)
        self._is_source = dist.get_rank() == self._source

        self._lock = threading.Condition()
        self._next_seq = 0
        self._queue: list[_Job] = []  # source only: submitted, not yet broadcast
        self._waiters: dict[int, _Waiter] = {}
        self._early: dict[int, tuple[_Job, InferenceResponse]] = {}  # non-source: finished before submitted
        self._stop_requested = False
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._worker_error: BaseException | None = None
        self._worker_failed = False
        self._was_training = False
        self._live: dict[str, Any] = {}  # engine, context, controller while in inference mode
        # Asynchronous partial rollouts: the engine holds its requests (and their KV cache) while the trainer
        # updates the weights in place; tokens after the resume are by the new policy version.
        self.policy_version = 0
        self._track_versions = False  # responses carry policy_versions once a trainer sets versions
        self._pause_requested = False
        self._paused = threading.Event()
        self.engine_steps = 0  # engine steps run since construction (a batching diagnostic)

    @classmethod
    def from_cli(cls, argv: list[str]) -> "MegatronInference":
        """Serve a checkpoint: ``argv`` are training flags with ``--load`` (see :mod:`.megatron_checkpoint`)."""
        from megatron.rl.inference.megatron_checkpoint import megatron_backend_from_cli

        return megatron_backend_from_cli(argv)

    # ------------------------------------------------------------------ inference mode

    @property
    def active(self) -> bool:
        return self._thread is not None

    @property
    def context(self):
        """The live ``DynamicInferenceContext`` (holds the KV cache), or None outside inference mode."""
        return self._live.get("context")

    def enter_inference_mode(self) -> None:
        """eval(), allocate the KV cache and start the engine thread. No-op when already active."""
        with self._lock:
            if self._thread is not None:
                return
            self._was_training = self._gpt.training
            _set_training(self.model, False)
            self._ready.clear()
            self._worker_error = None
            self._stop_requested = False
            self._thread = threading.Thread(target=self._worker_main, name="megatron-inference", daemon=True)
            self._thread.start()
        self._ready.wait()
        if self._worker_error is not None:
            error, self._worker_error = self._worker_error, None
            self._thread.join()
            with self._lock:
                self._thread = None
                stranded = [self._waiters.pop(job.seq) for job in self._queue if job.seq in self._waiters]
                self._queue = []
            for waiter in stranded:  # submitted by a concurrent caller while the engine was being built
                _resolve(waiter, InferenceResponse.failed(f"the inference engine failed to start: {error!r}",
                                                          waiter.job.prompt_text))
            self._restore_train_mode()
            raise InferenceError(f"could not start the megatron-core inference engine: {error!r}") from error

    def exit_inference_mode(self) -> None:
        """Finish in-flight requests, stop the engine thread, free the KV cache, restore train mode.

        Collective over the lockstep group (see the module docstring). No-op when not active.
        """
        with self._lock:
            thread = self._thread
            if thread is None:
                return
            self._stop_requested = True
            self._pause_requested = False
            self._lock.notify_all()
        thread.join()
        with self._lock:
            self._thread = None
            self._stop_requested = False
            self._worker_failed = False
            leftovers = list(self._waiters.items())
            self._waiters.clear()
            self._early.clear()
        for seq, waiter in leftovers:
            _resolve(waiter, InferenceResponse.failed("inference mode was exited before this request finished",
                                                      waiter.job.prompt_text))
        self._live.clear()
        self._restore_train_mode()

    @contextlib.contextmanager
    def inference_mode(self) -> Iterator["MegatronInference"]:
        """``with backend.inference_mode(): ...`` = enter, then exit on the way out."""
        self.enter_inference_mode()
        try:
            yield self
        finally:
            self.exit_inference_mode()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.exit_inference_mode)

    # ------------------------------------------------------------------ pause (asynchronous partial rollouts)

    def set_policy_version(self, version: int) -> None:
        """The version of the weights generating from now on (recorded per token in ``policy_versions``)."""
        self.policy_version = int(version)
        self._track_versions = True

    def pause_generation(self) -> None:
        """Hold every in-flight request after the current engine step and restore train mode, keeping the KV
        cache: the trainer may then update the weights. Collective over the lockstep group. Returns once paused."""
        if not self.active:
            return
        with self._lock:
            self._pause_requested = True
            self._lock.notify_all()
        while not self._paused.wait(timeout=1.0):
            if not self.active or self._worker_failed:
                return
        self._restore_train_mode()

    def resume_generation(self, version: int) -> None:
        """Continue the held requests with the current (updated) weights, as policy ``version``."""
        if not self.active:
            return
        self._was_training = self._gpt.training
        _set_training(self.model, False)
        self.policy_version = int(version)
        self._track_versions = True
        with self._lock:
            self._pause_requested = False
            self._lock.notify_all()

    def _restore_train_mode(self) -> None:
        if self._was_training:
            _set_training(self.model, True)

    # ------------------------------------------------------------------ requests

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        if self._worker_failed:  # the engine failed earlier: stop what is left of it and start a fresh one
            await asyncio.to_thread(self.exit_inference_mode)
        if not self.active:
            await asyncio.to_thread(self.enter_inference_mode)
        if self._device.type == "cpu":
            release_thread_pool()  # this thread now only waits: let the engine thread's OpenMP pool spin
        loop = asyncio.get_running_loop()
        flat = expand_checked(requests)  # an invalid request fails alone, before it reaches the engine
        responses: list[InferenceResponse | None] = [None] * len(flat)
        pending: list[tuple[int, asyncio.Future]] = []
        for i, request in enumerate(flat):
            if isinstance(request, InferenceResponse):
                responses[i] = request
                continue
            try:
                job = self._prepare(request)
            except _RequestError as e:
                responses[i] = InferenceResponse.failed(str(e), getattr(e, "prompt_text", None))
                continue
            pending.append((i, self._submit(job, loop)))
        if pending:
            done = await asyncio.gather(*(f for _, f in pending))
            for (i, _), response in zip(pending, done):
                responses[i] = response
        return responses  # type: ignore[return-value]

    def _prepare(self, request: InferenceRequest) -> _Job:
        """Render, tokenize and validate one request; a problem raises _RequestError (a per-request error)."""
        prompt_text = None
        try:
            args = GenerationArgs.model_validate(request.generation_args.model_dump())
            if request.messages is not None:
                prompt_text = render_chat(request.messages, self.tokenizer)
            else:
                prompt_text = request.prompt
            if not prompt_text:
                raise _RequestError("empty prompt: give at least one character of prompt text (or one chat message)")
            ids = [int(t) for t in self.tokenizer.tokenize(prompt_text)]
        except ValidationError as e:
            raise _with_prompt(_RequestError(f"invalid generation_args: {e}"), prompt_text) from e
        except _RequestError as e:
            raise _with_prompt(e, prompt_text)
        except Exception as e:  # a chat template or tokenizer failing on this input fails this request only
            raise _with_prompt(_RequestError(f"could not render/tokenize the prompt: {e!r}"), prompt_text) from e
        bad = [t for t in ids if not 0 <= t < self._gpt.vocab_size]
        if bad:
            raise _with_prompt(_RequestError(
                f"the tokenizer produced ids {bad[:5]} outside the model's vocabulary of {self._gpt.vocab_size}: "
                "the tokenizer does not match the model"), prompt_text)
        if not ids:
            raise _with_prompt(_RequestError(f"the prompt {prompt_text[:40]!r} tokenizes to zero tokens"),
                               prompt_text)
        room = self.max_sequence_length - len(ids)
        if room < 1:
            raise _with_prompt(_RequestError(
                f"prompt is {len(ids)} tokens but the model's maximum sequence length is "
                f"{self.max_sequence_length} (prompt + at least one generated token): shorten the prompt "
                f"or serve with a larger max_sequence_length"), prompt_text)
        return _Job(seq=-1, prompt_ids=ids, max_new_tokens=min(args.max_tokens, room),
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    stop=list(args.stop), prompt_text=prompt_text)

    def _submit(self, job: _Job, loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        future = loop.create_future()
        with self._lock:
            if self._thread is None or self._stop_requested:
                future.set_result(InferenceResponse.failed("the inference engine is not running "
                                                           "(inference mode exited)", job.prompt_text))
                return future
            job.seq = self._next_seq
            self._next_seq += 1
            waiter = _Waiter(loop, future, job)
            if self._is_source:
                self._waiters[job.seq] = waiter
                self._queue.append(job)
                self._lock.notify_all()
            elif job.seq in self._early:
                source_job, response = self._early.pop(job.seq)
                _resolve(waiter, _checked(job, source_job, response))
            else:
                self._waiters[job.seq] = waiter
        return future

    def _deliver(self, source_job: _Job, response: InferenceResponse) -> None:
        """Engine thread: hand a finished request's response to whoever submitted it on this rank."""
        with self._lock:
            waiter = self._waiters.pop(source_job.seq, None)
            if waiter is None:
                if not self._is_source:
                    self._early[source_job.seq] = (source_job, response)
                return
        _resolve(waiter, _checked(waiter.job, source_job, response))

    # ------------------------------------------------------------------ engine thread

    def _worker_main(self) -> None:
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
                engine, context, controller = build_engine(self.model, self._engine_tokenizer, self.settings,
                                                           self.max_sequence_length, self._pg_collection)
        except BaseException as e:  # reported by enter_inference_mode
            log.exception("building the megatron-core inference engine failed")
            self._worker_error = e
            self._ready.set()
            return
        self._live.update(engine=engine, context=context, controller=controller)
        self._ready.set()
        jobs: dict[int, _Job] = {}
        try:
            while True:
                idle = not engine.has_unfinished_requests()
                plan = self._next_plan(idle)
                if plan.pause:
                    self._paused.set()
                    continue
                if self._paused.is_set():  # resumed: the weights changed under the requests in flight
                    with self._lock:  # a non-source rank steps only once its own trainer is done updating
                        while self._pause_requested and not self._stop_requested:
                            self._lock.wait(timeout=1.0)
                    self._paused.clear()
                    _mark_versions(engine, jobs, self.policy_version)
                for job in plan.jobs:
                    self._add(engine, controller, jobs, job)
                if engine.has_unfinished_requests():
                    result = await engine.async_step()
                    self.engine_steps += 1
                    for record in result["finished_request_records"]:
                        self._finish(controller, jobs, record)
                    for rid in result["active_request_ids"]:
                        if self._should_stop_early(engine, jobs[rid], rid):
                            engine.stop_word_finished_request_ids.add(rid)
                elif plan.stop:
                    break
        except BaseException as e:
            log.exception("the megatron-core inference engine failed")
            self._worker_failed = True  # before any caller hears of it, so its next call restarts the engine
            for job in jobs.values():
                self._deliver(job, InferenceResponse.failed(f"inference engine failed: {e!r}", job.prompt_text))
            with self._lock:  # fail what was queued too; later submissions see a stopped engine
                queued, self._queue = self._queue, []
                self._stop_requested = True
            for job in queued:
                self._deliver(job, InferenceResponse.failed(f"inference engine failed: {e!r}", job.prompt_text))
        finally:
            context.deallocate_all_tensors()  # frees the KV cache even if something still holds the context
            self._live.clear()
            _drop_engine_objects(engine, controller, context)
            del engine, context, controller

    def _device_mode(self):
        """With ``cpu_fast_steps``: the CPU layer's device-rewriting mode, for construction and admission only.

        Engine steps then run without it (the mode costs a Python dispatch per torch call, about a third of a
        decode step of a small model); the step path only meets device helpers the layer patches globally
        (``torch.cuda.current_device``, streams, events). Admission and construction allocate with
        ``pin_memory=True`` / CUDA device literals, which need the mode.
        """
        if self._cpu_layer and self.settings.cpu_fast_steps:
            from megatron.rl.runtime.cuda_to_cpu import CudaToCpuMode

            return CudaToCpuMode()
        return contextlib.nullcontext()

    def _next_plan(self, idle: bool) -> _Plan:
        """Source: take everything queued (waiting while idle); all ranks: agree on it via broadcast."""
        if self._is_source:
            with self._lock:
                if self._pause_requested and self._paused.is_set():  # held: heartbeat until resumed
                    self._lock.wait(timeout=_IDLE_HEARTBEAT_S)
                if self._pause_requested:
                    plan = _Plan(jobs=[], stop=False, pause=True)
                else:
                    if idle and not self._queue and not self._stop_requested:
                        self._lock.wait(timeout=_IDLE_HEARTBEAT_S)
                    jobs, self._queue = self._queue, []
                    plan = _Plan(jobs=jobs, stop=self._stop_requested and idle and not jobs)
        else:
            plan = None
        if self._group is not None:
            box = [plan]
            dist.broadcast_object_list(box, src=self._source, group=self._group)
            plan = box[0]
        return plan

    def _add(self, engine, controller, jobs: dict[int, _Job], job: _Job) -> None:
        from megatron.core.inference.sampling_params import SamplingParams

        generator = None
        if job.seed is not None and job.temperature > 0:
            generator = controller.make_generator(job.seed)
        controller.specs[job.seq] = SampleSpec(job.temperature, job.top_k, job.top_p, generator)
        job.version_marks = [(self.policy_version, 0)]
        jobs[job.seq] = job
        # The engine does not sample (SamplingController does); it only needs lengths, the EOS id and
        # one log-prob slot per generated token.
        params = SamplingParams(temperature=1.0, top_k=0, top_p=0.0, return_log_probs=True,
                                skip_prompt_log_probs=True, num_tokens_to_generate=job.max_new_tokens,
                                termination_id=self._termination_id)
        with self._device_mode():
            engine.add_request(job.seq, list(job.prompt_ids), params)
        if job.seq in engine.failed_request_ids:  # rejected at once: never stepped, so report it here
            engine.failed_request_ids.remove(job.seq)
            entry = engine.requests.pop(job.seq)
            self._finish(controller, jobs, entry.record)

    def _finish(self, controller, jobs: dict[int, _Job], record) -> None:
        from megatron.core.inference.inference_request import Status

        job = jobs.pop(record.request_id)
        controller.specs.pop(record.request_id, None)
        if record.requests[-1].status == Status.FAILED:
            reasons = [type(ev.payload).__name__ for r in record.requests for ev in r.events if ev.payload is not None]
            response = InferenceResponse.failed(
                f"the inference engine rejected this request ({', '.join(reasons) or 'no reason given'}); "
                f"prompt {len(job.prompt_ids)} tokens, max_tokens {job.max_new_tokens}", job.prompt_text)
        else:
            tokens = [int(t) for r in record.requests for t in r.generated_tokens]
            log_probs = [float(x) for r in record.requests for x in (r.generated_log_probs or [])]
            response = self._make_response(job, tokens, log_probs[:len(tokens)])
        self._deliver(job, response)

    def _make_response(self, job: _Job, tokens: list[int], log_probs: list[float]) -> InferenceResponse:
        finish = "length"
        for i, token in enumerate(tokens):
            if token in self._eos:
                tokens, log_probs, finish = tokens[:i + 1], log_probs[:i + 1], "stop"
                break
        text = self._detok(tokens)
        if job.stop:
            cut = _first_stop(text, job.stop)
            if cut is not None:
                text, finish = text[:cut], "stop"
                # keep tokens up to the one that completed the stop string (the trainer sees what was sampled)
                lo, hi = 1, len(tokens)
                while lo < hi:
                    mid = (lo + hi) // 2
                    if _first_stop(self._detok(tokens[:mid]), job.stop) is not None:
                        hi = mid
                    else:
                        lo = mid + 1
                tokens, log_probs = tokens[:hi], log_probs[:hi]
        versions = None
        if self._track_versions:  # asynchronous rollouts: the version of each token (marks are in order)
            versions = [[v for v, start in job.version_marks if start <= i][-1] for i in range(len(tokens))]
        return InferenceResponse(text=text, token_ids=job.prompt_ids + tokens, prompt_length=len(job.prompt_ids),
                                 logprobs=log_probs, finish_reason=finish, prompt_text=job.prompt_text,
                                 policy_versions=versions)

    def _should_stop_early(self, engine, job: _Job, rid: int) -> bool:
        """After a step: did this request just sample a non-primary EOS id or complete a stop string?"""
        if not job.stop and not self._extra_eos:
            return False
        record = engine.requests[rid].record
        last = record.requests[-1].generated_tokens
        if last and last[-1] in self._extra_eos:
            return True
        if job.stop:
            tokens = [t for r in record.requests for t in r.generated_tokens]
            # the stop string ends at the newest token; a token renders at least a quarter character
            tail = tokens[-(4 * max(len(s) for s in job.stop) + 4):]
            return _first_stop(self._detok(tail), job.stop) is not None
        return False

    def _detok(self, tokens: Sequence[int]) -> str:
        return self._engine_tokenizer.detokenize([t for t in tokens if t not in self._eos])


# ---------------------------------------------------------------------- helpers


def _mark_versions(engine: Any, jobs: dict[int, _Job], version: int) -> None:
    """Record, for every request in flight, that its tokens from here on are generated by ``version``."""
    for rid, job in jobs.items():
        entry = engine.requests.get(rid)
        if entry is None:
            continue
        done = sum(len(r.generated_tokens) for r in entry.record.requests)
        job.version_marks.append((version, done))


def _drop_engine_objects(engine: Any, controller: Any, context: Any) -> None:
    """Empty the attribute dicts of a stopped engine's objects (engine, controller, context, model wrapper).

    megatron-core's engine and controller reference each other (bound-method callbacks, closures), so
    without this they and everything they hold (the context, sampling buffers, the wrapper) live until the
    cyclic garbage collector runs; a full ``gc.collect()`` here cost ~0.2 s per rollout phase. Emptying the
    dicts breaks every cycle through them at once. The objects are never used again.
    """
    wrapper = getattr(controller, "inference_wrapped_model", None)
    for obj in (engine, controller, context, wrapper):
        state = getattr(obj, "__dict__", None)
        if isinstance(state, dict) and not isinstance(obj, torch.nn.Module):
            state.clear()


def _set_training(model: Any, training: bool) -> None:
    for chunk in model if isinstance(model, (list, tuple)) else [model]:
        chunk.train(training)


def _with_prompt(error: _RequestError, prompt_text: str | None) -> _RequestError:
    error.prompt_text = prompt_text  # type: ignore[attr-defined]
    return error


def _first_stop(text: str, stops: Sequence[str]) -> int | None:
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(hits) if hits else None


def _checked(local: _Job, source: _Job, response: InferenceResponse) -> InferenceResponse:
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
    def set_result() -> None:
        if not waiter.future.done():  # the caller may have been cancelled (e.g. a client disconnect)
            waiter.future.set_result(response)

    try:
        waiter.loop.call_soon_threadsafe(set_result)
    except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
        pass


def _lockstep_group() -> tuple[Any, int, int]:
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
    parent = list(range(world))

    def find(x: int) -> int:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    for ranks in everyone:
        for r in ranks[1:]:
            parent[find(r)] = find(ranks[0])
    components: dict[int, list[int]] = {}
    for r in range(world):
        components.setdefault(find(r), []).append(r)
    my_group = None
    for members in sorted(components.values()):
        if len(members) < 2:
            continue
        group = dist.new_group(members, backend="gloo")  # every rank creates every group, in the same order
        if rank in members:
            my_group = group
    members = components[find(rank)]
    return my_group, min(members), len(members)
