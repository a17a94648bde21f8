"""The inference copy of the policy: built once at its own layout, refit from the trainer after every update.

:func:`build_layout_inference` builds a second ``GPTModel`` with the inference layout's process groups and wraps
it in :class:`~megatron.rl.inference.megatron.MegatronInference` as a :class:`LayoutInference`. Weights move with
megatron-core's ``swap_model_weights``; nothing here shuffles tensors itself. Refits: once after the trainer's
weights are loaded, then after every update (:meth:`LayoutInference.refit_for_update`). Only the trainer's
weights are checkpointed.

Details: docs/inference.md.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from typing import Any, Iterator

import torch

from megatron.rl import parallel_utils
from megatron.rl.inference.api import InferenceRequest, InferenceResponse
from megatron.rl.inference.engine.engine_flags import EngineFlags
from megatron.rl.inference.forwarding import ForwardingInference
from megatron.rl.layout.groups import InferenceGroups, InferenceLayoutConfig, build_inference_groups
from megatron.rl.runtime import patches, setup_runtime
from megatron.rl.runtime.reshard_planner import PLANNER_PATCH
from megatron.rl.training.config import TrainingConfig
from megatron.rl.training.model_provider import build_gpt_chunk, padded_vocab_size, transformer_config_from_args

log = logging.getLogger(__name__)


def _inference_parallel_config(cfg: TrainingConfig, groups: InferenceGroups):
    s = groups.sizes
    # megatron-core requires sequence parallelism for MoE with TP > 1; otherwise decode steps are faster without
    return dataclasses.replace(cfg.parallel, tensor_model_parallel_size=s.tp, pipeline_model_parallel_size=s.pp,
                               expert_model_parallel_size=s.ep, expert_tensor_parallel_size=s.expert_tp,
                               sequence_parallel=s.tp > 1 and cfg.model.num_experts is not None,
                               num_layers_per_virtual_pipeline_stage=None,
                               virtual_pipeline_model_parallel_size=None, data_parallel_size=s.dp)


def build_inference_model(cfg: TrainingConfig, groups: InferenceGroups, vocab_size: int) -> list[torch.nn.Module]:
    """The inference copy's one model chunk on this rank (its weights are meaningless until the first refit).

    Built under a forked RNG (and with the model-parallel RNG tracker's states restored), so the trainer's
    random streams are the same as in a run without the copy. Weights are initialised anyway: megatron-core
    0.16.1 marks linear weights as tensor-parallel (``tensor_model_parallel`` / ``partition_dim``, which the
    reshard planner reads) only inside its weight initialisation, so ``perform_initialization=False``
    would make the refit treat TP shards as replicated tensors.
    """
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    from megatron.core.transformer.module import Float16Module

    device = setup_runtime().device
    tconfig = transformer_config_from_args(cfg.model, _inference_parallel_config(cfg, groups))
    tracker = get_cuda_rng_tracker()
    tracker_states = tracker.get_states()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        s = groups.sizes
        chunk = build_gpt_chunk(cfg, tconfig, vocab_size, pre_process=groups.pp_rank == 0,
                                post_process=groups.pp_rank == s.pp - 1, pg_collection=groups.pg_collection)
    tracker.set_states(tracker_states)
    for param in chunk.parameters():
        tensor_parallel.set_defaults_if_not_set_tensor_model_parallel_attributes(param)
        param.requires_grad_(False)
    if device.type == "cuda":
        chunk = chunk.to(device)
    if cfg.model.bf16 or cfg.model.fp16:
        chunk = Float16Module(tconfig, chunk)
    return [chunk]


def model_bytes(chunks: list) -> int:
    return sum(p.numel() * p.element_size() for c in chunks for p in c.parameters())


class InferenceCopy:
    """Trainer model + inference copy + how to move weights between them (megatron-core ``swap_model_weights``).

    ``refit()`` is collective over the world (the planner all-gathers parameter metadata on the first call;
    the plan is cached on the copy).
    """

    def __init__(self, train_model: list, copy: list, refit_method: str):
        self.train_model = train_model
        self.model = copy
        self.refit_method = refit_method
        self.refits = 0
        self.stale = True  # the copy's weights are garbage until the first refit
        self.last_refit_s = 0.0

    def refit(self) -> float:
        """Copy the trainer's current weights into the inference copy; returns the seconds it took."""
        from megatron.core.resharding import swap_model_weights
        from megatron.core.utils import unwrap_model

        patches.apply(PLANNER_PATCH)  # megatron-core's planner, taught SequentialMLP's expert names
        start = time.perf_counter()
        with torch.no_grad():
            swap_model_weights(unwrap_model(list(self.train_model)), unwrap_model(list(self.model)), self.refit_method)
        if torch.cuda.is_available() and next(self.model[0].parameters()).is_cuda:
            torch.cuda.synchronize()
        self.last_refit_s = time.perf_counter() - start
        self.refits += 1
        self.stale = False
        return self.last_refit_s


class LayoutInference(ForwardingInference):
    """The backend agents see with a separate inference layout: MegatronInference (``inner``) over the inference
    copy, refit from the trainer after every update.

    :meth:`refit_for_update` is the one refit after an optimizer step: the rollout source calls it on every rank
    right after the step (collective over the world), while the copy's engine is stopped (synchronous rollouts,
    or asynchronous ones that drain before an update) or paused (partial rollouts: in-flight requests keep
    their KV cache and the engine thread holds after its current step). :meth:`resume_generation` releases
    paused requests only after it, so no engine step runs during a refit and every token after a pause comes
    from the refit weights. A rollout phase also refits first when the copy is stale (the start-up refit, from
    the loaded weights). The copy's engine splits prompts over the inference replicas (``rollout_shard``).
    """

    def __init__(self, inner: Any, copy: InferenceCopy, groups: InferenceGroups | None):
        super().__init__(inner)
        self.copy = copy
        self.groups = groups

    def mark_trainer_updated(self) -> None:
        self.copy.stale = True

    def refit_if_stale(self) -> float:
        return self.copy.refit() if self.copy.stale else 0.0

    def refit_for_update(self) -> float:
        """The trainer's weights changed (all ranks, engine stopped or paused): refit now; returns its seconds."""
        self.mark_trainer_updated()
        seconds = self.refit_if_stale()
        super().refit_for_update()  # the copy's engine generates with the copy's parameters in place: a no-op
        return seconds

    def resume_generation(self, version: int) -> None:
        if self.copy.stale and version >= 0:  # version -1: shutting down, nothing generated from here is trained
            raise RuntimeError("resuming the inference copy's paused requests before its refit: call "
                               "refit_for_update() after the optimizer step first")
        super().resume_generation(version)

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator["LayoutInference"]:
        self.refit_if_stale()
        with self.inner.rollout_phase():
            yield self

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        if self.copy.stale:
            raise RuntimeError("the inference copy is stale (the trainer changed since the last refit): "
                               "generate inside rollout_phase(), which refits first")
        return await self.inner.agenerate(requests)


def build_layout_inference(cfg: TrainingConfig, layout: InferenceLayoutConfig, train_model: list, tokenizer,
                           vocab_size: int | None = None, record_routes: bool = False,
                           engine: EngineFlags | None = None) -> LayoutInference:
    """Groups, inference copy and backend for ``layout`` (collective over the world). No refit yet.
    ``record_routes``: the copy's engine records MoE routes (``--rl-router-replay rollout``). ``engine``: the
    engine flags (CUDA graphs, request and KV limits; default none set)."""
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference  # heavy: megatron-core's engine

    runtime = setup_runtime()
    s = layout.sizes(cfg)
    groups = build_inference_groups(s)
    vocab = vocab_size or padded_vocab_size(cfg, tokenizer)
    copy_model = build_inference_model(cfg, groups, vocab)
    method = layout.resolved_refit_method(runtime.device.type == "cuda")
    copy = InferenceCopy(train_model, copy_model, method)
    size = torch.tensor([model_bytes(copy_model)], dtype=torch.float64)
    parallel_utils.all_reduce_sum(size)  # the copy's total over all ranks (the log line reports both)
    log.info("inference copy: TP=%d PP=%d EP=%d, %d replica(s) (this rank: replica %d); weights %.1f MB on this "
             "rank, %.1f MB over all ranks; refit via megatron-core %s", s.tp, s.pp, s.ep, groups.num_replicas,
             groups.replica_rank, model_bytes(copy_model) / 2**20, float(size[0]) / 2**20, method)
    settings = EngineSettings.from_flags(runtime.device, engine or EngineFlags(), s.tp, record_routes=record_routes)
    backend = MegatronInference(copy_model[0], tokenizer, settings=settings, process_groups=groups)
    return LayoutInference(backend, copy, groups)
