"""The inference copy of the policy: built once at its own layout, refit from the trainer after every update.

:func:`build_layout_inference` builds a second ``GPTModel`` from the training model config with the
inference layout's process groups (:mod:`megatron.rl.layout.groups`), wraps it in the in-process
:class:`~megatron.rl.inference.megatron.MegatronInference` backend, and returns a :class:`LayoutInference`
that the agents use like any backend. Weights move with megatron-core's ``swap_model_weights``
(its reshard planner + gloo / NCCL copy service); nothing here shuffles tensors itself.

Refit points: once after the trainer's weights are loaded (before the first generation, so a resumed run
serves the checkpoint's weights) and after every RL iteration that changed them. Only the trainer's
weights are checkpointed; the copy is rebuilt and refit on start-up.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import time
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron.rl import parallel_utils
from megatron.rl.inference.api import InferenceInterface, InferenceRequest, InferenceResponse
from megatron.rl.layout.groups import InferenceGroups, InferenceLayoutConfig, build_inference_groups
from megatron.rl.training.config import TrainingConfig

log = logging.getLogger(__name__)


class RefitVerificationError(RuntimeError):
    """--rl-verify-model-weights-swap found the inference copy disagreeing with the trainer."""


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

    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.model_provider import build_gpt_chunk, transformer_config_from_args

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


_EXPERT_INDEX = re.compile(r"(?<=\.local_experts\.)(\d+)(?=\.)")
_PATCHED_PLANNER = "_megatron_rl_sequential_experts"


def patch_planner_for_sequential_experts() -> None:
    """A registered patch of megatron-core 0.16.1's reshard planner (applied once; see the reason below).

    Reason: the planner matches parameters across layouts by a "resolved name" in which per-rank expert
    indices become global ones, but only for TEGroupedMLP names (``...experts.linear_fc1.weightK``). The
    local layer spec's SequentialMLP names its experts ``...experts.local_experts.K...`` with K local to the
    expert-parallel rank, so with EP > 1 two ranks' ``local_experts.0`` are different experts under one name
    (the refit fails with "not found in source model", or copies the wrong expert). Its replicated expert
    tensors (a RowParallelLinear bias) are also planned over the dense data-parallel group, which holds
    different experts, instead of the expert data-parallel group. This wraps ``extract_param_metadata`` to
    fix both for expert-parallel parameters; everything else is untouched.
    """
    from megatron.core.resharding import planner

    if getattr(planner.extract_param_metadata, _PATCHED_PLANNER, False):
        return
    original = planner.extract_param_metadata

    def extract_param_metadata(param, param_name, owner_rank, pg_collection, num_experts=None,
                               layer_module_prefix_map=None):
        meta = original(param, param_name, owner_rank, pg_collection, num_experts=num_experts,
                        layer_module_prefix_map=layer_module_prefix_map)
        match = _EXPERT_INDEX.search(meta.resolved_name or "")
        if meta.is_ep and match is not None and meta.global_expert_index is None and num_experts:
            ep_ranks = meta.expert_parallel_group_ranks
            index = ep_ranks.index(owner_rank) * (num_experts // len(ep_ranks)) + int(match.group(1))
            meta.resolved_name = meta.resolved_name[:match.start()] + str(index) + meta.resolved_name[match.end():]
            meta.global_expert_index = index
            meta.data_parallel_group_ranks = dist.get_process_group_ranks(pg_collection.expt_dp)
        return meta

    setattr(extract_param_metadata, _PATCHED_PLANNER, True)
    planner.extract_param_metadata = extract_param_metadata


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

        patch_planner_for_sequential_experts()
        start = time.perf_counter()
        with torch.no_grad():
            swap_model_weights(unwrap_model(list(self.train_model)), unwrap_model(list(self.model)), self.refit_method)
        if torch.cuda.is_available() and next(self.model[0].parameters()).is_cuda:
            torch.cuda.synchronize()
        self.last_refit_s = time.perf_counter() - start
        self.refits += 1
        self.stale = False
        return self.last_refit_s


class LayoutInference(InferenceInterface):
    """The backend agents see with a separate inference layout: MegatronInference over the inference copy.

    A rollout phase refits first when the trainer changed since the last refit. ``rollout_shard``
    tells the RL loop how prompts are split over the inference replicas.

    Asynchronous rollouts (:mod:`megatron.rl.rollout.async_source`): the refit after an optimizer step is the weight
    update the rollout pipeline sees. The pipeline calls :meth:`refit_for_update` on every rank right after
    the optimizer step (or the skipped one), before paused requests continue: without partial rollouts the
    pipeline has drained and the engine is stopped; with them the engine is paused (:meth:`pause_generation`:
    in-flight requests keep their KV cache, the engine thread holds after its current step) and released by
    :meth:`resume_generation` only after the refit. So no engine step runs during a refit, every token after
    a pause comes from the refit weights, and every rank refits at the same point whether or not its own
    replica had requests in flight (the refit is collective over the world). The loop's
    :func:`refit_after_iteration` then only reports that refit's time.
    """

    supports_weight_updates = True  # the refit after each optimizer step brings the trainer's weights over

    def __init__(self, backend: Any, copy: InferenceCopy, groups: InferenceGroups):
        from megatron.rl.layout.groups import RolloutShard

        self.backend = backend
        self.copy = copy
        self.groups = groups
        self.rollout_shard = RolloutShard.for_groups(groups)
        self._pending_refit_s: float | None = None  # a refit done by refit_for_update, not yet reported

    def mark_trainer_updated(self) -> None:
        self.copy.stale = True

    def refit_if_stale(self) -> float:
        return self.copy.refit() if self.copy.stale else 0.0

    def refit_for_update(self) -> float:
        """The trainer's weights changed (asynchronous rollouts, all ranks): refit now, while the engine is
        stopped or paused; :func:`refit_after_iteration` reports it instead of refitting again."""
        self.mark_trainer_updated()
        seconds = self.refit_if_stale()
        self._pending_refit_s = (self._pending_refit_s or 0.0) + seconds
        return seconds

    def take_pending_refit(self) -> float | None:
        """Seconds of the refits :meth:`refit_for_update` did since the last call (None: none)."""
        seconds, self._pending_refit_s = self._pending_refit_s, None
        return seconds

    # ------------------------------------------------------- asynchronous rollouts: policy versions and pausing

    @property
    def engine_steps(self) -> int:
        return self.backend.engine_steps

    @property
    def active(self) -> bool:
        """The copy's engine is running (EngineControl restarts it at a phase start when something stopped it)."""
        return self.backend.active

    def set_policy_version(self, version: int) -> None:
        self.backend.set_policy_version(version)

    def pause_generation(self) -> None:
        self.backend.pause_generation()

    def resume_generation(self, version: int) -> None:
        if self.copy.stale and version >= 0:  # version -1: shutting down, nothing generated from here is trained
            raise RuntimeError("resuming the inference copy's paused requests before its refit: call "
                               "refit_for_update() after the optimizer step first")
        self.backend.resume_generation(version)

    @contextlib.contextmanager
    def rollout_phase(self) -> Iterator["LayoutInference"]:
        self.refit_if_stale()
        with self.backend.rollout_phase():
            yield self

    async def agenerate(self, requests: list[InferenceRequest]) -> list[InferenceResponse]:
        if self.copy.stale:
            raise RuntimeError("the inference copy is stale (the trainer changed since the last refit): "
                               "generate inside rollout_phase(), which refits first")
        return await self.backend.agenerate(requests)

    async def aclose(self) -> None:
        await self.backend.aclose()


def build_layout_inference(cfg: TrainingConfig, layout: InferenceLayoutConfig, train_model: list, tokenizer,
                           vocab_size: int | None = None, record_routes: bool = False) -> LayoutInference:
    """Groups, inference copy and backend for ``layout`` (collective over the world). No refit yet.
    ``record_routes``: the copy's engine records MoE routes (``--rl-router-replay rollout``)."""
    from megatron.rl.inference.megatron import EngineSettings, MegatronInference
    from megatron.rl.runtime import setup_runtime
    from megatron.rl.training.model_provider import padded_vocab_size

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
    settings = dataclasses.replace(EngineSettings.for_device(runtime.device), record_routes=record_routes)
    backend = MegatronInference(copy_model[0], tokenizer, settings=settings, process_groups=groups)
    return LayoutInference(backend, copy, groups)


def start_inference_copy(ctx, rl, inference: LayoutInference) -> None:
    """RL loop start: refit the copy from the trainer's (loaded) weights; --rl-verify-model-weights-swap checks it."""
    log.info("refit of the inference copy from the trainer's weights took %.3fs", inference.refit_if_stale())
    if rl.inference_layout.verify_model_weights_swap:
        verify_weights_swap(ctx, rl, inference)


def refit_after_iteration(inference: LayoutInference, metrics: dict[str, float]) -> None:
    """After an RL iteration that updated the trainer: refit now and add ``time_refit_s`` / ``refit_fraction``."""
    done_s = inference.take_pending_refit()  # asynchronous rollouts refit right after the update, on every rank
    if metrics.get("skipped_update"):
        return  # no optimizer step ran: the copy still equals the trainer
    if done_s is not None:
        refit_s = done_s
    else:
        inference.mark_trainer_updated()
        refit_s = inference.refit_if_stale()
    metrics.update(time_refit_s=refit_s,
                   refit_fraction=refit_s / max(metrics.get("time_total_s", 0.0) + refit_s, 1e-9))


# ------------------------------------------------------------------------------------ verification


def probe_requests(tokenizer, max_new_tokens: int, temperature: float) -> list[InferenceRequest]:
    """A small fixed probe batch (the same on every rank)."""
    from megatron.rl.inference.api import GenerationArgs

    prompts = ["The weights were refit; ", "1 2 3 4 5 6", "probe: abcdefghij"]
    return [InferenceRequest(prompt=p, generation_args=GenerationArgs(temperature=temperature,
                                                                      max_tokens=max_new_tokens, seed=17 + i))
            for i, p in enumerate(prompts)]


def verify_weights_swap(ctx, rl, inference: LayoutInference, tolerance: float | None = None) -> float:
    """--rl-verify-model-weights-swap: the copy's log-probs on a probe batch equal the trainer's.

    The copy generates the probe batch (its log-probs come from its logits at the sampling temperature);
    the trainer scores the same tokens teacher-forced through the usual scoring path. Collective over
    the world. Returns the largest |difference|; raises :class:`RefitVerificationError` above ``tolerance``
    (default 1e-3 in fp32, 5e-2 in bf16/fp16).
    """
    from megatron.rl.rl_utils import build_step_batches, inference_session, logprob_gap, score
    from megatron.rl.rollout.sequences import TrainingSequence

    if tolerance is None:
        half = any(p.dtype in (torch.bfloat16, torch.float16) for p in inference.copy.model[0].parameters())
        tolerance = 5e-2 if half else 1e-3
    requests = probe_requests(inference.backend.tokenizer, min(16, rl.max_new_tokens), rl.temperature)
    with inference_session(inference):
        responses = inference.generate(requests)
    bad = [r.error for r in responses if r.finish_reason == "error"]
    if bad:
        raise RefitVerificationError(f"--rl-verify-model-weights-swap: the inference copy failed to generate the "
                                     f"probe batch: {bad[0]}")
    seqs = []
    for r in inference.rollout_shard.gather(responses):
        for resp in r:
            n = len(resp.token_ids) - resp.prompt_length
            seqs.append(TrainingSequence(token_ids=list(resp.token_ids),
                                         loss_mask=[0] * resp.prompt_length + [1] * n,
                                         inference_logprobs=[0.0] * resp.prompt_length + list(resp.logprobs),
                                         advantage=0.0, reward=0.0, group_index=0, env_id="refit-probe"))
    steps = build_step_batches(seqs, rl, ctx, 1, need_ref=False)
    for step in steps:
        score(ctx.model, step, "old_logprobs", rl.temperature, ctx)
    gap = logprob_gap(steps)
    worst = float(gap.get("logprob_gap_max", float("nan")))
    if not worst <= tolerance:
        raise RefitVerificationError(
            f"--rl-verify-model-weights-swap: after the refit the inference copy's log-probs differ from the "
            f"trainer's by up to {worst:.3g} (mean {gap.get('logprob_gap_mean', float('nan')):.3g}) on the probe "
            f"batch, above the tolerance {tolerance:g}: the refit (--refit-method {inference.copy.refit_method}) "
            f"or the inference layout is broken; drop --rl-inference-*-model-parallel-size to generate with the "
            f"training model itself.")
    log.info("--rl-verify-model-weights-swap: inference copy equals the trainer on the probe batch "
             "(max |log-prob difference| %.2e <= %g)", worst, tolerance)
    return worst
