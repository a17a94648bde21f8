"""Held-out evaluation: pass@k per environment, during training (``--eval-interval``) and on its own
(``train_rl.py --eval-only --load CKPT``).

Each data-parallel rank evaluates its share of ``--rl-prompts-per-eval`` prompts per environment with
``--rl-eval-samples`` samples at ``--rl-eval-temperature``; agents report the unbiased pass@k estimator
(:func:`megatron.rl.agent.pass_at_evaluation_agent.pass_at_k`) averaged over their prompts, and
:func:`merge_eval_metrics` combines the ranks' means weighted by their prompt counts. Keys are
``eval/<env>/pass@K``, ``eval/<env>/mean_reward``, ``eval/<env>/num_prompts``, ... and the mean over
environments ``eval/pass@K``.
"""
from __future__ import annotations

import json
import logging
import math
import re
import statistics
from pathlib import Path
from typing import Sequence

from megatron.rl import parallel_utils
from megatron.rl.agent.api import Agent, EvaluationRequest
from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.inference.api import GenerationArgs, InferenceInterface, run_sync
from megatron.rl.layout.backend import build_run_inference
from megatron.rl.observe.run_summary import checkpoint_args_line
from megatron.rl.rl_config import RLConfig
from megatron.rl.rollout.collection import data_parallel, derive_seed, generation_split
from megatron.rl.training.config import ConfigError, TrainingConfig
from megatron.rl.training.run import EVAL_ONLY, TrainingRun, resolve_load_dir

__all__ = ["evaluation_request", "merge_eval_metrics", "evaluate", "format_eval_line", "format_eval_table",
           "eval_environments", "run_eval_only"]

log = logging.getLogger(__name__)

_PASS_KEY = re.compile(r"^eval/(?:(?P<env>.+)/)?pass@(?P<k>\d+)$")


def evaluation_request(rl: RLConfig, seed: int, dp_rank: int, dp_size: int,
                       inference: InferenceInterface | None = None) -> EvaluationRequest:
    """This DP rank's request: ``--rl-prompts-per-eval / DP`` prompts (at least one), the pass@k settings.
    At temperature 0 the one sample is the greedy decode, so no separate greedy pass is asked for."""
    o = rl.observe
    args = GenerationArgs(temperature=rl.eval_temperature, max_tokens=rl.max_new_tokens,
                          seed=derive_seed(seed, "eval", dp_rank))
    return EvaluationRequest(num_prompts=max(rl.prompts_per_eval // dp_size, 1), num_samples=o.eval_samples,
                             ks=list(o.eval_ks), greedy=False, generation_args=args, inference_interface=inference)


def merge_eval_metrics(per_rank: Sequence[dict[str, float]]) -> dict[str, float]:
    """Combine the DP ranks' agent metrics into ``eval/...`` metrics.

    ``*num_prompts`` keys add up; every other key is a mean over its environment's prompts, combined
    weighted by the rank's ``<env>/num_prompts``. Adds ``eval/pass@K`` (mean over the environments that
    report pass@K) and keeps ``eval/pass@1`` when only greedy accuracies exist.
    """
    out: dict[str, float] = {}
    first = per_rank[0] if per_rank else {}
    prompt_keys = [k for k in first if k.endswith("num_prompts")]
    for key in first:
        if key.endswith("num_prompts"):
            out[f"eval/{key}"] = float(sum(m.get(key, 0.0) for m in per_rank))
            continue
        weight_key = next((p for p in prompt_keys if key.startswith(p[: -len("num_prompts")])), None)
        weights = [m.get(weight_key, 1.0) if weight_key else 1.0 for m in per_rank]
        total = sum(weights)
        out[f"eval/{key}"] = sum(m.get(key, 0.0) * w for m, w in zip(per_rank, weights)) / total if total else 0.0
    by_k: dict[int, list[float]] = {}
    for key, value in out.items():
        m = _PASS_KEY.match(key)
        if m and m.group("env") is not None:
            by_k.setdefault(int(m.group("k")), []).append(value)
    for k, values in sorted(by_k.items()):
        out[f"eval/pass@{k}"] = statistics.fmean(values)
    if "eval/pass@1" not in out:
        greedy = [v for k, v in out.items() if k.endswith("greedy_accuracy")]
        if greedy:
            out["eval/pass@1"] = statistics.fmean(greedy)
    return out


def evaluate(agent: Agent, inference: InferenceInterface, rl: RLConfig, seed: int) -> dict[str, float]:
    """Evaluate (all ranks; collective over the DP group); returns the merged ``eval/`` metrics."""
    shard, rank, size = generation_split(inference)
    request = evaluation_request(rl, seed, rank, size, inference)
    with inference.rollout_phase():
        response = run_sync(agent.evaluate(request))
    gathered = (shard.gather(response.metrics) if shard is not None
                else parallel_utils.all_gather_object(response.metrics, data_parallel()[0]))
    return merge_eval_metrics(gathered)


def eval_environments(metrics: dict[str, float]) -> list[str]:
    """Environment names present in merged eval metrics (sorted)."""
    return sorted(k[len("eval/"):-len("/num_prompts")] for k in metrics
                  if k.startswith("eval/") and k.endswith("/num_prompts"))


def _ks(metrics: dict[str, float]) -> list[int]:
    return sorted({int(m.group("k")) for m in map(_PASS_KEY.match, metrics) if m})


def format_eval_line(metrics: dict[str, float]) -> str:
    """``pass@1: 0.5 | pass@8: 0.9 | arith pass@1: 0.6 pass@8: 0.95 reward: 0.6 | ...`` for the log."""
    ks = _ks(metrics)
    parts = [f"pass@{k}: {metrics[f'eval/pass@{k}']:.4g}" for k in ks if f"eval/pass@{k}" in metrics]
    for env in eval_environments(metrics):
        p = f"eval/{env}/"
        cols = [f"pass@{k}: {metrics[f'{p}pass@{k}']:.4g}" for k in ks if f"{p}pass@{k}" in metrics]
        if f"{p}mean_reward" in metrics:
            cols.append(f"reward: {metrics[f'{p}mean_reward']:.4g}")
        parts.append(f"{env} " + " ".join(cols))
    return " | ".join(parts)


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None or not math.isfinite(value) else format(value, fmt)


def format_eval_table(metrics: dict[str, float]) -> str:
    """A plain-text table: one row per environment (prompts, pass@k columns, greedy accuracy when reported,
    mean sampled reward, failed share) and a last row with the mean over environments."""
    envs = eval_environments(metrics)
    ks = _ks(metrics)
    has_greedy = any(f"eval/{e}/greedy_accuracy" in metrics for e in envs)
    header = ["environment", "prompts", *[f"pass@{k}" for k in ks], *(["greedy"] if has_greedy else []),
              "mean reward", "failed"]
    rows = []
    for env in envs:
        p = f"eval/{env}/"
        rows.append([env, _cell(metrics.get(f"{p}num_prompts"), ".0f"),
                     *[_cell(metrics.get(f"{p}pass@{k}"), ".3f") for k in ks],
                     *([_cell(metrics.get(f"{p}greedy_accuracy"), ".3f")] if has_greedy else []),
                     _cell(metrics.get(f"{p}mean_reward"), ".3f"), _cell(metrics.get(f"{p}failed_fraction"), ".1%")])
    if len(envs) > 1:
        total = sum(metrics.get(f"eval/{e}/num_prompts", 0.0) for e in envs)

        def mean_of(suffix: str) -> float | None:
            vals = [metrics[f"eval/{e}/{suffix}"] for e in envs if f"eval/{e}/{suffix}" in metrics]
            return statistics.fmean(vals) if vals else None

        rows.append(["mean", _cell(total, ".0f"), *[_cell(mean_of(f"pass@{k}"), ".3f") for k in ks],
                     *([_cell(mean_of("greedy_accuracy"), ".3f")] if has_greedy else []),
                     _cell(mean_of("mean_reward"), ".3f"), _cell(mean_of("failed_fraction"), ".1%")])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
             for r in [header, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_eval_only(cfg: TrainingConfig, rl: RLConfig) -> dict[str, float]:
    """``train_rl.py --eval-only``: load the checkpoint, evaluate every environment, print the table.

    Takes the model flags of the training run and ``--load`` (its latest checkpoint) or
    ``--pretrained-checkpoint``. Built by :class:`~megatron.rl.training.run.TrainingRun` with the
    :data:`~megatron.rl.training.run.EVAL_ONLY` policy (the training build and load, checkpoint flags
    included, without optimizer or DDP). Returns the merged ``eval/`` metrics (all ranks).
    """

    c = cfg.checkpoint
    if resolve_load_dir(cfg, required=False) is None and not c.pretrained_checkpoint:
        raise ConfigError(f"--eval-only: --load {c.load} holds no checkpoint (no latest_checkpointed_iteration.txt "
                          f"or iter_* directory); pass the directory a training run saved to.")
    restored = checkpoint_args_line(cfg)
    if restored and parallel_utils.is_rank0():
        log.info("--eval-only:\n%s", restored)
    agent = build_agent_from_config(rl.env_config, allow_imports=rl.allow_import_paths)
    run = TrainingRun.build(cfg, EVAL_ONLY)
    loaded = run.resume().loaded
    inference = build_run_inference(cfg, rl, run.model, run.tokenizer)
    agent.set_data_parallel(*generation_split(inference)[1:])
    agent.bind_inference(inference)  # an inference copy is refit from the loaded weights by its rollout phase
    try:
        metrics = evaluate(agent, inference, rl, cfg.train.seed)
    finally:
        inference.close()
    o = rl.observe
    title = (f"evaluation of {loaded.path} (iteration {loaded.iteration}): {rl.prompts_per_eval} prompts per "
             f"environment, {o.eval_samples} sample(s) each at temperature {rl.eval_temperature:g}")
    if parallel_utils.is_rank0():
        log.info("%s\n%s", title, format_eval_table(metrics))
        if o.eval_output:
            out = Path(o.eval_output)
            out.parent.mkdir(parents=True, exist_ok=True)
            record = {"checkpoint": str(loaded.path), "iteration": loaded.iteration, **metrics}
            out.write_text(json.dumps(record, indent=1, allow_nan=False, default=str) + "\n")
    return metrics
