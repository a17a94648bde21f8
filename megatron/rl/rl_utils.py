"""One RL iteration, orchestrated: collect -> score -> log-probs -> pack -> loss -> optimizer steps.

Must not hold math: advantages, losses and packing live in pure modules (:mod:`megatron.rl.algorithms`,
:mod:`megatron.rl.rollout.sequences`, :mod:`megatron.rl.sequence_packing_utils`), forward steps in
:mod:`megatron.rl.rl_loss`; this module only moves data between them and the process groups. Updated weights
reach the generating backend only through
:meth:`~megatron.rl.rollout.source.RolloutSource.weights_updated`.

The five steps: docs/architecture.md ("One iteration") and docs/rollouts.md.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import statistics
import time
from typing import Any

import torch

from megatron.rl import parallel_utils
from megatron.rl.agent.api import Agent
from megatron.rl.algorithms import LossNormalizers, mismatch_sums
from megatron.rl.inference.api import InferenceInterface, InferenceResponse
from megatron.rl.inference.control import control_of
from megatron.rl.rl_config import RLConfig
from megatron.rl.rl_loss import scoring_forward_step, training_forward_step
from megatron.rl.routing.replay import RouterReplayError, disagreement_share, router_replay_of
from megatron.rl.observe.metrics import RolloutObservations
from megatron.rl.rollout.collection import data_parallel
from megatron.rl.rollout.gather import gather_sequences
from megatron.rl.rollout.sequences import CollectionStats, TrainingSequence, staleness_metrics
from megatron.rl.rollout.source import RolloutSource
from megatron.rl.packing.microbatches import (
    MicrobatchDataLoader,
    get_microbatch_dataloader,
    shared_microbatch_shapes,
    token_slots,
)
from megatron.rl.packing.plan import split_evenly
from megatron.rl.packing.prefix_sharing import plan_shared_packing, sharing_applies
from megatron.rl.sequence_packing_utils import PackedBatch, build_rank_batch, distribute_bins, plan_packing
from megatron.rl.training.loop import train_step
from megatron.rl.base.errors import RLError

log = logging.getLogger(__name__)


class RLDataError(RLError, RuntimeError):
    """The agents produced nothing trainable (no prompts, every rollout failed, ...)."""


@dataclasses.dataclass(frozen=True)
class StepContext:
    """What an RL iteration needs besides the configs: model, optimizer, agents, backend, groups.

    Built once, whole, when the run is built (:func:`megatron.rl.rl_loop.build_run`); nothing changes it after.
    """

    model: list  # DDP-wrapped model chunks (the policy)
    optimizer: Any
    scheduler: Any
    agent: Agent
    inference: InferenceInterface
    pad_token_id: int
    seq_length: int
    micro_batch_size: int
    global_batch_size: int  # sequences per optimizer step
    seed: int
    device: torch.device
    use_thd: bool = False
    ref_model: list | None = None  # only when --grpo-kl-beta > 0
    rollouts: RolloutSource | None = None  # where rl_iteration's groups come from (megatron.rl.rollout.source)
    packed_attention: str = "auto"  # --rl-packed-attention (megatron.rl.packing.packed_forward.choose_attention)
    # --seq-length: packed rows may be longer (--rl-packing-row-length), a rollout may not (None: the row length)
    max_sequence_length: int | None = None


# --------------------------------------------------------------------------- 3. packing


@dataclasses.dataclass
class StepBatch:
    """One optimizer step's data on this rank."""

    batch: PackedBatch
    num_microbatches: int
    normalizers: LossNormalizers
    num_real_tokens: int  # over all ranks: tokens computed (a prompt shared by packed rollouts counts once)
    num_rows_total: int  # over all ranks, padding rows included
    num_token_slots: int  # positions computed per forward over all ranks, padding included
    dynamic_shapes: bool = False  # micro-batches cropped to their rows' real extent
    length_multiple: int = 1
    shapes: list[tuple[int, int]] | None = None  # per micro-batch, shared by all data-parallel ranks
    num_shared_tokens: int = 0  # rollout tokens not computed: read from a packed group's shared prompt

    def microbatches(self, micro_batch_size: int) -> MicrobatchDataLoader:
        return get_microbatch_dataloader(self.batch, micro_batch_size, self.dynamic_shapes, self.length_multiple,
                                         self.shapes)


def _pipeline_size() -> int:
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size()


def microbatch_shapes(ctx: StepContext, rl: RLConfig) -> tuple[bool, int, bool]:
    """(dynamic shapes, length multiple, shapes shared over data-parallel ranks) for this run's micro-batches.

    Fixed shapes with pipeline parallelism (the p2p buffers are sized from them) or
    ``--rl-fixed-microbatch-shapes``; the length multiple is the TP size with sequence parallelism.
    Shared with expert parallelism: the MoE layers exchange tokens between data-parallel ranks, and
    megatron-core's allgather dispatcher all-gathers equally shaped tensors (a rank-dependent crop made
    the ranks' collectives disagree in size and gloo abort).
    """
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_model_config

    if rl.fixed_microbatch_shapes or ps.get_pipeline_model_parallel_world_size() > 1:
        return False, 1, False
    sequence_parallel = getattr(get_model_config(ctx.model[0]), "sequence_parallel", False)
    multiple = ps.get_tensor_model_parallel_world_size() if sequence_parallel else 1
    return True, multiple, ps.get_expert_model_parallel_world_size() > 1


def build_step_batches(sequences: list[TrainingSequence], rl: RLConfig, ctx: StepContext, num_steps: int,
                       need_ref: bool) -> list[StepBatch]:
    """Split the sequences into ``num_steps`` optimizer steps and lay out this rank's rows of each."""
    _, dp_rank, dp_size = data_parallel()
    has_inference_lp = all(s.inference_logprobs is not None for s in sequences)
    if rl.loss.needs_inference_logprobs and not has_inference_lp:
        raise RLDataError("--rl-inference-logprobs-is-correction / --rl-importance-sampling-mode / --rl-reject-"
                          "sequence-*-log-ratio need log-probs from the inference backend, but some rollouts have none "
                          "(does the server return logprobs?)")
    check_sequence_lengths(sequences, ctx.max_sequence_length)
    max_per_bin = rl.max_sequences_per_bin if rl.use_sequence_packing else 1
    routes = replay_routes(sequences, rl)
    dynamic, multiple, shared = microbatch_shapes(ctx, rl)
    share = sharing_applies(rl.share_prompt_prefix, rl.use_sequence_packing, ctx.use_thd, _pipeline_size())
    steps = []
    for rng in split_evenly(len(sequences), num_steps):
        chunk = [sequences[i] for i in rng]
        if not chunk:
            continue
        if share:
            info = plan_shared_packing([s.token_ids for s in chunk], [s.loss_mask for s in chunk], ctx.seq_length,
                                       max_per_bin)
        else:
            info = plan_packing([len(s.token_ids) for s in chunk], ctx.seq_length, max_per_bin)
        dist_plan = distribute_bins(info.num_bins, dp_size, ctx.micro_batch_size, rl.packing_algo)
        per_token = {"old_logprobs": [torch.zeros(len(s.token_ids) - 1) for s in chunk]}
        if need_ref:
            per_token["ref_logprobs"] = [torch.zeros(len(s.token_ids) - 1) for s in chunk]
        if has_inference_lp:
            per_token["inference_logprobs"] = [torch.tensor(s.inference_logprobs[1:]) for s in chunk]
        if all(s.policy_versions is not None for s in chunk):  # asynchronous rollouts: the mismatch by staleness
            per_token["policy_versions"] = [torch.tensor(s.policy_versions[1:], dtype=torch.float64) for s in chunk]
        batch = build_rank_batch(info, dist_plan, dp_rank, [s.token_ids for s in chunk],
                                 [s.loss_mask for s in chunk], ctx.pad_token_id, per_token=per_token,
                                 per_sequence={"advantages": torch.tensor([s.advantage for s in chunk])},
                                 token_aligned={"routes": [routes[i] for i in rng]} if routes else None)
        num_tokens = sum(sum(s.loss_mask[1:]) for s in chunk)
        num_seqs = sum(1 for s in chunk if any(s.loss_mask[1:]))
        steps.append(StepBatch(batch, dist_plan.num_microbatches,
                               LossNormalizers(num_tokens=float(num_tokens), num_sequences=float(num_seqs),
                                               max_len=float(rl.max_new_tokens)),
                               num_real_tokens=sum(info.seq_lengths),
                               num_shared_tokens=sum(len(s.token_ids) for s in chunk) - sum(info.seq_lengths),
                               num_rows_total=dist_plan.num_microbatches * ctx.micro_batch_size * dp_size,
                               num_token_slots=token_slots(info, dist_plan, dynamic, multiple, shared),
                               dynamic_shapes=dynamic, length_multiple=multiple,
                               shapes=shared_microbatch_shapes(info, dist_plan, multiple) if dynamic and shared
                               else None))
    return steps


def check_sequence_lengths(sequences: list[TrainingSequence], limit: int | None) -> None:
    """Refuse a rollout longer than ``limit`` (``--seq-length``; None: no limit): the engine never generates one,
    another backend may, and a packed row longer than ``--seq-length`` would otherwise take it."""
    longest = max((len(s.token_ids) for s in sequences), default=0)
    if limit is not None and longest > limit:
        raise RLDataError(f"a rollout has {longest} tokens, more than --seq-length={limit}: raise --seq-length or "
                          f"lower the backend's generation limit (max_tokens, --rl-max-new-tokens)")


def replay_routes(sequences: list[TrainingSequence], rl: RLConfig) -> list[torch.Tensor] | None:
    """Each sequence's MoE routes ([L, layers, k]) with ``--rl-router-replay rollout``; None when off."""
    if rl.router_replay == "off":
        return None
    missing = [s for s in sequences if s.routes is None]
    if missing:
        envs = sorted({s.env_id for s in missing})
        raise RouterReplayError(f"--rl-router-replay rollout: {len(missing)} of {len(sequences)} rollouts carry no MoE "
                                f"routes (environments {envs}); only the in-process engine records them, and an agent "
                                f"must pass InferenceResponse.routes on to its TokenRollout (RewardOnlyAgent does)")
    return [s.routes for s in sequences]


def replay_metrics(model: list) -> dict[str, float]:
    """Since the last call, over all ranks ({} without replay; collective): ``router_replay_routes``, the (token, MoE
    layer) routes replayed, and ``router_replay_disagreement``, the share of them whose experts the trainer's own
    router would have chosen otherwise."""
    replay = router_replay_of(model)
    if replay is None:
        return {}
    counts = torch.tensor(replay.take_disagreement(), dtype=torch.float64)
    parallel_utils.all_reduce_sum(counts)
    return {"router_replay_disagreement": disagreement_share(counts.tolist()), "router_replay_routes": float(counts[1])}


# --------------------------------------------------------------------------- 4-5. scoring and training


def schedule_shape(ctx: StepContext) -> dict:
    """``seq_length`` / ``micro_batch_size`` for megatron's schedule (the p2p activation shape)."""
    if ctx.use_thd:  # rows are flattened into one THD sequence per micro-batch
        return dict(seq_length=ctx.seq_length * ctx.micro_batch_size, micro_batch_size=1)
    return dict(seq_length=ctx.seq_length, micro_batch_size=ctx.micro_batch_size)


def score(model: list, step: StepBatch, value_name: str, temperature: float, ctx: StepContext) -> None:
    """Fill ``step.batch.values[value_name]`` with the model's log-probs (forward-only, eval mode)."""
    for chunk in model:
        chunk.eval()
    try:
        with torch.no_grad():
            loader = step.microbatches(ctx.micro_batch_size)
            train_step(scoring_forward_step(value_name, temperature, ctx.device, ctx.use_thd,
                                            ctx.packed_attention), iter(loader), model,
                       None, None, step.num_microbatches, forward_only=True, **schedule_shape(ctx))
    finally:
        for chunk in model:
            chunk.train()


def logprob_gap(steps: list[StepBatch], iteration: int | None = None) -> dict[str, float]:
    """Train-inference mismatch over generated tokens (:func:`~megatron.rl.algorithms.mismatch_sums`): mean and
    max |old_logprobs - inference_logprobs| and the k3 estimate of KL(inference || old).

    With asynchronous rollouts (policy versions per token) and ``iteration`` (the version being trained), also
    over the *fresh* tokens alone (generated by this version: the train-inference gap of the synchronous path,
    ~1e-6 in fp32, except where a partial rollout continued over a KV cache older weights computed) and the stale
    ones (the policy's movement since they were generated):
    ``logprob_gap_fresh_mean/_max``, ``logprob_gap_stale_mean`` and the stale tokens' ``mismatch_kl_k3_stale``.
    """
    from megatron.core import parallel_state as ps

    if not steps or any("inference_logprobs" not in s.batch.values for s in steps):
        return {}  # the backend returned no log-probs (same answer on every rank: no collective skipped)
    split = iteration is not None and all("policy_versions" in s.batch.values for s in steps)
    stats = None
    if ps.is_pipeline_last_stage(ignore_virtual=True):
        parts = ("all", "fresh", "stale") if split else ("all",)
        total = torch.zeros(len(parts), 3, dtype=torch.float64)  # sum |gap|, sum k3, tokens
        worst = torch.zeros(len(parts), dtype=torch.float64)
        for s in steps:
            v, mask = s.batch.values, s.batch.loss_mask.bool()
            masks = [mask]
            if split:
                fresh = v["policy_versions"] == iteration
                masks += [mask & fresh, mask & ~fresh]
            for i, m in enumerate(masks):
                sums = mismatch_sums(v["old_logprobs"], v["inference_logprobs"], m)
                total[i] += torch.stack([sums["abs_sum"], sums["k3_sum"], sums["num_tokens"]])
                worst[i] = torch.maximum(worst[i], sums["abs_max"])
        dp_group = ps.get_data_parallel_group()
        parallel_utils.all_reduce_sum(total, dp_group)
        parallel_utils.all_reduce_max(worst, dp_group)
        mean = total[:, 0] / total[:, 2].clamp(min=1)
        k3 = total[:, 1] / total[:, 2].clamp(min=1)
        stats = {"logprob_gap_mean": float(mean[0]), "logprob_gap_max": float(worst[0]), "mismatch_kl_k3": float(k3[0])}
        if split and total[1, 2] > 0:
            stats.update(logprob_gap_fresh_mean=float(mean[1]), logprob_gap_fresh_max=float(worst[1]))
        if split and total[2, 2] > 0:
            stats.update(logprob_gap_stale_mean=float(mean[2]), mismatch_kl_k3_stale=float(k3[2]))
    return parallel_utils.broadcast_object_from_last_pipeline_stage(stats)


def probe_logprob_gap(ctx: StepContext, rl: RLConfig, responses: list[InferenceResponse]) -> dict[str, float]:
    """The trainer's teacher-forced log-probs of generated ``responses`` against the backend's own
    (:func:`logprob_gap`, one step through the usual layout and scoring): an inference copy's parity check
    (:func:`megatron.rl.layout.parity.verify_weights_swap`). Collective over the world."""
    seqs = [TrainingSequence(token_ids=list(r.token_ids),
                             loss_mask=[0] * r.prompt_length + [1] * (len(r.token_ids) - r.prompt_length),
                             inference_logprobs=[0.0] * r.prompt_length + list(r.logprobs),
                             advantage=0.0, reward=0.0, group_index=0, env_id="refit-probe") for r in responses]
    steps = build_step_batches(seqs, rl, ctx, 1, need_ref=False)
    for step in steps:
        score(ctx.model, step, "old_logprobs", rl.temperature, ctx)
    return logprob_gap(steps)


@dataclasses.dataclass
class IterationResult:
    iteration: int
    metrics: dict[str, float]
    observations: RolloutObservations | None = None  # per-environment summaries and sample completions


def rl_iteration(ctx: StepContext, rl: RLConfig, iteration: int) -> IterationResult:
    """Run one RL iteration (all ranks); returns the metrics (identical on every rank)."""
    t0 = time.perf_counter()
    # CPU seconds of this process (every thread) in the iteration: steadier than wall time on a shared machine
    cpu0 = time.process_time()
    groups = ctx.rollouts.collect(iteration)  # this DP rank's P / DP groups (deterministic given the seed)
    t_gen = time.perf_counter() - t0
    sequences, stats, observed = gather_sequences(groups, rl)
    if stats.groups == 0:
        raise RLDataError(f"the agents produced no prompt groups at iteration {iteration}: check "
                          f"--langrl-env-config={rl.env_config} (datasets, weights)")
    metrics = {**_collection_metrics(stats, t_gen), **observed.metrics, **_engine_metrics(ctx.inference),
               # off-policy accounting: the policy version of every generated token, where the source labels them
               **staleness_metrics([s.policy_versions for s in sequences], iteration)}
    if sequences:
        num_steps = rl.rollouts_per_step // ctx.global_batch_size
        steps = build_step_batches(sequences, rl, ctx, num_steps, rl.loss.needs_ref_logprobs)
        metrics.update(update_policy(ctx, rl, steps, iteration))
        metrics.update(num_sequences=float(len(sequences)), time_generate_s=t_gen)
    else:
        log.warning("iteration %d: nothing to train on (%d groups: %d failed rollouts, %d groups with < 2 ok "
                    "rollouts, %d groups with identical rewards filtered); skipping the update%s", iteration,
                    stats.groups, stats.failed_rollouts, stats.dropped_groups_too_few_ok,
                    stats.filtered_same_reward_groups,
                    f"; failures: {stats.failure_reasons}" if stats.failure_reasons else "")
        # The schedule counts RL iterations, skipped ones included, so resumed and uninterrupted runs agree.
        ctx.scheduler.step(increment=1)
        metrics.update(skipped_update=1.0)
    metrics.update(time_total_s=time.perf_counter() - t0, time_cpu_s=time.process_time() - cpu0)
    # The weights reach the generating backend (a copy's refit); held partial rollouts continue after it.
    refit_s = ctx.rollouts.weights_updated(iteration + 1, changed=bool(sequences))
    metrics.update(refit_metrics(refit_s, metrics["time_total_s"]))
    return IterationResult(iteration, metrics, observed)


def _engine_metrics(inference: InferenceInterface) -> dict[str, float]:
    """Engine steps run so far by an in-process engine (batch occupancy = tokens / steps)."""
    steps = control_of(inference).engine_steps
    return {"engine_steps_total": float(steps)} if isinstance(steps, int) else {}


def refit_metrics(refit_s: float | None, total_s: float) -> dict[str, float]:
    """``time_refit_s`` and ``refit_fraction`` (of the iteration, refit included) when a refit ran."""
    if refit_s is None:
        return {}
    return {"time_refit_s": refit_s, "refit_fraction": refit_s / max(total_s + refit_s, 1e-9)}


def old_logprobs_from_training_forward(rl: RLConfig, num_steps: int) -> bool:
    """Whether the old-policy log-probs can come from the training forward instead of a scoring pass.

    Only when the rollouts are consumed by exactly one optimizer step in one pass: that step's forward
    runs before any update, on the weights that a scoring pass would use, in the same micro-batches, so
    its detached log-probs are the scoring pass's numbers. Not with dropout (the training forward is
    stochastic), several steps or passes (later ones need the pre-update policy), with a separate inference
    layout (its copy generated the rollouts: the scoring pass stays the check of the refit), or when
    ``--rl-recompute-old-logprobs`` asks for the pass, or with off-policy asynchronous rollouts (the proximal
    log-probs of decoupled PPO get their own pass). Reference log-probs still get their own pass.
    """
    return (rl.grpo_iterations == 1 and num_steps == 1 and rl.deterministic_forward
            and not rl.recompute_old_logprobs and not rl.inference_layout.enabled
            and not rl.async_rollouts.off_policy)  # decoupled PPO: proximal log-probs from their own pass


def update_policy(ctx: StepContext, rl: RLConfig, steps: list[StepBatch], iteration: int | None = None,
                  ) -> dict[str, float]:
    """Score old (and reference) log-probs, then ``--grpo-iterations`` passes of optimizer steps.

    Returns the training metrics (losses and loss stats, grad norm, log-prob gap, packing efficiency,
    timings), identical on every rank. ``iteration``: the policy version being trained (splits the log-prob gap
    of asynchronous rollouts by staleness, see :func:`logprob_gap`).
    """
    _, _, dp_size = data_parallel()
    t1 = time.perf_counter()
    need_ref = rl.loss.needs_ref_logprobs
    from_forward = old_logprobs_from_training_forward(rl, len(steps))
    replay_metrics(ctx.model)  # MoE routing replay: count from here (the policy that sampled, before any update)
    # the forward-only passes before any update: the old policy's (unless the training forward gives them) and
    # the reference's
    passes = [(ctx.model, "old_logprobs")] * (not from_forward) + [(ctx.ref_model, "ref_logprobs")] * need_ref
    for step in steps:
        for model, value_name in passes:
            score(model, step, value_name, rl.temperature, ctx)
    metrics = {} if from_forward else {**logprob_gap(steps, iteration), **replay_metrics(ctx.model)}
    t_lp = time.perf_counter() - t1

    t2 = time.perf_counter()
    reports, grad_norms, skipped = [], [], 0
    total_updates = rl.grpo_iterations * len(steps)
    for pass_index in range(rl.grpo_iterations):
        for step_index, step in enumerate(steps):
            # The LR schedule counts RL iterations (--train-iters, --lr-warmup-iters are in iterations):
            # advance it once, on the iteration's last optimizer step.
            last = pass_index * len(steps) + step_index == total_updates - 1
            fwd = training_forward_step(rl.loss, rl.loss_aggregation, step.normalizers, rl.temperature,
                                        grad_scale=float(step.num_microbatches * dp_size), device=ctx.device,
                                        use_thd=ctx.use_thd, old_logprobs_from_forward=from_forward,
                                        packed_attention=ctx.packed_attention)
            report, grad_norm, was_skipped = train_step(fwd, iter(step.microbatches(ctx.micro_batch_size)), ctx.model,
                                                        ctx.optimizer, ctx.scheduler, step.num_microbatches,
                                                        scheduler_increment=int(last), **schedule_shape(ctx))
            reports.append(report)
            if grad_norm is not None:
                grad_norms.append(grad_norm)
            skipped += int(was_skipped)
    if from_forward:  # the training forward filled old_logprobs (before its update): the same gap
        metrics.update(logprob_gap(steps, iteration))
        metrics.update(replay_metrics(ctx.model))
    t_train = time.perf_counter() - t2

    for key in reports[0]:
        metrics[key.replace(" ", "_")] = statistics.fmean(r[key] for r in reports if key in r)
    real_tokens = sum(s.num_real_tokens for s in steps)
    metrics.update(
        grad_norm=statistics.fmean(grad_norms) if grad_norms else float("nan"), optimizer_steps=float(len(reports)),
        skipped_steps=float(skipped), packing_efficiency=real_tokens / max(sum(s.num_token_slots for s in steps), 1),
        train_tokens_per_s=real_tokens * rl.grpo_iterations / max(t_train, 1e-9),
        loss_tokens=sum(s.normalizers.num_tokens for s in steps),  # tokens whose log-prob enters the loss
        prompt_tokens_shared=sum(s.num_shared_tokens for s in steps) / max(
            real_tokens + sum(s.num_shared_tokens for s in steps), 1),
        time_logprobs_s=t_lp, time_train_s=t_train)
    return metrics


def _collection_metrics(stats: CollectionStats, t_gen: float) -> dict[str, float]:
    rewards = stats.rewards
    return {
        "reward_mean": statistics.fmean(rewards) if rewards else float("nan"),
        "reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
        "response_length_mean": stats.generated_tokens / stats.ok_rollouts if stats.ok_rollouts else 0.0,
        "failed_rollouts": float(stats.failed_rollouts),
        "filtered_groups": float(stats.filtered_same_reward_groups + stats.dropped_groups_too_few_ok),
        "generated_tokens": float(stats.generated_tokens),
        "generation_tokens_per_s": stats.generated_tokens / max(t_gen, 1e-9),
    }


def finite_or_raise(metrics: dict[str, float], names: tuple[str, ...] = ("rl_loss",)) -> None:
    """A NaN/inf loss means a wrong update happened or is about to: stop with the iteration's numbers."""
    bad = {k: metrics[k] for k in names if k in metrics and not math.isfinite(metrics[k])}
    if bad:
        raise FloatingPointError(f"non-finite training metrics {bad}; all metrics: {metrics}")
