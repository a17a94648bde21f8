"""RL flags for ``train_rl.py``: parsed with the Megatron flags, then checked together up front.

:class:`RLConfig` declares every RL flag on its field (and its sections); to add a flag, add a field with
``flag(...)`` and its check beside that config's fields. :func:`add_rl_args` is the generated
``extra_args_provider``; :func:`rl_config_from_args` builds the frozen :class:`RLConfig` and validates it with the
training flags, with errors that name the flags. An iteration makes
``grpo_iterations * P * G / global_batch_size`` optimizer steps; ``--train-iters`` counts RL iterations.

Batch arithmetic and where each check lives: docs/training.md.
"""
from __future__ import annotations

import argparse
import dataclasses
import logging
import math
from pathlib import Path

from megatron.rl.algorithms import ADVANTAGE_ESTIMATORS, AGGREGATIONS
from megatron.rl.algorithms.policy_loss import PolicyLossConfig, validate_policy_loss
from megatron.rl.agent.env_config import import_env_config_modules
from megatron.rl.base.flags import add_flags, derived, flag, from_namespace, registry_choices, section
from megatron.rl.base.registry import UnknownNameError
from megatron.rl.inference import api
from megatron.rl.inference.engine.engine_flags import EngineFlags, validate_engine_flags
from megatron.rl.inference.validation import MAX_TEMPERATURE, MIN_TEMPERATURE
from megatron.rl.layout.groups import InferenceLayoutConfig, validate_inference_layout
from megatron.rl.observe.config import ObserveConfig, resolve_observe
from megatron.rl.packing.layout_choice import LAYOUTS, LayoutInputs, TrainingLayout, choose_layout
from megatron.rl.packing.plan import PACKING_ALGOS
from megatron.rl.rollout.async_config import AsyncRolloutConfig, async_loss_config, validate_async_rollouts
from megatron.rl.routing.config import REPLAY_MODES, validate_router_replay
from megatron.rl.server.policy_server import parse_address
from megatron.rl.training.checkpoint.run_flags import record_run_flags
from megatron.rl.training.config import ConfigError, TrainingConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RLConfig:
    """Typed RL settings; each field declares its ``train_rl.py`` flag (``name=``), nested sections included."""

    _flag_group = "reinforcement learning (GRPO / PPO)"
    _removed_flags = {"--rl-packed-attention-per-sequence": "--rl-packed-attention exact (the same per-sequence "
                                                            "attention)"}

    perform_rl_step: bool = flag(False, name="--perform-rl-step",
                                 help="Accepted for Megatron-LM compatibility; train_rl.py always performs RL steps.")
    env_config: str | None = flag(None, name="--langrl-env-config",
                                  help="YAML file listing the agents (environments) to train on, with weights.")
    prompts_per_step: int = flag(8, name="--grpo-prompts-per-step",
                                 help="Prompt groups per RL iteration (all DP ranks).")
    group_size: int = flag(8, name="--grpo-group-size", help="Rollouts sampled per prompt.")
    grpo_iterations: int = flag(1, help="Passes over each iteration's rollouts.")
    loss: PolicyLossConfig = section(PolicyLossConfig)  # --grpo-clamp-eps-*, --grpo-kl-*, --grpo-policy-loss, ...
    advantage_estimator: str = flag("grpo", name="--grpo-advantage-estimator",
                                    choices=registry_choices(ADVANTAGE_ESTIMATORS))
    loss_aggregation: str = flag("token", name="--grpo-loss-aggregation", choices=registry_choices(AGGREGATIONS),
                                 help="token: mean over all tokens (DAPO); sequence: mean per sequence then over "
                                      "sequences (GRPO); drgrpo: sum / (sequences * --rl-max-new-tokens).")
    filter_same_reward: bool = flag(False, name="--grpo-filter-groups-with-same-reward",
                                    help="Drop groups whose rollouts all got the same reward (no learning signal).")
    # the layout of a step's rows (megatron.rl.packing.layout_choice), resolved into training_layout
    layout: str = flag(
        "auto", name="--rl-layout", choices=LAYOUTS,
        help="How a step's rollouts fill the trainer's rows. auto (default) = packed: rows of one group where a "
             "group's prompt can be computed once (--rl-share-prompt-prefix auto, no pipeline parallelism or "
             "THD), else rows of --seq-length; padded = one rollout per --seq-length row; packed = as auto. The "
             "loss and gradients are the same in every layout; the start-up summary says which one ran and why.")
    packing_row_length: str = flag(
        "auto", name="--rl-packing-row-length", metavar="auto|N",
        help="Tokens per packed row (>= --seq-length). auto (default) = one group's row where prompts are shared "
             "(--seq-length + (group size - 1) x (--rl-max-new-tokens + 1), rounded up to 32, at most "
             "--micro-batch-size x --seq-length), else --seq-length. A packed micro-batch holds "
             "--micro-batch-size x --seq-length // row length rows (at least 1).")
    use_sequence_packing: bool = flag(False, name="--rl-use-sequence-packing",
                                      help="Pack several rollouts into each --seq-length row (attention never crosses "
                                           "sequences): the packed layout with rows of --seq-length unless "
                                           "--rl-packing-row-length says otherwise.")
    max_sequences_per_bin: int = flag(16, name="--rl-sequence-packing-max-sequences-per-bin")
    packing_algo: str = flag("fifo", name="--rl-sequence-packing-algo", choices=registry_choices(PACKING_ALGOS))
    # packed rows computed as if each sequence ran alone (megatron.rl.packing.packed_forward)
    packed_attention: str = flag(
        "auto", name="--rl-packed-attention", choices=("auto", "masked", "grouped", "exact"),
        help="Local attention spec, packed rows: masked = one product over each whole row, sequences kept apart "
             "by a block-diagonal mask (its cost grows with the row length squared); exact = one call per "
             "sequence length, log-probs bit-identical to one sequence per row; grouped = one call per group of "
             "similar lengths (power-of-two classes), each sequence attending to its own keys only; auto (default) "
             "= grouped where it costs less than masked (rows of several short sequences), else masked. RoPE "
             "always uses each sequence's own positions.")
    share_prompt_prefix: str = flag(
        "auto", name="--rl-share-prompt-prefix", choices=("auto", "off"),
        help="Packed rows (--rl-layout auto/packed): rollouts of a group packed into one row compute their common "
             "prompt once (the others attend to it) instead of once per rollout: the same log-probs and gradients, "
             "fewer tokens. auto (default) = where the layout allows it (not with TransformerEngine's THD packing or "
             "pipeline parallelism); off = every rollout stored whole.")
    temperature: float = flag(1.0, name="--rl-default-temperature")
    top_p: float = flag(1.0, name="--rl-default-top-p")
    top_k: int = flag(0, name="--rl-default-top-k")
    max_new_tokens: int = flag(64, name="--rl-max-new-tokens", help="Generation budget per turn.")
    prompts_per_eval: int = flag(32, name="--rl-prompts-per-eval",
                                 help="Held-out prompts per evaluation (at --eval-interval); 0 disables evaluation.")
    eval_temperature: float = flag(0.0, name="--rl-eval-temperature", help="0 = greedy pass@1.")
    inference_backend: str = flag("megatron", name="--inference-backend",
                                  help="Inference backend agents talk to: megatron (in-process, default), openai, "
                                       "huggingface.")
    inference_server_url: str | None = flag(None, name="--inference-server-url",
                                            help="Base URL for --inference-backend openai.")
    allow_import_paths: bool = flag(False, name="--langrl-allow-imports",
                                    help="Let the env config name agents by 'module:Class' import path (runs user "
                                         "code).")
    metrics_jsonl: str | None = flag(None, name="--rl-metrics-jsonl",
                                     help="One JSON line of metrics per iteration in this file (rank 0); on resume, "
                                          "lines past the resumed iteration are dropped.")
    # A broken backend or environment (e.g. a missing kernel) fails every rollout; without a limit the run
    # would go on skipping every update until --train-iters.
    max_all_failed_iterations: int = flag(3, name="--rl-max-all-failed-iterations",
                                          help="Stop the run after this many consecutive iterations in which every "
                                               "rollout failed (0: never stop).")
    # policy serving and off-policy servers (megatron/rl/server/policy_server.py, megatron/rl/observe/policy_gap.py)
    serve_inference: str | None = flag(
        None, name="--rl-serve-inference", metavar="[HOST:]PORT",
        help="Serve the policy being trained (the in-process engine) as an OpenAI-compatible server on rank 0 during "
             "rollout phases, for remote environment servers and other clients (host default 127.0.0.1).")
    serve_inference_wait_s: float = flag(600.0, name="--rl-serve-inference-wait-s",
                                         help="How long a request to --rl-serve-inference waits for a rollout phase "
                                              "before failing.")
    off_policy_server: bool = flag(False, name="--rl-off-policy-server",
                                   help="The inference server is not the trainer's policy (e.g. --inference-backend "
                                        "openai: its weights never change) and that is intended: skip the log-prob "
                                        "gap check.")
    max_policy_logprob_gap: float = flag(0.1, name="--rl-max-policy-logprob-gap",
                                         help="Mean |trainer - inference| log-prob per generated token above which the "
                                              "run stops: the server is not serving the trainer's policy (unless "
                                              "--rl-off-policy-server).")
    # separate inference layout; the default (no flags) generates with the training model itself
    inference_layout: InferenceLayoutConfig = section(InferenceLayoutConfig)
    # the in-process engine: CUDA graphs of the decode step, request and KV-cache limits (Megatron-LM's flags)
    engine: EngineFlags = section(EngineFlags)
    # samples, per-environment metrics, warnings, pass@k, --eval-only
    observe: ObserveConfig = section(ObserveConfig)
    # GRPO step speed: which passes run and the shapes they run at
    recompute_old_logprobs: bool = flag(
        False, name="--rl-recompute-old-logprobs",
        help="Always score old-policy log-probs in a separate forward pass. By default, when an iteration's rollouts "
             "feed exactly one optimizer step and one pass (and no dropout), they are taken (detached) from the "
             "training forward itself: the same numbers, one pass fewer.")
    fixed_microbatch_shapes: bool = flag(
        False, name="--rl-fixed-microbatch-shapes",
        help="Run every micro-batch at [--micro-batch-size, --seq-length] even without pipeline parallelism. By "
             "default each micro-batch drops its padding-only rows and positions (pipeline parallelism always keeps "
             "the fixed shape).")
    deterministic_forward: bool = derived(True)  # no dropout: a training forward scores what a scoring pass would
    # the rows a step is laid out in, from --rl-layout / --rl-packing-row-length / --rl-use-sequence-packing and the
    # run's shape (rl_config_from_args); None in an RLConfig built by hand (step_layout then reads use_sequence_packing)
    training_layout: TrainingLayout | None = derived(None)
    router_replay: str = flag(
        "off", name="--rl-router-replay", choices=REPLAY_MODES,
        help="MoE only. rollout = the in-process engine records the experts each token was routed to at every MoE "
             "layer, and the trainer's forwards (scoring and training) route those tokens to the same experts, so "
             "a near tie that rounds the other way in the trainer no longer sends a token through other experts "
             "(megatron.rl.routing.replay). Costs layers x top-k x 2 bytes per rollout token. off (default) = the "
             "trainer's routers choose.")
    # asynchronous rollouts; the defaults keep the synchronous collection
    async_rollouts: AsyncRolloutConfig = section(AsyncRolloutConfig)

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size


# What a run generates and trains on, recorded in its checkpoints so --use-checkpoint-args brings it back
# (megatron/rl/training/checkpoint/run_flags.py): the environment config (path and content hash), the batch
# shape, sampling, evaluation, packing and lag. Left out as run choices: the loss and optimizer, the backend and
# its servers, engine sizes, the parallel layout, logging and output paths.
CHECKPOINTED_FLAGS = (
    "--langrl-env-config", "--langrl-allow-imports", "--grpo-prompts-per-step", "--grpo-group-size",
    "--micro-batch-size", "--global-batch-size", "--rl-max-new-tokens", "--rl-default-temperature",
    "--rl-default-top-p", "--rl-default-top-k", "--rl-eval-temperature", "--rl-prompts-per-eval",
    "--rl-eval-samples", "--rl-eval-pass-at-k", "--rl-layout", "--rl-packing-row-length",
    "--rl-use-sequence-packing", "--rl-sequence-packing-max-sequences-per-bin", "--rl-sequence-packing-algo",
    "--rl-packed-attention", "--rl-share-prompt-prefix", "--rl-generation-lag", "--rl-partial-rollouts",
    "--rl-submission-granularity", "--rl-consumption-granularity", "--rl-max-inflight-requests")
_FILE_FLAGS = ("langrl_env_config",)


def checkpointed_run_flags(cfg: TrainingConfig) -> dict:
    """The record of :data:`CHECKPOINTED_FLAGS` stored with this run's checkpoints (their parsed values)."""
    values = {**vars(cfg.extra), "micro_batch_size": cfg.train.micro_batch_size,
              "global_batch_size": cfg.train.global_batch_size}
    dests = [option[2:].replace("-", "_") for option in CHECKPOINTED_FLAGS]
    return record_run_flags({d: values[d] for d in dests}, files=_FILE_FLAGS)


def add_rl_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The RL flags (generated from :class:`RLConfig`): an ``extra_args_provider`` for ``parse_args``."""
    # Dropout makes the training forward a different (random) policy from the one that scored the old
    # log-probs, so every PPO ratio would be noise: RL defaults to none (explicit flags still win).
    parser.set_defaults(hidden_dropout=0.0, attention_dropout=0.0)
    return add_flags(parser, RLConfig)


def _need(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


def inference_backend_class(name: str) -> type[api.InferenceInterface]:
    """The backend class ``--inference-backend`` names, looked up in the registry (its abilities decide the checks
    that depend on the backend), or a :class:`ConfigError` naming the flag, the value and the registered backends."""
    try:
        return api.backend_class(name)
    except UnknownNameError:
        raise ConfigError(
            f"--inference-backend={name}: no inference backend is registered under that name; registered backends: "
            f"{', '.join(api.backend_names())}. A backend of your own registers itself with "
            f"@InferenceInterface.register({name!r}) in its module: list that module under `imports:` in the "
            f"environment config (with --langrl-allow-imports), or import it before calling train_rl.main().") from None


def rl_config_from_args(cfg: TrainingConfig) -> RLConfig:
    """Build, resolve and validate :class:`RLConfig` from ``cfg.extra`` (flags added by :func:`add_rl_args`)."""
    a = cfg.extra
    _need(a.langrl_env_config is not None, "--langrl-env-config is required: the YAML file naming the agents to "
                                           "train on (see examples/rl/environment_configs/).")
    _need(Path(a.langrl_env_config).is_file(), f"--langrl-env-config={a.langrl_env_config}: no such file.")
    raw = from_namespace(RLConfig, a, deterministic_forward=cfg.model.hidden_dropout == 0
                         and cfg.model.attention_dropout == 0)
    rl = dataclasses.replace(raw, observe=resolve_observe(raw.observe, raw, cfg),
                             loss=async_loss_config(raw.loss, raw.async_rollouts))
    # A backend of the user's registers itself when its module is imported: the environment config's imports run
    # (with --langrl-allow-imports) before --inference-backend is looked up in the registry.
    import_env_config_modules(rl.env_config, allow_imports=rl.allow_import_paths)
    validate_rl_config(rl, cfg)
    layout = training_layout(rl, cfg)
    return dataclasses.replace(rl, training_layout=layout, use_sequence_packing=layout.packed)


def step_layout(rl: RLConfig, cfg: TrainingConfig) -> TrainingLayout:
    """The rows a run lays its steps out in: ``rl.training_layout`` (resolved by :func:`rl_config_from_args`), or
    for an :class:`RLConfig` built by hand, what its ``use_sequence_packing`` says (rows of ``--seq-length``)."""
    if rl.training_layout is not None:
        return rl.training_layout
    return training_layout(dataclasses.replace(rl, layout="auto" if rl.use_sequence_packing else "padded",
                                               packing_row_length="auto"), cfg)


def training_layout(rl: RLConfig, cfg: TrainingConfig) -> TrainingLayout:
    """The rows this run's steps are laid out in (:func:`~megatron.rl.packing.layout_choice.choose_layout` on the
    layout flags as typed and the run's shape); a :class:`ConfigError` for contradicting layout flags."""
    p = cfg.parallel
    return choose_layout(LayoutInputs(
        layout=rl.layout, use_sequence_packing=rl.use_sequence_packing, row_length=rl.packing_row_length,
        seq_length=cfg.model.seq_length, micro_batch_size=cfg.train.micro_batch_size, group_size=rl.group_size,
        max_new_tokens=rl.max_new_tokens, max_sequences_per_bin=rl.max_sequences_per_bin,
        share_prompt_prefix=rl.share_prompt_prefix, use_thd=cfg.model.transformer_impl == "transformer_engine",
        pipeline_parallel=p.pipeline_model_parallel_size,
        length_multiple=p.tensor_model_parallel_size if p.sequence_parallel else 1))


def validate_rl_config(rl: RLConfig, cfg: TrainingConfig) -> None:
    """Reject flag combinations that cannot work, before any compute; warn about ones that hurt."""
    if cfg.model.hidden_dropout > 0 or cfg.model.attention_dropout > 0:
        log.warning("--hidden-dropout=%s / --attention-dropout=%s: with dropout the policy being trained differs "
                    "from the one that scored the old log-probs, so PPO ratios are noisy (train_rl.py defaults "
                    "both to 0)", cfg.model.hidden_dropout, cfg.model.attention_dropout)
    _validate_batch(rl, cfg)
    _validate_values(rl, cfg)
    backend = inference_backend_class(rl.inference_backend)
    _need(not backend.needs_server_url or rl.inference_server_url,
          f"--inference-backend {rl.inference_backend} needs --inference-server-url (the OpenAI-compatible server's "
          f"base URL).")
    _validate_serving(rl, cfg)
    _need(cfg.parallel.virtual_pipeline_model_parallel_size is None,
          "train_rl.py does not support the interleaved pipeline schedule yet; drop "
          "--num-layers-per-virtual-pipeline-stage.")
    m = cfg.model
    validate_router_replay(rl.router_replay, num_experts=m.num_experts, inference_backend=rl.inference_backend,
                           records_routes=backend.records_routes, recompute_granularity=m.recompute_granularity,
                           load_balancing=m.moe_router_load_balancing_type)
    validate_inference_layout(rl.inference_layout, cfg, rl.inference_backend)
    validate_engine_flags(rl.engine, rl.inference_backend, rl.router_replay)
    if rl.inference_layout.enabled:
        replicas = rl.inference_layout.sizes(cfg).dp
        _need(rl.prompts_per_step % replicas == 0,
              f"--grpo-prompts-per-step={rl.prompts_per_step} must be divisible by the {replicas} inference "
              f"replicas of the inference layout (world size / (inference TP x PP)): each replica generates an "
              f"equal share of the prompt groups.")
    validate_async_rollouts(rl.async_rollouts, rl, cfg)


def _validate_batch(rl: RLConfig, cfg: TrainingConfig) -> None:
    """The batch arithmetic (see the module docstring): sizes >= 1, groups per DP rank, sequences per step."""
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


def _validate_values(rl: RLConfig, cfg: TrainingConfig) -> None:
    """Each value in its range: sampling, the loss, lengths, limits."""
    # Hostile / mistyped values: every float flag finite, every range checked here, before any model is built,
    # not after the checkpoint is loaded or one iteration in.
    for flag, value in (("--rl-default-temperature", rl.temperature), ("--rl-default-top-p", rl.top_p),
                        ("--rl-eval-temperature", rl.eval_temperature),
                        ("--grpo-kl-beta", rl.loss.kl_beta), ("--grpo-entropy-term-weight", rl.loss.entropy_weight)):
        _need(math.isfinite(value), f"{flag}={value}: must be a finite number.")
    # Every backend refuses 0 < T < MIN_TEMPERATURE per request (near-zero temperatures overflow the softmax).
    _need(MIN_TEMPERATURE <= rl.temperature <= MAX_TEMPERATURE,
          f"--rl-default-temperature={rl.temperature}: must be in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}] (the policy "
          f"samples at this temperature and the trainer scores log-probs at it).")
    _need(rl.eval_temperature == 0 or MIN_TEMPERATURE <= rl.eval_temperature <= MAX_TEMPERATURE,
          f"--rl-eval-temperature={rl.eval_temperature}: must be 0 (greedy) or in [{MIN_TEMPERATURE}, "
          f"{MAX_TEMPERATURE}].")
    validate_policy_loss(rl.loss)  # clip ranges, IS correction, sequence rejection: checked beside their fields
    inference_backend_class(rl.inference_backend)  # a name no backend is registered under: a ConfigError
    _need(0 < rl.top_p <= 1, f"--rl-default-top-p={rl.top_p}: must be in (0, 1].")
    _need(rl.top_k >= 0, f"--rl-default-top-k={rl.top_k}: must be >= 0 (0 disables top-k).")
    _need(rl.loss.kl_beta >= 0, f"--grpo-kl-beta={rl.loss.kl_beta}: must be >= 0.")
    _need(rl.max_new_tokens < cfg.model.seq_length,
          f"--rl-max-new-tokens={rl.max_new_tokens} leaves no room for a prompt within --seq-length="
          f"{cfg.model.seq_length}.")
    _need(rl.max_all_failed_iterations >= 0,
          f"--rl-max-all-failed-iterations={rl.max_all_failed_iterations}: must be >= 0 (0 never stops).")
    _need(rl.prompts_per_eval >= 0, f"--rl-prompts-per-eval={rl.prompts_per_eval}: must be >= 0.")


def _validate_serving(rl: RLConfig, cfg: TrainingConfig) -> None:
    """--rl-serve-inference / --rl-max-policy-logprob-gap (see megatron/rl/server/policy_server.py)."""
    _need(rl.max_policy_logprob_gap > 0, f"--rl-max-policy-logprob-gap={rl.max_policy_logprob_gap}: must be > 0.")
    if rl.serve_inference is None:
        return

    try:
        parse_address(rl.serve_inference)
    except ValueError as e:
        raise ConfigError(str(e)) from e
    _need(inference_backend_class(rl.inference_backend).in_process_engine,
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
