"""Flags for seeing what a run does: sample completions, failure-point warnings, pass@k evaluation, --eval-only.

:func:`add_observe_args` is called from :func:`megatron.rl.rl_config.add_rl_args`;
:func:`observe_config_from_args` builds the typed :class:`ObserveConfig` and checks the flags up front
(before any model is built) with errors that name the flag.
"""
from __future__ import annotations

import argparse
import dataclasses
import math

from megatron.rl.training.config import ConfigError, TrainingConfig

__all__ = ["ObserveConfig", "add_observe_args", "observe_config_from_args"]


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """log_samples: samples per iteration to the metrics JSONL / TensorBoard (0: none).
    warn_*: failure-point thresholds (see :mod:`megatron.rl.rl_warnings`); warn_interval: iterations between
    repeats of a persisting warning (0: no warnings).
    eval_samples / eval_ks: samples per evaluation prompt and the k of the reported pass@k.
    eval_only: evaluate the checkpoint in --load and exit; eval_output: JSON file for its results.
    """

    log_samples: int = 4
    warn_same_reward_share: float = 0.9
    warn_length_cap_share: float = 0.5
    warn_logprob_gap: float = 1.0
    warn_interval: int = 10
    eval_samples: int = 1
    eval_ks: tuple[int, ...] = (1,)
    eval_only: bool = False
    eval_output: str | None = None


def add_observe_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # --- observability and evaluation (samples, per-environment metrics, warnings, pass@k, --eval-only) ---
    g = parser.add_argument_group("RL observability and evaluation")
    g.add_argument("--rl-log-samples", type=int, default=4,
                   help="Sample completions (prompt, completion, reward, environment) written per iteration to "
                        "--rl-metrics-jsonl and TensorBoard text; chosen across environments and reward levels. "
                        "0 disables.")
    g.add_argument("--rl-warn-same-reward-share", type=float, default=0.9,
                   help="Warn when more than this share of groups got the same reward for every rollout "
                        "(no learning signal). 1 disables.")
    g.add_argument("--rl-warn-length-cap-share", type=float, default=0.5,
                   help="Warn when more than this share of responses stopped at the length cap "
                        "(--rl-max-new-tokens). 1 disables.")
    g.add_argument("--rl-warn-logprob-gap", type=float, default=1.0,
                   help="Warn when the mean train-inference log-prob gap (nats per generated token) exceeds "
                        "this: the rollouts come from a different policy. inf disables.")
    g.add_argument("--rl-warn-interval", type=int, default=10,
                   help="Iterations between repeats of a warning whose condition persists; 0 disables the "
                        "failure-point warnings.")
    g.add_argument("--rl-eval-samples", type=int, default=None,
                   help="Samples per evaluation prompt, for pass@k (default: the largest --rl-eval-pass-at-k, "
                        "else 1). More than 1 needs --rl-eval-temperature > 0.")
    g.add_argument("--rl-eval-pass-at-k", type=int, nargs="+", default=None, metavar="K",
                   help="The k of the pass@k reported at each evaluation (unbiased estimator), e.g. 1 4 8 "
                        "(default: 1 and --rl-eval-samples).")
    g.add_argument("--eval-only", action="store_true",
                   help="Evaluate the checkpoint in --load (or --pretrained-checkpoint) on the env config's "
                        "environments, print a table (per environment, pass@k columns) and exit; no training.")
    g.add_argument("--rl-eval-output", type=str, default=None,
                   help="With --eval-only: also write the evaluation's numbers to this JSON file.")
    return parser


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def observe_config_from_args(cfg: TrainingConfig) -> ObserveConfig:
    """The typed, validated :class:`ObserveConfig` from ``cfg.extra`` (flags of :func:`add_observe_args`)."""
    a = cfg.extra
    _need(a.rl_log_samples >= 0, f"--rl-log-samples={a.rl_log_samples}: must be >= 0 (0 disables samples).")
    for flag, v in (("--rl-warn-same-reward-share", a.rl_warn_same_reward_share),
                    ("--rl-warn-length-cap-share", a.rl_warn_length_cap_share)):
        _need(0.0 <= v <= 1.0, f"{flag}={v}: must be a share in [0, 1] (1 disables the warning).")
    _need(a.rl_warn_logprob_gap > 0 and not math.isnan(a.rl_warn_logprob_gap),
          f"--rl-warn-logprob-gap={a.rl_warn_logprob_gap}: must be > 0 (inf disables the warning).")
    _need(a.rl_warn_interval >= 0, f"--rl-warn-interval={a.rl_warn_interval}: must be >= 0 (0 disables warnings).")
    ks = sorted(set(a.rl_eval_pass_at_k)) if a.rl_eval_pass_at_k else []
    _need(all(k >= 1 for k in ks), f"--rl-eval-pass-at-k={a.rl_eval_pass_at_k}: every k must be >= 1.")
    samples = a.rl_eval_samples if a.rl_eval_samples is not None else (max(ks) if ks else 1)
    _need(samples >= 1, f"--rl-eval-samples={samples}: must be >= 1.")
    if ks and max(ks) > samples:
        raise ConfigError(f"--rl-eval-pass-at-k={a.rl_eval_pass_at_k} asks for k={max(ks)} but --rl-eval-samples="
                          f"{samples}: pass@k needs at least k samples per prompt; raise --rl-eval-samples to "
                          f"{max(ks)} or drop that k.")
    _need(samples == 1 or a.rl_eval_temperature > 0,
          f"--rl-eval-samples={samples} with --rl-eval-temperature={a.rl_eval_temperature}: greedy decoding "
          f"gives {samples} identical samples, so pass@k would equal pass@1; pass --rl-eval-temperature 1.0 "
          f"(or another value > 0).")
    _need(a.rl_eval_output is None or a.eval_only, "--rl-eval-output is only used with --eval-only.")
    if a.eval_only:
        _need(a.rl_prompts_per_eval > 0,
              f"--eval-only with --rl-prompts-per-eval={a.rl_prompts_per_eval}: nothing to evaluate; pass the "
              f"number of held-out prompts per environment (e.g. --rl-prompts-per-eval 64).")
        _need(cfg.checkpoint.load is not None or cfg.checkpoint.pretrained_checkpoint is not None,
              "--eval-only needs the checkpoint to evaluate: pass --load DIR (or --pretrained-checkpoint DIR).")
    return ObserveConfig(
        log_samples=a.rl_log_samples, warn_same_reward_share=a.rl_warn_same_reward_share,
        warn_length_cap_share=a.rl_warn_length_cap_share, warn_logprob_gap=a.rl_warn_logprob_gap,
        warn_interval=a.rl_warn_interval, eval_samples=samples, eval_ks=tuple(ks or sorted({1, samples})),
        eval_only=a.eval_only, eval_output=a.rl_eval_output)
