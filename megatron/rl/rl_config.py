"""RL flags for ``train_rl.py``: parsed with the Megatron flags, then checked together up front.

:func:`add_rl_args` is an ``extra_args_provider`` for :func:`megatron.rl.training.config.parse_args`;
:func:`rl_config_from_args` turns the parsed namespace into a typed :class:`RLConfig` and validates the
combination with the training flags (batch arithmetic, group size, lengths) with errors that name the flags.

Batch arithmetic. One RL iteration collects ``P = --grpo-prompts-per-step`` groups of
``G = --grpo-group-size`` rollouts, ``P / DP`` groups on each data-parallel rank. The ``P * G`` sequences
are split into ``P * G / --global-batch-size`` optimizer steps, and the whole batch is passed over
``--grpo-iterations`` times, so an iteration makes ``grpo_iterations * P * G / global_batch_size``
optimizer steps. ``--train-iters`` counts RL iterations.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path

from megatron.rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS, KL_ESTIMATORS, POLICY_LOSSES
from megatron.rl.algorithms.policy_loss import PolicyLossConfig
from megatron.rl.inference.validation import MAX_TEMPERATURE, MIN_TEMPERATURE
from megatron.rl.inference_layout import (InferenceLayoutConfig, add_inference_layout_args,
                                          inference_layout_from_args, validate_inference_layout)
from megatron.rl.observe_config import ObserveConfig, add_observe_args, observe_config_from_args
from megatron.rl.rollout_pipeline import AsyncRolloutConfig
from megatron.rl.training.config import ConfigError, TrainingConfig

log = logging.getLogger(__name__)


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    # Dropout makes the training forward a different (random) policy from the one that scored the old
    # log-probs, so every PPO ratio would be noise: RL defaults to none (explicit flags still win).
    parser.set_defaults(hidden_dropout=0.0, attention_dropout=0.0)
    g = parser.add_argument_group("reinforcement learning (GRPO / PPO)")
    g.add_argument("--perform-rl-step", action="store_true",
                   help="Accepted for Megatron-LM compatibility; train_rl.py always performs RL steps.")
    g.add_argument("--langrl-env-config", type=str, default=None,
                   help="YAML file listing the agents (environments) to train on, with weights.")
    g.add_argument("--grpo-prompts-per-step", type=int, default=8, help="Prompt groups per RL iteration (all DP ranks).")
    g.add_argument("--grpo-group-size", type=int, default=8, help="Rollouts sampled per prompt.")
    g.add_argument("--grpo-iterations", type=int, default=1, help="Passes over each iteration's rollouts.")
    g.add_argument("--grpo-clamp-eps-lower", type=float, default=0.2, help="PPO clip: ratio >= 1 - eps_lower.")
    g.add_argument("--grpo-clamp-eps-upper", type=float, default=0.2,
                   help="PPO clip: ratio <= 1 + eps_upper (> eps_lower is DAPO's clip-higher).")
    g.add_argument("--grpo-kl-beta", type=float, default=0.0,
                   help="Weight of the KL penalty to the reference model; 0 never builds the reference model.")
    g.add_argument("--grpo-kl-estimator", type=str, default="k3", choices=KL_ESTIMATORS.names())
    g.add_argument("--grpo-entropy-term-weight", type=float, default=0.0, help="Entropy bonus weight.")
    g.add_argument("--grpo-advantage-estimator", type=str, default="grpo", choices=ADVANTAGE_ESTIMATORS.names())
    g.add_argument("--grpo-policy-loss", type=str, default="ppo_clip", choices=POLICY_LOSSES.names())
    g.add_argument("--grpo-loss-aggregation", type=str, default="token", choices=AGGREGATIONS.names(),
                   help="token: mean over all tokens (DAPO); sequence: mean per sequence then over sequences "
                        "(GRPO); drgrpo: sum / (sequences * --rl-max-new-tokens).")
    g.add_argument("--grpo-filter-groups-with-same-reward", action="store_true",
                   help="Drop groups whose rollouts all got the same reward (no learning signal).")
    g.add_argument("--rl-inference-logprobs-is-correction", action="store_true",
                   help="Weight the loss by the truncated importance ratio between trainer and inference log-probs.")
    g.add_argument("--rl-importance-sampling-truncation-coef", type=float, default=2.0)
    g.add_argument("--rl-use-sequence-packing", action="store_true",
                   help="Pack several rollouts into each --seq-length row (attention never crosses sequences).")
    g.add_argument("--rl-sequence-packing-max-sequences-per-bin", type=int, default=16)
    g.add_argument("--rl-sequence-packing-algo", type=str, default="fifo", choices=["fifo", "round-robin"])
    g.add_argument("--rl-default-temperature", type=float, default=1.0)
    g.add_argument("--rl-default-top-p", type=float, default=1.0)
    g.add_argument("--rl-default-top-k", type=int, default=0)
    g.add_argument("--rl-max-new-tokens", type=int, default=64, help="Generation budget per turn.")
    g.add_argument("--rl-prompts-per-eval", type=int, default=32,
                   help="Held-out prompts per evaluation (at --eval-interval); 0 disables evaluation.")
    g.add_argument("--rl-eval-temperature", type=float, default=0.0, help="0 = greedy pass@1.")
    g.add_argument("--inference-backend", type=str, default="megatron",
                   help="Inference backend agents talk to: megatron (in-process, default), openai, huggingface.")
    g.add_argument("--inference-server-url", type=str, default=None,
                   help="Base URL for --inference-backend openai.")
    g.add_argument("--langrl-allow-imports", action="store_true",
                   help="Let the env config name agents by 'module:Class' import path (runs user code).")
    g.add_argument("--rl-metrics-jsonl", type=str, default=None,
                   help="One JSON line of metrics per iteration in this file (rank 0); on resume, lines past the "
                        "resumed iteration are dropped.")
    # A broken backend or environment (e.g. a missing kernel) fails every rollout; without a limit the run
    # would go on skipping every update until --train-iters.
    g.add_argument("--rl-max-all-failed-iterations", type=int, default=3,
                   help="Stop the run after this many consecutive iterations in which every rollout failed "
                        "(0: never stop).")
    # policy serving and off-policy servers (megatron/rl/server/policy_server.py, megatron/rl/inference/policy_gap.py)
    g.add_argument("--rl-serve-inference", type=str, default=None, metavar="[HOST:]PORT",
                   help="Serve the policy being trained (the in-process engine) as an OpenAI-compatible server on "
                        "rank 0 during rollout phases, for remote environment servers and other clients "
                        "(host default 127.0.0.1).")
    g.add_argument("--rl-serve-inference-wait-s", type=float, default=600.0,
                   help="How long a request to --rl-serve-inference waits for a rollout phase before failing.")
    g.add_argument("--rl-off-policy-server", action="store_true",
                   help="The inference server is not the trainer's policy (e.g. --inference-backend openai: its "
                        "weights never change) and that is intended: skip the log-prob gap check.")
    g.add_argument("--rl-max-policy-logprob-gap", type=float, default=0.1,
                   help="Mean |trainer - inference| log-prob per generated token above which the run stops: the "
                        "server is not serving the trainer's policy (unless --rl-off-policy-server).")
    add_inference_layout_args(g)  # separate inference layout (issue 12): megatron.rl.inference_layout
    add_observe_args(parser)  # samples, per-environment metrics, warnings, pass@k, --eval-only
    # GRPO step speed: which passes run and the shapes they run at
    g.add_argument("--rl-recompute-old-logprobs", action="store_true",
                   help="Always score old-policy log-probs in a separate forward pass. By default, when an "
                        "iteration's rollouts feed exactly one optimizer step and one pass (and no dropout), they "
                        "are taken (detached) from the training forward itself: the same numbers, one pass fewer.")
    g.add_argument("--rl-fixed-microbatch-shapes", action="store_true",
                   help="Run every micro-batch at [--micro-batch-size, --seq-length] even without pipeline "
                        "parallelism. By default each micro-batch drops its padding-only rows and positions "
                        "(pipeline parallelism always keeps the fixed shape).")
    # --- asynchronous rollouts (issue 14): megatron/rl/rollout_pipeline.py, megatron/rl/async_rollouts.py ---
    g.add_argument("--rl-generation-lag", type=int, default=0,
                   help="Rollouts may be generated by a policy up to N updates older than the one they train: up to "
                        "(N + 1) x --grpo-prompts-per-step groups are kept in flight across iterations. 0 with the "
                        "other defaults below: synchronous, as without these flags.")
    g.add_argument("--rl-partial-rollouts", action="store_true",
                   help="Requests still in flight at a weight update continue with the new weights (the engine "
                        "keeps their KV cache; the policy version is recorded per token). Without it the pipeline "
                        "drains before every update.")
    g.add_argument("--rl-submission-granularity", type=str, default="B", choices=["R", "G", "B"],
                   help="Unit in which groups enter the backend: B whole batches (one agent call), G single "
                        "groups, R single requests (--rl-max-inflight-requests counts requests).")
    g.add_argument("--rl-consumption-granularity", type=str, default="B", choices=["G", "B"],
                   help="B: an iteration trains on the next batch in submission order; G: on the first groups to "
                        "finish (within the lag bound).")
    g.add_argument("--rl-max-inflight-requests", type=int, default=0,
                   help="At most this many rollout requests in the backend at once (0: only the lag bound).")
    # --- end asynchronous rollouts ---
    return parser


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Typed RL settings (flag names in the docs of :func:`add_rl_args`)."""

    env_config: str
    prompts_per_step: int
    group_size: int
    grpo_iterations: int
    advantage_estimator: str
    loss_aggregation: str
    loss: PolicyLossConfig
    filter_same_reward: bool
    use_sequence_packing: bool
    max_sequences_per_bin: int
    packing_algo: str
    temperature: float
    top_p: float
    top_k: int
    max_new_tokens: int
    prompts_per_eval: int
    eval_temperature: float
    inference_backend: str
    inference_server_url: str | None
    allow_import_paths: bool
    metrics_jsonl: str | None
    max_all_failed_iterations: int = 3
    serve_inference: str | None = None  # [HOST:]PORT
    serve_inference_wait_s: float = 600.0
    off_policy_server: bool = False
    max_policy_logprob_gap: float = 0.1
    # separate inference layout (issue 12); the default (no flags) generates with the training model itself
    inference_layout: InferenceLayoutConfig = InferenceLayoutConfig()
    observe: ObserveConfig = dataclasses.field(default_factory=ObserveConfig)
    # GRPO step speed (see --rl-recompute-old-logprobs, --rl-fixed-microbatch-shapes)
    recompute_old_logprobs: bool = False
    fixed_microbatch_shapes: bool = False
    deterministic_forward: bool = True  # no dropout: a training forward scores what a scoring pass would
    # asynchronous rollouts (issue 14); the default is the synchronous collection
    async_rollouts: AsyncRolloutConfig = AsyncRolloutConfig()

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def _known_backends() -> list[str]:
    """Built-in backend names plus any registered so far, without importing the backends' modules."""
    from megatron.rl.inference import api

    return sorted(set(api._BUILTIN_BACKEND_MODULES) | set(api.InferenceInterface._registry))


def rl_config_from_args(cfg: TrainingConfig) -> RLConfig:
    """Build and validate :class:`RLConfig` from ``cfg.extra`` (flags added by :func:`add_rl_args`)."""
    from megatron.rl.async_rollouts import async_config_from_args, async_loss_config

    a = cfg.extra
    async_rollouts = async_config_from_args(a)  # asynchronous rollouts (issue 14)
    _need(a.langrl_env_config is not None, "--langrl-env-config is required: the YAML file naming the agents to "
                                           "train on (see examples/rl/environment_configs/).")
    _need(Path(a.langrl_env_config).is_file(), f"--langrl-env-config={a.langrl_env_config}: no such file.")
    rl = RLConfig(
        env_config=a.langrl_env_config, prompts_per_step=a.grpo_prompts_per_step, group_size=a.grpo_group_size,
        grpo_iterations=a.grpo_iterations, advantage_estimator=a.grpo_advantage_estimator,
        loss_aggregation=a.grpo_loss_aggregation,
        loss=async_loss_config(PolicyLossConfig(
            policy_loss=a.grpo_policy_loss, eps_lower=a.grpo_clamp_eps_lower, eps_upper=a.grpo_clamp_eps_upper,
            kl_beta=a.grpo_kl_beta, kl_estimator=a.grpo_kl_estimator, entropy_weight=a.grpo_entropy_term_weight,
            is_correction=a.rl_inference_logprobs_is_correction,
            is_truncation_coef=a.rl_importance_sampling_truncation_coef), async_rollouts),
        filter_same_reward=a.grpo_filter_groups_with_same_reward, use_sequence_packing=a.rl_use_sequence_packing,
        max_sequences_per_bin=a.rl_sequence_packing_max_sequences_per_bin, packing_algo=a.rl_sequence_packing_algo,
        temperature=a.rl_default_temperature, top_p=a.rl_default_top_p, top_k=a.rl_default_top_k,
        max_new_tokens=a.rl_max_new_tokens, prompts_per_eval=a.rl_prompts_per_eval,
        eval_temperature=a.rl_eval_temperature, inference_backend=a.inference_backend,
        inference_server_url=a.inference_server_url, allow_import_paths=a.langrl_allow_imports,
        max_all_failed_iterations=a.rl_max_all_failed_iterations,
        metrics_jsonl=a.rl_metrics_jsonl, serve_inference=a.rl_serve_inference,
        serve_inference_wait_s=a.rl_serve_inference_wait_s, off_policy_server=a.rl_off_policy_server,
        max_policy_logprob_gap=a.rl_max_policy_logprob_gap, inference_layout=inference_layout_from_args(a),
        observe=observe_config_from_args(cfg),
        recompute_old_logprobs=a.rl_recompute_old_logprobs, fixed_microbatch_shapes=a.rl_fixed_microbatch_shapes,
        deterministic_forward=cfg.model.hidden_dropout == 0 and cfg.model.attention_dropout == 0,
        async_rollouts=async_rollouts)
    validate_rl_config(rl, cfg)
    return rl


def validate_rl_config(rl: RLConfig, cfg: TrainingConfig) -> None:
    """Reject flag combinations that cannot work, before any compute; warn about ones that hurt."""
    if cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0:
        log.warning("--hidden-dropout=%s / --attention-dropout=%s: with dropout the policy being trained differs "
                    "from the one that scored the old log-probs, so PPO ratios are noisy (train_rl.py defaults "
                    "both to 0)", cfg.model.hidden_dropout, cfg.model.attention_dropout)
    dp = cfg.parallel.data_parallel_size
    gbs = cfg.train.global_batch_size
    for flag, value in (("--grpo-prompts-per-step", rl.prompts_per_step), ("--grpo-group-size", rl.group_size),
                        ("--grpo-iterations", rl.grpo_iterations), ("--rl-max-new-tokens", rl.max_new_tokens),
                        ("--rl-sequence-packing-max-sequences-per-bin", rl.max_sequences_per_bin)):
        _need(value >= 1, f"{flag}={value}: must be >= 1.")
    _need(rl.group_size >= 2 or rl.advantage_estimator not in ("grpo", "rloo", "drgrpo"),
          f"--grpo-group-size={rl.group_size}: the {rl.advantage_estimator!r} advantage compares rollouts within a "
          f"group, so it needs at least 2 rollouts per prompt.")
    _need(rl.prompts_per_step % dp == 0,
          f"--grpo-prompts-per-step={rl.prompts_per_step} must be divisible by the data-parallel size {dp} "
          f"(each DP rank collects an equal share of prompt groups).")
    _need(rl.rollouts_per_step % gbs == 0,
          f"--grpo-prompts-per-step x --grpo-group-size = {rl.prompts_per_step} x {rl.group_size} = "
          f"{rl.rollouts_per_step} rollouts per iteration must be a multiple of --global-batch-size={gbs} "
          f"(each optimizer step trains on --global-batch-size sequences).")
    # Hostile / mistyped values (issue 10): every float flag finite, every range checked here, before any model
    # is built, instead of after the checkpoint is loaded or one iteration in.
    for flag, value in (("--rl-default-temperature", rl.temperature), ("--rl-default-top-p", rl.top_p),
                        ("--rl-eval-temperature", rl.eval_temperature),
                        ("--grpo-clamp-eps-lower", rl.loss.eps_lower), ("--grpo-clamp-eps-upper", rl.loss.eps_upper),
                        ("--grpo-kl-beta", rl.loss.kl_beta), ("--grpo-entropy-term-weight", rl.loss.entropy_weight),
                        ("--rl-importance-sampling-truncation-coef", rl.loss.is_truncation_coef)):
        _need(math.isfinite(value), f"{flag}={value}: must be a finite number.")
    # Every backend refuses 0 < T < MIN_TEMPERATURE per request (near-zero temperatures overflow the softmax).
    _need(MIN_TEMPERATURE <= rl.temperature <= MAX_TEMPERATURE,
          f"--rl-default-temperature={rl.temperature}: must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (the policy "
          f"samples at this temperature and the trainer scores log-probs at it).")
    _need(rl.eval_temperature == 0 or MIN_TEMPERATURE <= rl.eval_temperature <= MAX_TEMPERATURE,
          f"--rl-eval-temperature={rl.eval_temperature}: must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
          f"{MAX_TEMPERATURE}].")
    _need(0 <= rl.loss.eps_lower < 1, f"--grpo-clamp-eps-lower={rl.loss.eps_lower}: must be in [0, 1) (the clip "
                                      f"keeps the ratio >= 1 - eps_lower > 0).")
    _need(rl.loss.eps_upper >= 0, f"--grpo-clamp-eps-upper={rl.loss.eps_upper}: must be >= 0.")
    _need(rl.inference_backend in _known_backends(),
          f"--inference-backend={rl.inference_backend}: unknown backend; registered: {_known_backends()}.")
    _need(0 < rl.top_p <= 1, f"--rl-default-top-p={rl.top_p}: must be in (0, 1].")
    _need(rl.top_k >= 0, f"--rl-default-top-k={rl.top_k}: must be >= 0 (0 disables top-k).")
    _need(rl.loss.kl_beta >= 0, f"--grpo-kl-beta={rl.loss.kl_beta}: must be >= 0.")
    _need(rl.loss.is_truncation_coef > 0,
          f"--rl-importance-sampling-truncation-coef={rl.loss.is_truncation_coef}: must be > 0.")
    _need(rl.max_new_tokens < cfg.model.seq_length,
          f"--rl-max-new-tokens={rl.max_new_tokens} leaves no room for a prompt within --seq-length="
          f"{cfg.model.seq_length}.")
    _need(rl.max_all_failed_iterations >= 0,
          f"--rl-max-all-failed-iterations={rl.max_all_failed_iterations}: must be >= 0 (0 never stops).")
    _need(rl.prompts_per_eval >= 0, f"--rl-prompts-per-eval={rl.prompts_per_eval}: must be >= 0.")
    _need(rl.inference_backend != "openai" or rl.inference_server_url,
          "--inference-backend openai needs --inference-server-url (the OpenAI-compatible server's base URL).")
    _validate_serving(rl, cfg)
    _need(cfg.parallel.virtual_pipeline_model_parallel_size is None,
          "train_rl.py does not support the interleaved pipeline schedule yet; drop "
          "--num-layers-per-virtual-pipeline-stage.")
    # --- separate inference layout (issue 12) ---
    validate_inference_layout(rl.inference_layout, cfg, rl.inference_backend)
    if rl.inference_layout.enabled:
        replicas = rl.inference_layout.sizes(cfg).dp
        _need(rl.prompts_per_step % replicas == 0,
              f"--grpo-prompts-per-step={rl.prompts_per_step} must be divisible by the {replicas} inference "
              f"replicas of the inference layout (world size / (inference TP x PP)): each replica generates an "
              f"equal share of the prompt groups.")
    # --- end separate inference layout ---
    from megatron.rl.async_rollouts import validate_async_rollouts  # asynchronous rollouts (issue 14)

    validate_async_rollouts(rl.async_rollouts, rl, cfg)


def _validate_serving(rl: RLConfig, cfg: TrainingConfig) -> None:
    """--rl-serve-inference / --rl-max-policy-logprob-gap (see megatron/rl/server/policy_server.py)."""
    _need(rl.max_policy_logprob_gap > 0, f"--rl-max-policy-logprob-gap={rl.max_policy_logprob_gap}: must be > 0.")
    if rl.serve_inference is None:
        return
    from megatron.rl.server.policy_server import parse_address

    try:
        parse_address(rl.serve_inference)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    _need(rl.inference_backend == "megatron",
          f"--rl-serve-inference serves the in-process engine, but --inference-backend={rl.inference_backend}; "
          f"use --inference-backend megatron (an external server already serves itself).")
    _need(not rl.inference_layout.enabled,
          "--rl-serve-inference serves the training model's engine; it is not wired to a separate inference layout "
          "(--rl-inference-*-model-parallel-size) yet: drop one of the two.")
    _need(rl.serve_inference_wait_s > 0, f"--rl-serve-inference-wait-s={rl.serve_inference_wait_s}: must be > 0.")
    p = cfg.parallel
    _need(p.tensor_model_parallel_size == 1 and p.pipeline_model_parallel_size == 1
          and p.expert_model_parallel_size == 1,
          f"--rl-serve-inference supports TP=PP=EP=1 (any data-parallel size) for now; this run has "
          f"--tensor-model-parallel-size={p.tensor_model_parallel_size} --pipeline-model-parallel-size="
          f"{p.pipeline_model_parallel_size} --expert-model-parallel-size={p.expert_model_parallel_size} (a "
          f"model-parallel engine needs all its ranks to admit the same requests; not implemented yet).")
