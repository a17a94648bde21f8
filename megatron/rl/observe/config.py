"""Flags for seeing what a run does: sample completions, failure-point warnings, pass@k evaluation, --eval-only.

:class:`ObserveConfig` declares the flags (a section of :class:`megatron.rl.rl_config.RLConfig`);
:func:`resolve_observe` fills the pass@k defaults and checks the flags up front (before any model is built)
with errors that name the flag.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

from megatron.rl.training.config import ConfigError, TrainingConfig
from megatron.rl.base.flags import flag
from megatron.rl.observe.findings import GUARD_ACTIONS, WarningThresholds

__all__ = ["ObserveConfig", "resolve_observe"]


@dataclasses.dataclass(frozen=True)
class ObserveConfig:
    """log_samples: samples per iteration to the metrics JSONL / TensorBoard (0: none).
    warn_*: failure-point thresholds (see :mod:`megatron.rl.observe.warnings`); warn_interval: iterations between
    repeats of a persisting warning (0: no warnings).
    eval_samples / eval_ks: samples per evaluation prompt and the k of the reported pass@k (None as parsed:
    resolved by :func:`resolve_observe`).
    eval_only: evaluate the checkpoint in --load and exit; eval_output: JSON file for its results.
    """

    _flag_group = "RL observability and evaluation"

    log_line: str = flag("short", name="--log-line", choices=("short", "full"),
                         help="The iteration line: short (default; fits 160 columns: iteration, reward, the latest "
                              "pass@1, loss, KL, log-prob gap, seconds) or full (every figure, per environment "
                              "too). Both forms' figures all go to TensorBoard / W&B / --rl-metrics-jsonl.")
    log_samples: int = flag(4, name="--rl-log-samples",
                            help="Sample completions (prompt, completion, reward, environment) written per iteration "
                                 "to --rl-metrics-jsonl and TensorBoard text; chosen across environments and reward "
                                 "levels. 0 disables.")
    warn_same_reward_share: float = flag(0.9, name="--rl-warn-same-reward-share",
                                         help="Warn when more than this share of groups got the same reward for "
                                              "every rollout (no learning signal). 1 disables.")
    warn_length_cap_share: float = flag(0.5, name="--rl-warn-length-cap-share",
                                        help="Warn when more than this share of responses stopped at the length cap "
                                             "(--rl-max-new-tokens). 1 disables.")
    warn_logprob_gap: float = flag(1.0, name="--rl-warn-logprob-gap",
                                   help="Warn when the mean train-inference log-prob gap (nats per generated token) "
                                        "exceeds this: the rollouts come from a different policy. inf disables.")
    warn_off_policy_kl: float = flag(0.03, name="--rl-warn-off-policy-kl",
                                     help="Asynchronous rollouts: warn when the k3 KL between the policy that generated "
                                          "the trained tokens and the one being updated exceeds this (nats per token), "
                                          "or more than one importance weight in twenty was truncated. inf disables.")
    warn_reward_drop: float = flag(0.1, name="--rl-warn-reward-drop",
                                   help="Warn when an environment's training reward over the last "
                                        "--rl-warn-trend-window iterations is this far below its first window's. inf "
                                        "disables.")
    warn_entropy_drop: float = flag(0.25, name="--rl-warn-entropy-drop",
                                    help="Warn when the policy's entropy (measured with asynchronous rollouts or an "
                                         "entropy bonus) over the last window falls below this fraction of its first "
                                         "window's. 0 disables.")
    warn_trend_window: int = flag(20, name="--rl-warn-trend-window",
                                  help="Iterations per window of the reward and entropy trend warnings.")
    warn_top_answer_share: float = flag(0.8, name="--rl-warn-top-answer-share",
                                        help="Warn when more than this share of one environment's rollouts over "
                                             "--rl-warn-env-window iterations gave the same answer, whatever the "
                                             "problem (a collapse to a constant answer). Raise it for tasks with a "
                                             "few possible answers (yes / no). 1 disables.")
    warn_env_window: int = flag(5, name="--rl-warn-env-window",
                                help="Iterations pooled per environment by the per-environment checks (answer "
                                     "collapse, same-reward share, length-cap share of each environment of a "
                                     "mixture): a small environment has a group or two per iteration.")
    warn_pass_at_1_drop: float = flag(0.1, name="--rl-warn-pass-at-1-drop",
                                      help="Warn when an environment's held-out pass@1 (or the mean over "
                                           "environments) is this far below the run's first evaluation. inf "
                                           "disables.")
    env_collapse_action: str = flag("off", name="--rl-env-collapse-action", choices=GUARD_ACTIONS,
                                    help="What a sustained collapse of one environment to a constant answer does "
                                         "(the answer_collapse warning held --rl-env-collapse-patience iterations "
                                         "in a row): off (warn only), downweight (multiply its weight in the "
                                         "mixture by --rl-env-collapse-weight-factor) or stop (save a checkpoint "
                                         "when --save is set, log the reason, exit with status 3).")
    env_collapse_patience: int = flag(10, name="--rl-env-collapse-patience",
                                      help="Consecutive iterations an environment's answer collapse must hold "
                                           "before --rl-env-collapse-action acts.")
    env_collapse_weight_factor: float = flag(0.5, name="--rl-env-collapse-weight-factor",
                                             help="--rl-env-collapse-action downweight: the collapsed environment's "
                                                  "weight is multiplied by this, each time the collapse holds "
                                                  "another --rl-env-collapse-patience iterations.")
    warn_interval: int = flag(10, name="--rl-warn-interval",
                              help="Iterations between repeats of a warning whose condition persists; 0 disables the "
                                   "failure-point warnings.")
    eval_samples: int | None = flag(None, name="--rl-eval-samples",
                                    help="Samples per evaluation prompt, for pass@k (default: the largest "
                                         "--rl-eval-pass-at-k, else 1). More than 1 needs --rl-eval-temperature > 0.")
    eval_ks: tuple[int, ...] | None = flag(None, name="--rl-eval-pass-at-k", nargs="+", metavar="K",
                                           help="The k of the pass@k reported at each evaluation (unbiased "
                                                "estimator), e.g. 1 4 8 (default: 1 and --rl-eval-samples).")
    eval_only: bool = flag(False, name="--eval-only",
                           help="Evaluate the checkpoint in --load (or --pretrained-checkpoint) on the env config's "
                                "environments, print a table (per environment, pass@k columns) and exit; no "
                                "training.")
    eval_output: str | None = flag(None, name="--rl-eval-output",
                                   help="With --eval-only: also write the evaluation's numbers to this JSON file.")

    @property
    def warning_thresholds(self) -> WarningThresholds:
        """The health checks' thresholds from the ``--rl-warn-*`` flags."""
        return WarningThresholds(self.warn_same_reward_share, self.warn_length_cap_share, self.warn_logprob_gap,
                                 off_policy_kl=self.warn_off_policy_kl, reward_drop=self.warn_reward_drop,
                                 entropy_drop=self.warn_entropy_drop, trend_window=self.warn_trend_window,
                                 top_answer_share=self.warn_top_answer_share, env_window=self.warn_env_window,
                                 pass_at_1_drop=self.warn_pass_at_1_drop)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def resolve_observe(o: ObserveConfig, rl: Any, cfg: TrainingConfig) -> ObserveConfig:
    """``o`` as parsed, checked, with the pass@k samples and ks resolved. ``rl``: the RL config as parsed
    (its ``prompts_per_eval`` and ``eval_temperature``)."""
    _need(o.log_samples >= 0, f"--rl-log-samples={o.log_samples}: must be >= 0 (0 disables samples).")
    for name, v in (("--rl-warn-same-reward-share", o.warn_same_reward_share),
                    ("--rl-warn-length-cap-share", o.warn_length_cap_share),
                    ("--rl-warn-top-answer-share", o.warn_top_answer_share)):
        _need(0.0 <= v <= 1.0, f"{name}={v}: must be a share in [0, 1] (1 disables the warning).")
    _need(o.warn_logprob_gap > 0 and not math.isnan(o.warn_logprob_gap),
          f"--rl-warn-logprob-gap={o.warn_logprob_gap}: must be > 0 (inf disables the warning).")
    _need(o.warn_interval >= 0, f"--rl-warn-interval={o.warn_interval}: must be >= 0 (0 disables warnings).")
    for name, v in (("--rl-warn-off-policy-kl", o.warn_off_policy_kl), ("--rl-warn-reward-drop", o.warn_reward_drop),
                    ("--rl-warn-pass-at-1-drop", o.warn_pass_at_1_drop)):
        _need(v > 0 and not math.isnan(v), f"{name}={v}: must be > 0 (inf disables the warning).")
    _need(0 <= o.warn_entropy_drop < 1, f"--rl-warn-entropy-drop={o.warn_entropy_drop}: must be a fraction in [0, 1) "
                                        f"(0 disables the warning).")
    _need(o.warn_trend_window >= 1, f"--rl-warn-trend-window={o.warn_trend_window}: must be >= 1.")
    _need(o.warn_env_window >= 1, f"--rl-warn-env-window={o.warn_env_window}: must be >= 1 (iterations pooled per "
                                  f"environment).")
    _need(o.env_collapse_patience >= 1,
          f"--rl-env-collapse-patience={o.env_collapse_patience}: must be >= 1 (iterations in a row).")
    _need(0 < o.env_collapse_weight_factor < 1, f"--rl-env-collapse-weight-factor={o.env_collapse_weight_factor}: "
                                                f"must be in (0, 1) (the share of its weight a collapsed "
                                                f"environment keeps).")
    _need(o.env_collapse_action == "off" or o.warn_top_answer_share < 1,
          f"--rl-env-collapse-action {o.env_collapse_action} with --rl-warn-top-answer-share="
          f"{o.warn_top_answer_share}: the answer-collapse check it acts on is off; lower the share (default 0.8).")
    given_ks = list(o.eval_ks) if o.eval_ks else None  # as typed, for the messages
    ks = sorted(set(o.eval_ks)) if o.eval_ks else []
    _need(all(k >= 1 for k in ks), f"--rl-eval-pass-at-k={given_ks}: every k must be >= 1.")
    samples = o.eval_samples if o.eval_samples is not None else (max(ks) if ks else 1)
    _need(samples >= 1, f"--rl-eval-samples={samples}: must be >= 1.")
    if ks and max(ks) > samples:
        raise ConfigError(f"--rl-eval-pass-at-k={given_ks} asks for k={max(ks)} but --rl-eval-samples="
                          f"{samples}: pass@k needs at least k samples per prompt; raise --rl-eval-samples to "
                          f"{max(ks)} or drop that k.")
    _need(samples == 1 or rl.eval_temperature > 0,
          f"--rl-eval-samples={samples} with --rl-eval-temperature={rl.eval_temperature}: greedy decoding "
          f"gives {samples} identical samples, so pass@k would equal pass@1; pass --rl-eval-temperature 1.0 "
          f"(or another value > 0).")
    _need(o.eval_output is None or o.eval_only, "--rl-eval-output is only used with --eval-only.")
    if o.eval_only:
        _need(rl.prompts_per_eval > 0,
              f"--eval-only with --rl-prompts-per-eval={rl.prompts_per_eval}: nothing to evaluate; pass the "
              f"number of held-out prompts per environment (e.g. --rl-prompts-per-eval 64).")
        _need(cfg.checkpoint.load is not None or cfg.checkpoint.pretrained_checkpoint is not None,
              "--eval-only needs the checkpoint to evaluate: pass --load DIR (or --pretrained-checkpoint DIR).")
    return dataclasses.replace(o, eval_samples=samples, eval_ks=tuple(ks or sorted({1, samples})))
