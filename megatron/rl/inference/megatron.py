"""The default inference backend: megatron-core's dynamic engine around the training model itself.

``MegatronInference(model, tokenizer)`` serves :class:`~megatron.rl.inference.api.InferenceRequest` s with
megatron-core's ``DynamicInferenceEngine`` on the *training* model's weights in place (no copy, no refit when
colocated). This module takes requests: it renders, tokenizes and validates them, clamps ``max_tokens`` to the
room left, and waits for the response; :mod:`~megatron.rl.inference.engine.lockstep` schedules them across a
model-parallel group, :mod:`~megatron.rl.inference.engine.session` owns the engine thread and KV cache, and
:mod:`~megatron.rl.inference.engine.build` builds the engine. Never train while a rollout phase is active.
Inference mode, batching, model parallelism and log-probs: docs/inference.md.
"""
from __future__ import annotations

import asyncio
import contextlib
from typing import Any, Callable, Iterator

import torch.distributed as dist
from pydantic import ValidationError

from megatron.rl.base.errors import ConfigError, RLError
from megatron.rl.inference.api import (GenerationArgs, InferenceError, InferenceInterface, InferenceRequest,
                                       InferenceResponse, expand_checked)
from megatron.rl.inference.chat_template import render_chat
from megatron.rl.inference.control import RolloutShard, TrainerControl
from megatron.rl.inference.engine.build import EngineSettings, EngineTokenizer, unwrap_gpt_model
from megatron.rl.inference.engine.lockstep import (Job, LockstepScheduler, broadcast_plan, lockstep_group,
                                                   lockstep_rank_groups)
from megatron.rl.inference.engine.session import EngineSession, EosIds
from megatron.rl.inference.megatron_checkpoint import megatron_backend_from_cli
from megatron.rl.runtime import setup_runtime
from megatron.rl.runtime.openmp import release_thread_pool

__all__ = ["MegatronInference", "EngineSettings"]


class _RequestError(RLError, ValueError):
    pass


@InferenceInterface.register("megatron")
class MegatronInference(InferenceInterface, TrainerControl):
    """In-process megatron-core dynamic-engine backend over the training model; implements the trainer's
    controls (:class:`~megatron.rl.inference.control.TrainerControl`): pause/resume across weight updates,
    policy versions per token, its prompt split and its engine steps.

    Args:
        model: the training GPTModel (or a one-element list of model chunks; DDP / Float16Module
            wrappers are fine). Its parameters are used in place.
        tokenizer: a :class:`megatron.rl.training.tokenizer.Tokenizer` (tokenize, detokenize, offsets,
            vocab_size, eod, optional eos_token_ids / apply_chat_template).
        settings: KV-cache and batch sizes; default :meth:`EngineSettings.for_device`.
        max_sequence_length: prompt + generated tokens per request; default the model's
            ``max_sequence_length``.
        process_groups: for an inference copy with its own layout, its
            :class:`~megatron.rl.layout.groups.InferenceGroups` (process groups, lockstep group and
            source); None = the training layout from megatron-core's ``parallel_state``.

    ``torch.distributed`` and megatron-core's ``parallel_state`` must be initialised (one process
    is fine). Construction is collective over all ranks when the world has more than one rank.
    """

    supports_weight_updates = True  # generates with the trainer's parameters in place
    # the engine admits requests at every step, whoever sends them: the inference server forwards each HTTP request
    # at once instead of holding it until the running batch ends
    continuous_batching = True
    # the abilities the run's checks read (InferenceInterface): the engine is megatron-core's, in this process, on
    # this run's model; it records MoE routes and captures its decode step in CUDA graphs
    in_process_engine = True
    records_routes = True
    captures_decode_graphs = True
    serves_checkpoint = True  # its constructor takes the live model: a server loads a checkpoint (from_cli)

    def __init__(self, model: Any, tokenizer: Any, settings: EngineSettings | None = None,
                 max_sequence_length: int | None = None, process_groups: Any = None):
        runtime = setup_runtime()
        self._device = runtime.device
        if not dist.is_initialized():
            raise InferenceError("MegatronInference needs torch.distributed and megatron-core parallel_state "
                                 "initialised (call megatron.rl.training.initialize.initialize_megatron first)")
        self.model = model
        self._gpt = unwrap_gpt_model(model)
        self.tokenizer = tokenizer
        self.settings = settings or EngineSettings.for_device(runtime.device)
        self.max_sequence_length = int(max_sequence_length or self.settings.max_sequence_length
                                       or self._gpt.max_sequence_length)
        # how the trainer splits prompts when not by training data-parallel rank (None: by DP rank)
        if process_groups is None:
            group, source, self.lockstep_size = lockstep_group()
            self.rollout_shard = _training_layout_shard(source, self.lockstep_size)
        else:  # one lockstep group per replica of the inference layout
            group, source = process_groups.lockstep_group, process_groups.lockstep_source
            self.lockstep_size = 1 if group is None else dist.get_world_size(group)
            self.rollout_shard = RolloutShard.for_groups(process_groups)
        self._scheduler = LockstepScheduler(dist.get_rank() == source, broadcast_plan(group, source))
        self._session = EngineSession(model, self._gpt, EngineTokenizer(tokenizer), EosIds.of(tokenizer),
                                      self.settings, self.max_sequence_length,
                                      getattr(process_groups, "pg_collection", None), self._scheduler,
                                      runtime.device, runtime.cpu_layer_active)

    @classmethod
    def from_cli(cls, argv: list[str]) -> "MegatronInference":
        """Serve a checkpoint: ``argv`` are training flags with ``--load`` (see :mod:`.megatron_checkpoint`)."""

        return megatron_backend_from_cli(argv)

    @classmethod
    def build_for_training(cls, cfg: Any, rl: Any, model: list, tokenizer: Any) -> InferenceInterface:
        """The RL run's backend over the trainer's model (an inference copy at its own layout is the trainer's
        :func:`megatron.rl.layout.backend.build_run_inference`)."""
        record_routes = rl.router_replay == "rollout"  # MoE routing replay: the engine records every token's routes
        if len(model) != 1:
            raise ConfigError("--inference-backend megatron needs a single model chunk per rank "
                              "(megatron-core inference does not support the interleaved pipeline schedule)")
        # prompt + generation must fit one --seq-length training row: a longer sequence would be generated and then
        # fail in packing; capped here, a prompt that leaves no room is a per-request error before generation.
        from megatron.core.utils import unwrap_model

        limit = unwrap_model(model[0]).max_sequence_length
        settings = EngineSettings.from_flags(setup_runtime().device, rl.engine, cfg.parallel.tensor_model_parallel_size,
                                             record_routes=record_routes)
        return cls(model[0], tokenizer, settings=settings, max_sequence_length=min(limit, cfg.model.seq_length))

    # ------------------------------------------------------------------ inference mode

    @property
    def active(self) -> bool:
        return self._session.active

    @property
    def context(self):
        """The live ``DynamicInferenceContext`` (holds the KV cache), or None outside inference mode."""
        return self._session.context

    @property
    def engine_steps(self) -> int:
        """Engine steps run since construction (a batching diagnostic)."""
        return self._scheduler.steps

    def enter_inference_mode(self) -> None:
        """eval(), allocate the KV cache and start the engine thread. No-op when already active."""
        self._session.enter()

    def exit_inference_mode(self) -> None:
        """Finish in-flight requests, stop the engine thread, free the KV cache, restore train mode.

        Collective over the lockstep group (see the module docstring). No-op when not active.
        """
        self._session.exit()

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator["MegatronInference"]:
        """``with backend.rollout_phase(): ...`` = enter inference mode, then exit on the way out."""
        self.enter_inference_mode()
        try:
            yield self
        finally:
            self.exit_inference_mode()

    inference_mode = rollout_phase  # the engine's own name for it

    async def aclose(self) -> None:
        await asyncio.to_thread(self.exit_inference_mode)

    # ------------------------------------------------------------------ pause (asynchronous partial rollouts)

    @property
    def policy_version(self) -> int:
        return self._session.version.current

    def set_policy_version(self, version: int) -> None:
        """The version of the weights generating from now on (recorded per token in ``policy_versions``)."""
        self._session.version.current = int(version)
        self._session.version.tracked = True

    def pause_generation(self) -> None:
        """Hold every in-flight request after the current engine step and restore train mode, keeping the KV
        cache: the trainer may then update the weights. Collective over the lockstep group. Returns once paused."""
        if not self.active:
            return
        self._scheduler.request_pause()
        while not self._scheduler.paused.wait(timeout=1.0):
            if not self.active or self._session.failed:
                return
        self._session.restore_train_mode()

    def resume_generation(self, version: int) -> None:
        """Continue the held requests with the current (updated) weights, as policy ``version``."""
        if not self.active:
            return
        self._session.set_eval()
        self.set_policy_version(version)
        self._scheduler.resume()

    # ------------------------------------------------------------------ requests

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        if self._session.failed:  # the engine failed earlier: stop what is left of it and start a fresh one
            await asyncio.to_thread(self.exit_inference_mode)
        if not self.active:
            await asyncio.to_thread(self.enter_inference_mode)
        if self._device.type == "cpu":
            release_thread_pool()  # this thread now only waits: let the engine thread's OpenMP pool spin
        loop = asyncio.get_running_loop()
        flat = expand_checked(requests)  # an invalid request fails alone, before it reaches the engine
        responses: list[InferenceResponse | None] = [None] * len(flat)
        jobs: list[tuple[int, Job, Callable[[], bool]]] = []
        for i, request in enumerate(flat):
            if isinstance(request, InferenceResponse):
                responses[i] = request
                continue
            try:
                jobs.append((i, self._prepare(request), lambda r=request: r.cancelled))
            except _RequestError as e:
                responses[i] = InferenceResponse.failed(str(e), getattr(e, "prompt_text", None))
        if jobs:  # all of them queued at once: an idle engine's first step takes the whole batch
            futures = self._scheduler.submit_many([(job, cancelled) for _, job, cancelled in jobs], loop)
            for (i, _, _), response in zip(jobs, await asyncio.gather(*futures)):
                responses[i] = response
        return responses  # type: ignore[return-value]

    def _prepare(self, request: InferenceRequest) -> Job:
        """Render, tokenize and validate one request; a problem raises _RequestError (a per-request error)."""
        prompt_text = None
        try:
            args = GenerationArgs.model_validate(request.generation_args.model_dump())
            if request.messages is not None:
                prompt_text = render_chat(request.messages, self.tokenizer)
            else:
                prompt_text = request.prompt
            if not prompt_text and not request.prefix_token_ids:
                raise _RequestError("empty prompt: give at least one character of prompt text (or one chat message)")
            # token in: a prefix is used as given, only the text after it is tokenized
            ids = list(request.prefix_token_ids or []) + [int(t) for t in self.tokenizer.tokenize(prompt_text)]
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
        return Job(seq=-1, prompt_ids=ids, max_new_tokens=min(args.max_tokens, room),
                    temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed,
                    stop=list(args.stop), prompt_text=prompt_text)


def _training_layout_shard(source: int, size: int) -> Any:
    """The prompt split for an engine at the training layout: None (by data-parallel rank, as always) unless
    expert parallelism joins several data-parallel ranks into one lockstep group; then a
    :class:`~megatron.rl.inference.control.RolloutShard` by lockstep group, so that those ranks ask for the
    same prompts (the group serves its lowest rank's requests) and get their training share afterwards."""
    from megatron.core import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return None
    lockstep = lockstep_rank_groups(dist.get_world_size(), ps.get_tensor_model_parallel_world_size(),
                                    ps.get_pipeline_model_parallel_world_size(),
                                    ps.get_expert_model_parallel_world_size(),
                                    ps.get_expert_tensor_parallel_world_size())
    if len(lockstep) == ps.get_data_parallel_world_size():
        return None
    shard = RolloutShard.for_lockstep(lockstep, dist.get_rank())
    mine = sorted(lockstep)[shard.rank]
    if (mine[0], len(mine)) != (source, size):  # megatron-core's rank order changed under us: say so
        raise InferenceError(f"the lockstep group computed from the layout sizes ({mine}) differs from the process "
                             f"groups' (source rank {source}, {size} ranks)")
    return shard


def _with_prompt(error: _RequestError, prompt_text: str | None) -> _RequestError:
    error.prompt_text = prompt_text  # type: ignore[attr-defined]
    return error
