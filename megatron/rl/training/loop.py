"""The training step and the pretraining driver.

:func:`train_step` is one optimizer step through megatron-core's pipeline schedules (``get_forward_backward_func``)
and is reused by ``train_rl.py`` with its own forward step and loss. :func:`pretrain` is the GPT pretraining
driver behind ``pretrain_gpt.py``: build the run (:class:`~megatron.rl.training.run.TrainingRun`, shared with
RL), resume, loop with Megatron-style iteration lines over the data, evaluate, save, write metrics.

Loss reporting: a loss function returns ``(loss, num_tokens, {name: value})``; a value that is a 2-element
tensor ``[sum, count]`` is reported as ``sum(sum) / sum(count)`` over all microbatches and data-parallel
ranks (token-weighted), a scalar value as its mean. The result is broadcast from the last pipeline stage,
so every rank returns the same dict.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import time
from functools import partial
from typing import Callable, Iterator

import torch

from megatron.rl import parallel_utils
from megatron.rl.runtime import setup_runtime
from megatron.rl.training.config import ConfigError, TrainingConfig
from megatron.rl.training.loop_control import LoopControl
from megatron.rl.training.run import PRETRAIN_RESUME, TrainingRun

log = logging.getLogger(__name__)

ForwardStepFunc = Callable[[Iterator, torch.nn.Module], tuple]


# --------------------------------------------------------------------------- loss reduction


def reduce_loss_dicts(losses: list[dict]) -> dict[str, float]:
    """Combine per-microbatch loss dicts over microbatches and DP ranks; broadcast from the last PP stage.

    ``losses``: what the schedule returned on this rank (empty except on the last pipeline stage).
    Returns ``{name: float}`` on every rank.
    """
    from megatron.core import parallel_state as ps

    out: dict[str, float] = {}
    if ps.is_pipeline_last_stage(ignore_virtual=True) and losses:
        dp_group = ps.get_data_parallel_group()
        for key in losses[0]:
            vals = [torch.as_tensor(d[key]).detach().float().view(-1) for d in losses]
            if vals[0].numel() == 2:  # [sum, count]: token-weighted over microbatches and DP ranks
                total = torch.stack(vals).sum(dim=0).double()
                parallel_utils.all_reduce_sum(total, dp_group)
                out[key] = float(total[0] / total[1].clamp(min=1))
            else:
                mean = torch.cat(vals).double().mean().view(1)
                parallel_utils.all_reduce_mean(mean, dp_group)
                out[key] = float(mean)
    return parallel_utils.broadcast_object_from_last_pipeline_stage(out)


# --------------------------------------------------------------------------- one step


def train_step(forward_step_func: ForwardStepFunc, data_iterator, model_chunks: list, optimizer, scheduler,
               num_microbatches: int, seq_length: int, micro_batch_size: int, forward_only: bool = False,
               scheduler_increment: int = 1) -> tuple[dict[str, float], float | None, bool]:
    """One iteration: zero grads, forward/backward over ``num_microbatches``, optimizer and scheduler step.

    Args:
        forward_step_func: ``(data_iterator, model) -> (output_tensor, loss_func)`` as megatron-core expects;
            ``loss_func(output_tensor) -> (loss, num_tokens, {name: value})`` (or the 2-tuple legacy form).
        data_iterator: this rank's microbatch iterator (a list of them, one per chunk, with virtual pipeline).
        model_chunks: DDP-wrapped chunks from :func:`~megatron.rl.training.model_provider.build_model`.
        optimizer, scheduler: from :func:`~megatron.rl.training.optimizer.build_optimizer` (unused when
            ``forward_only``).
        seq_length, micro_batch_size: shapes of the activations sent between pipeline stages.
        forward_only: evaluation; no grads, no step.

    Returns: ``(loss_dict, grad_norm, skipped)``; ``loss_dict`` is the same on every rank; ``grad_norm`` is
    None when forward_only; ``skipped`` is True when the optimizer skipped the update (fp16 overflow).
    """
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not forward_only:
        for chunk in model_chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
    forward_backward = get_forward_backward_func()
    losses = forward_backward(
        forward_step_func=forward_step_func,
        data_iterator=data_iterator,
        model=model_chunks if len(model_chunks) > 1 else model_chunks[0],
        num_microbatches=num_microbatches,
        seq_length=seq_length,
        micro_batch_size=micro_batch_size,
        forward_only=forward_only,
    )
    if forward_only:
        return reduce_loss_dicts(losses), None, False
    update_successful, grad_norm, _num_zeros = optimizer.step()
    if update_successful:
        scheduler.step(increment=scheduler_increment)
    return reduce_loss_dicts(losses), (float(grad_norm) if grad_norm is not None else None), not update_successful


# --------------------------------------------------------------------------- GPT forward step


def gpt_loss_func(loss_mask: torch.Tensor, output_tensor: torch.Tensor):
    """Masked mean LM loss. ``output_tensor``: per-token losses [b, s]; ``loss_mask``: [b, s] (1 = count)."""
    losses = output_tensor.float().view(-1)
    mask = loss_mask.float().view(-1)
    loss_sum = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    return loss_sum, num_tokens, {"lm loss": torch.stack([loss_sum.detach(), mask.sum().detach()])}


def gpt_forward_step(data_iterator, model):
    """megatron-core forward step for pretraining batches ``{"tokens", "labels", "loss_mask", "position_ids"}``."""

    device = setup_runtime().device
    batch = next(data_iterator)
    batch = {k: (v.to(device, non_blocking=True) if torch.is_tensor(v) else v) for k, v in batch.items()}
    output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"])
    return output, partial(gpt_loss_func, batch["loss_mask"])


def evaluate(forward_step_func: ForwardStepFunc, data_iterator, model_chunks: list, eval_iters: int,
             num_microbatches: int, seq_length: int, micro_batch_size: int) -> dict[str, float]:
    """Mean of each reported loss over ``eval_iters`` forward-only iterations (model left in train mode)."""
    for chunk in model_chunks:
        chunk.eval()
    totals: dict[str, float] = {}
    try:
        with torch.no_grad():
            for _ in range(eval_iters):
                losses, _, _ = train_step(forward_step_func, data_iterator, model_chunks, None, None,
                                          num_microbatches, seq_length, micro_batch_size, forward_only=True)
                for k, v in losses.items():
                    totals[k] = totals.get(k, 0.0) + v / eval_iters
    finally:
        for chunk in model_chunks:
            chunk.train()
    return totals


# --------------------------------------------------------------------------- logging


@dataclasses.dataclass
class IterationStats:
    """What one training iteration reported (kept in :class:`PretrainResult.history`)."""

    iteration: int
    losses: dict[str, float]
    grad_norm: float | None
    learning_rate: float
    skipped: bool
    elapsed_s: float
    consumed_samples: int


def format_iteration_line(stats: IterationStats, train_iters: int, global_batch_size: int, seq_length: int,
                          loss_scale: float | None = None, skipped_total: int = 0, nan_total: int = 0) -> str:
    """A Megatron-LM-style iteration line (plus tokens/s)."""
    ms = stats.elapsed_s * 1000.0
    parts = [f" iteration {stats.iteration:8d}/{train_iters:8d}",
             f"consumed samples: {stats.consumed_samples:12d}",
             f"elapsed time per iteration (ms): {ms:.1f}",
             f"learning rate: {stats.learning_rate:.6E}",
             f"global batch size: {global_batch_size:5d}"]
    parts += [f"{k}: {v:.6E}" for k, v in stats.losses.items()]
    if loss_scale is not None:
        parts.append(f"loss scale: {loss_scale:.1f}")
    if stats.grad_norm is not None:
        parts.append(f"grad norm: {stats.grad_norm:.3f}")
    parts.append(f"number of skipped iterations: {skipped_total:3d}")
    parts.append(f"number of nan iterations: {nan_total:3d}")
    tokens_per_s = global_batch_size * seq_length / max(stats.elapsed_s, 1e-9)
    parts.append(f"tokens/s: {tokens_per_s:.1f}")
    return " | ".join(parts) + " |"


def current_lr(optimizer) -> float:
    return float(optimizer.param_groups[0]["lr"])


def loss_scale_of(optimizer) -> float | None:
    scale = optimizer.get_loss_scale()
    value = float(scale.item() if torch.is_tensor(scale) else scale)
    return value if value != 1.0 else None


# --------------------------------------------------------------------------- driver


@dataclasses.dataclass
class PretrainResult:
    iteration: int
    consumed_samples: int
    history: list[IterationStats]
    eval_history: list[tuple[int, dict[str, float]]]
    model_chunks: list
    optimizer: object
    scheduler: object


def _data_iterators(cfg: TrainingConfig, tokenizer, consumed_samples: int, split: str, num_samples: int | None):
    """One iterator per model chunk (virtual pipeline chunks each walk the same microbatches)."""
    from megatron.core import parallel_state as ps

    from megatron.rl.training.data import build_pretraining_data  # heavy: megatron-core's datasets

    n_chunks = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    t = cfg.train
    iters = [build_pretraining_data(cfg.data, tokenizer, seq_length=cfg.model.seq_length,
                                    micro_batch_size=t.micro_batch_size, global_batch_size=t.global_batch_size,
                                    dp_rank=ps.get_data_parallel_rank(), dp_size=ps.get_data_parallel_world_size(),
                                    seed=t.seed, consumed_samples=consumed_samples, num_samples=num_samples,
                                    split=split)
             for _ in range(n_chunks)]
    return iters if n_chunks > 1 else iters[0]


def pretrain(cfg: TrainingConfig, forward_step_func: ForwardStepFunc = gpt_forward_step,
             metrics_writer=None) -> PretrainResult:
    """Pretrain a GPT as configured. Call on every rank (after ``parse_args``; it initialises megatron).

    Returns the final iteration, consumed samples, per-iteration stats and the trained model/optimizer.
    """
    t, lg = cfg.train, cfg.logging
    if t.train_iters is None:
        raise ConfigError("--train-iters is required for pretraining.")
    run = TrainingRun.build(cfg, PRETRAIN_RESUME, metrics_writer=metrics_writer)
    model, optimizer, scheduler, tokenizer, writer = run.model, run.optimizer, run.scheduler, run.tokenizer, run.writer
    start = run.resume()
    iteration, consumed = start.iteration, int(start.run_state.get("consumed_samples", 0))
    train_iter, valid_iter = _pretrain_iterators(cfg, tokenizer, consumed)
    history: list[IterationStats] = []
    evals: list[tuple[int, dict[str, float]]] = []

    def save(it: int) -> None:
        # a validation at this iteration scores the checkpoint for --save-retain-best (validation/<loss name>)
        measured = {f"validation/{k}": v for at, result in evals[-1:] if at == it for k, v in result.items()}
        run.save(it, {"consumed_samples": consumed, "iteration": it}, measured)

    skipped_total = nan_total = 0
    window_start, window_iters = time.perf_counter(), 0
    control = LoopControl.from_config(cfg, save, last_saved=iteration if run.load_dir else None)
    log.info("training from iteration %d to %d (global batch %d = %d microbatches x %d x DP %d)", iteration,
             t.train_iters, t.global_batch_size, t.num_microbatches, t.micro_batch_size,
             cfg.parallel.data_parallel_size)
    while iteration < t.train_iters:
        step_start = time.perf_counter()
        losses, grad_norm, skipped = train_step(forward_step_func, train_iter, model, optimizer, scheduler,
                                                t.num_microbatches, cfg.model.seq_length, t.micro_batch_size)
        iteration += 1
        consumed += t.global_batch_size
        skipped_total += int(skipped)
        nan_total += int(any(math.isnan(v) or math.isinf(v) for v in losses.values()))
        stats = IterationStats(iteration, losses, grad_norm, current_lr(optimizer), skipped,
                               time.perf_counter() - step_start, consumed)
        history.append(stats)
        window_iters += 1
        if writer is not None and iteration % lg.tensorboard_log_interval == 0:
            writer.log_iteration(stats, t.global_batch_size * cfg.model.seq_length)
        if iteration % lg.log_interval == 0 or iteration == t.train_iters:
            window = dataclasses.replace(stats, elapsed_s=(time.perf_counter() - window_start) / window_iters)
            log.info(format_iteration_line(window, t.train_iters, t.global_batch_size, cfg.model.seq_length,
                                           loss_scale_of(optimizer), skipped_total, nan_total))
            window_start, window_iters = time.perf_counter(), 0
        if valid_iter is not None and iteration % t.eval_interval == 0:
            evals.append((iteration, _validate(cfg, forward_step_func, valid_iter, model, iteration, writer)))
        if run.threads is not None:  # fewer CPU threads while other processes keep cores busy
            run.threads.update()
        if control.after_iteration(iteration):
            break
    control.finish(iteration)
    run.close()
    return PretrainResult(iteration, consumed, history, evals, model, optimizer, scheduler)


def _pretrain_iterators(cfg: TrainingConfig, tokenizer, consumed: int) -> tuple:
    """(training data from ``consumed`` samples on, validation data or None without --eval-interval/--eval-iters)."""
    t = cfg.train
    train_iter = _data_iterators(cfg, tokenizer, consumed, "train", t.train_iters * t.global_batch_size)
    valid_iter = None
    if t.eval_interval and t.eval_iters > 0:
        n_eval = (t.train_iters // t.eval_interval + 1) * t.eval_iters * t.global_batch_size
        valid_iter = _data_iterators(cfg, tokenizer, 0, "valid", n_eval)
    return train_iter, valid_iter


def _validate(cfg: TrainingConfig, forward_step_func: ForwardStepFunc, valid_iter, model, iteration: int,
              writer) -> dict[str, float]:
    """One validation pass at ``iteration``: its losses, logged (and written to TensorBoard / W&B)."""
    t = cfg.train
    result = evaluate(forward_step_func, valid_iter, model, t.eval_iters, t.num_microbatches, cfg.model.seq_length,
                      t.micro_batch_size)
    log.info(" validation at iteration %d | %s", iteration,
             " | ".join(f"{k}: {v:.6E} | {k} PPL: {math.exp(min(v, 20)):.3f}" for k, v in result.items()))
    if writer is not None:
        writer.log_scalars({f"validation/{k}": v for k, v in result.items()}, iteration)
    return result
