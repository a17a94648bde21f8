"""The start-up summary of an RL run: what it starts from and how it generates, packs and lays out its work.

One log record before the first iteration: iterations and batch, start checkpoint, backend, layout, rollouts
(:meth:`RolloutSource.describe`), packing (:meth:`~megatron.rl.packing.layout_choice.TrainingLayout.describe`),
threads, and the flags ``--use-checkpoint-args`` took from the checkpoint.

Example: docs/observe.md.
"""
from __future__ import annotations

import textwrap
from typing import Any

from megatron.rl.inference.api import backend_class

__all__ = ["run_summary", "checkpoint_args_line"]


def _start(cfg, start) -> str:
    loaded = start.loaded
    c = cfg.checkpoint
    if start.from_checkpoint and loaded is not None:
        if c.finetune:
            return f"the weights of {loaded.path} (--finetune: iteration 0, fresh optimizer and prompt streams)"
        restored = [name for name, done in (("optimizer", loaded.loaded_optimizer),
                                            ("scheduler", loaded.loaded_scheduler), ("RNG", loaded.loaded_rng)) if done]
        return (f"resumed from {loaded.path} at iteration {start.iteration} (weights, "
                f"{', '.join(restored + ['prompt positions'])})")
    if c.pretrained_checkpoint:
        return f"the pretrained checkpoint {c.pretrained_checkpoint} (weights only)"
    return "randomly initialised weights (no --pretrained-checkpoint)"


def _backend(rl) -> str:
    name = rl.inference_backend
    if backend_class(name).in_process_engine:
        text = "megatron (the in-process engine on the " + \
            ("inference copy)" if rl.inference_layout.enabled else "training weights)")
    elif rl.inference_server_url:
        text = f"{name} at {rl.inference_server_url}" + (" (off-policy server)" if rl.off_policy_server else "")
    else:
        text = name
    if rl.serve_inference:
        text += f"; serving the policy at {rl.serve_inference}"
    return text


def _layout(cfg, rl) -> str:
    p = cfg.parallel
    text = (f"TP={p.tensor_model_parallel_size} PP={p.pipeline_model_parallel_size} "
            f"EP={p.expert_model_parallel_size} DP={p.data_parallel_size} (world {p.world_size})")
    if rl.inference_layout.enabled:
        s = rl.inference_layout.sizes(cfg)
        method = rl.inference_layout.refit_method or "gloo on CPU, nccl on CUDA"
        return text + f"; generation on an inference copy at TP={s.tp} PP={s.pp} EP={s.ep} (refit: {method})"
    if not backend_class(rl.inference_backend).in_process_engine:
        return text + "; generation on the backend's own devices"
    return text + "; generation at the training layout"


def _packing(cfg, rl) -> str:
    """The rows a step is laid out in and why (``rl.training_layout``, resolved from ``--rl-layout``), wrapped."""
    layout = rl.training_layout
    if layout is None:  # an RLConfig built by hand: its use_sequence_packing decides, rows of --seq-length
        text = (f"sequence packing into --seq-length {cfg.model.seq_length} rows" if rl.use_sequence_packing
                else "off (one sequence per row)")
    else:
        text = layout.describe()
    if rl.use_sequence_packing:
        text += f" (attention {rl.packed_attention}, at most {rl.max_sequences_per_bin} sequences per row)"
    indent = " " * 12  # under the text after "  packing:  "
    return textwrap.fill(text, width=120, initial_indent=indent, subsequent_indent=indent, break_on_hyphens=False,
                         break_long_words=False).lstrip()


def checkpoint_args_line(cfg: Any) -> str | None:
    """``  from checkpoint (--use-checkpoint-args): <flags>`` wrapped to 120 columns, or None when no flag came
    from a checkpoint."""
    if not cfg.checkpoint_args:
        return None
    return textwrap.fill(", ".join(cfg.checkpoint_args), width=120, initial_indent="  from checkpoint "
                         "(--use-checkpoint-args): ", subsequent_indent=" " * 4, break_on_hyphens=False,
                         break_long_words=False)


def run_summary(cfg: Any, rl: Any, start: Any, rollouts: str, threads: str | None = None,
                malloc: str | None = None) -> str:
    """The summary text for ``cfg`` (TrainingConfig), ``rl`` (RLConfig), ``start`` (the run's
    :class:`~megatron.rl.training.run.Resumed`) and ``rollouts`` (the rollout source's
    :meth:`~megatron.rl.rollout.source.RolloutSource.describe`); ``threads``: the CPU thread budget's
    description and ``malloc`` what ``--cpu-malloc`` did (None on GPUs: no line). Pure: reads its arguments only."""
    steps = max(rl.grpo_iterations * rl.rollouts_per_step // cfg.train.global_batch_size, 1)
    lines = [f"RL run: {cfg.train.train_iters} iterations from {start.iteration} ({rl.prompts_per_step} prompts x "
             f"{rl.group_size} rollouts each, {steps} optimizer step{'s' if steps > 1 else ''} per iteration)",
             f"  start:    {_start(cfg, start)}",
             f"  backend:  {_backend(rl)}",
             f"  layout:   {_layout(cfg, rl)}",
             f"  rollouts: {rollouts}",
             f"  packing:  {_packing(cfg, rl)}"]
    lines += [f"  threads:  {threads}"] if threads else []
    lines += [f"  malloc:   {malloc}"] if malloc else []
    restored = checkpoint_args_line(cfg)
    return "\n".join(lines + ([restored] if restored else []))
