"""The RL training driver behind ``train_rl.py``: build everything, resume, iterate, evaluate, save.

Resumption is exact: a checkpoint holds the model, optimizer, scheduler, per-rank RNG states, the RL
iteration and the agents' prompt positions; rollout sampling seeds derive from (``--seed``, iteration,
DP rank), so a resumed run collects the same rollouts the uninterrupted run would have.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any

from megatron.rl import parallel_utils
from megatron.rl.agent.endpoint_check import check_reward_endpoints
from megatron.rl.agent.env_config import build_agent_from_config
from megatron.rl.base.errors import ConfigError, RLError
from megatron.rl.layout.backend import build_run_inference
from megatron.rl.layout.parity import start_inference_copy
from megatron.rl.observe.iteration_line import format_rl_line
from megatron.rl.observe.policy_gap import check_policy_gap
from megatron.rl.observe.run_summary import run_summary
from megatron.rl.observe.samples import samples_markdown
from megatron.rl.observe.guard import CollapseGuard, apply_guard_actions, check_guard_target
from megatron.rl.observe.warnings import RunWarnings, warning_metrics
from megatron.rl.rl_config import RLConfig, checkpointed_run_flags, step_layout
from megatron.rl.rl_eval import evaluate, format_eval_line
from megatron.rl.rl_utils import IterationResult, StepContext, finite_or_raise, probe_logprob_gap, rl_iteration
from megatron.rl.rollout.collection import generation_split
from megatron.rl.rollout.async_source import check_bank_left_unused
from megatron.rl.rollout.source import build_rollout_source
from megatron.rl.routing.replay import install_router_replay
from megatron.rl.runtime import flush_denormals
from megatron.rl.server.policy_server import serve_policy
from megatron.rl.training.config import TrainingConfig
from megatron.rl.training.loop_control import LoopControl
from megatron.rl.training.metrics import MetricsJsonl
from megatron.rl.training.run import RL_RESUME, Resumed, TrainingRun

log = logging.getLogger(__name__)

@dataclasses.dataclass
class RLRunResult:
    iteration: int
    history: list[dict[str, float]]  # one metrics dict per iteration (with "iteration")
    evals: list[dict[str, float]]  # one per evaluation (with "iteration")
    stop_reason: str | None = None  # why the collapse guard stopped the run (None: it ran to the end)


class AllRolloutsFailedError(RLError, RuntimeError):
    """Every rollout failed for ``--rl-max-all-failed-iterations`` iterations in a row."""


def count_all_failed(previous: int, metrics: dict[str, float], rollouts_per_step: int) -> int:
    """Consecutive iterations whose every rollout failed, after one more iteration with ``metrics``."""
    return previous + 1 if metrics.get("failed_rollouts", 0.0) >= rollouts_per_step else 0


def run_rl(cfg: TrainingConfig, rl: RLConfig) -> RLRunResult:
    """Run ``--train-iters`` RL iterations (all ranks). Initialises megatron; returns the metrics."""
    with flush_denormals():
        return _run_rl(cfg, rl)


def _run_rl(cfg: TrainingConfig, rl: RLConfig) -> RLRunResult:
    t = cfg.train
    run, ctx, iteration = build_run(cfg, rl)
    loop = _Loop(cfg, rl, run, ctx, iteration)
    if loop.evaluates and iteration == 0:
        loop.evaluate(0)
    control = LoopControl.from_config(cfg, loop.save, last_saved=iteration if cfg.checkpoint.load else None)
    while iteration < t.train_iters:
        result = rl_iteration(ctx, rl, iteration)
        iteration += 1
        loop.record(iteration, result)
        if loop.stop_reason is not None:
            break  # the collapse guard: the final save below makes the run resumable from here
        if loop.evaluates and (iteration % t.eval_interval == 0 or iteration == t.train_iters):
            loop.evaluate(iteration)
        if control.after_iteration(iteration):
            break
    control.finish(iteration)
    if loop.stop_reason is not None and parallel_utils.is_rank0():
        saved = f"resume with --load {cfg.checkpoint.save}" if cfg.checkpoint.save else "no --save: nothing saved"
        log.error("stopped at iteration %d: %s; %s", iteration, loop.stop_reason, saved)
    run.close()
    ctx.rollouts.close()  # cancels groups generated ahead
    ctx.inference.close()  # frees the in-process engine's KV cache / the HTTP client
    return RLRunResult(iteration, loop.history, loop.evals, loop.stop_reason)


def check_run_flags(cfg: TrainingConfig, rl: RLConfig) -> None:
    """What a training run needs beyond valid flags, before any model is built."""
    if cfg.train.train_iters is None:
        raise ConfigError("--train-iters is required: the number of RL iterations to run.")
    if rl.loss.needs_ref_logprobs and not cfg.checkpoint.pretrained_checkpoint:
        raise ConfigError(f"--grpo-kl-beta={rl.loss.kl_beta} needs --pretrained-checkpoint: the reference "
                          f"model's weights (the policy you start from).")
    check_bank_left_unused(rl.async_rollouts, cfg.checkpoint.save, resuming=bool(cfg.checkpoint.load))


def build_run(cfg: TrainingConfig, rl: RLConfig) -> tuple[TrainingRun, StepContext, int]:
    """The run's flags checked, then agents, model, optimizer and resumed state, the generating backend and the
    rollout source (all ranks); returns them with the iteration to start at."""
    t, c = cfg.train, cfg.checkpoint
    check_run_flags(cfg, rl)
    agent = build_agent_from_config(rl.env_config, allow_imports=rl.allow_import_paths)
    check_guard_target(rl.observe.env_collapse_action, agent)  # before any model is built
    check_reward_endpoints(agent)  # a judge that does not answer is named before the model is built
    run = TrainingRun.build(cfg, RL_RESUME, ref_model=rl.loss.needs_ref_logprobs,
                            run_flags=checkpointed_run_flags(cfg))
    if rl.router_replay == "rollout":  # MoE routing replay slots on the routers the trainer's forwards run
        for chunks in (run.model, run.ref_model):
            if chunks is not None:
                install_router_replay(chunks)
    start = run.resume()
    _log_start(cfg, start)
    backend = build_run_inference(cfg, rl, run.model, run.tokenizer)
    agent.set_data_parallel(*generation_split(backend)[1:])
    if start.run_state.get("agent"):
        agent.load_state_dict(start.run_state["agent"])
    inference = backend
    if rl.serve_inference:  # remote environments (and any OpenAI client) generate with the trained policy
        inference = serve_policy(backend, rl.serve_inference, rl.serve_inference_wait_s)
    agent.bind_inference(inference)
    # A durable rollout bank restores what a resumed run lost.
    rollouts = build_rollout_source(agent, inference, rl, t.seed, start.iteration, save=c.save,
                                    resuming=start.from_checkpoint or bool(c.load),
                                    recorded=start.run_state.get("rollout_bank_groups"))
    # --rl-layout: the rows' length and count per micro-batch (megatron/rl/packing/layout_choice.py)
    rows = step_layout(rl, cfg)
    ctx = StepContext(model=run.model, optimizer=run.optimizer, scheduler=run.scheduler, agent=agent,
                      inference=inference, pad_token_id=run.tokenizer.pad, seq_length=rows.row_length,
                      micro_batch_size=rows.microbatch_rows, global_batch_size=t.global_batch_size, seed=t.seed,
                      device=run.runtime.device, use_thd=cfg.model.transformer_impl == "transformer_engine",
                      ref_model=run.ref_model, rollouts=rollouts, packed_attention=rl.packed_attention,
                      max_sequence_length=cfg.model.seq_length)
    if rl.inference_layout.enabled:  # first refit (from the loaded weights), then the optional parity check
        start_inference_copy(backend, rl.inference_layout.verify_model_weights_swap,
                             functools.partial(probe_logprob_gap, ctx, rl), rl.max_new_tokens, rl.temperature)
    if run.threads is not None:  # other processes' load while the run was built decides the first count
        run.threads.update()
    log.info(run_summary(cfg, rl, start, ctx.rollouts.describe(),
                         threads=run.threads.describe() if run.threads is not None else None,
                         malloc=run.cpu_malloc))
    return run, ctx, start.iteration


def _log_start(cfg: TrainingConfig, start: Resumed) -> None:
    c = cfg.checkpoint
    if not start.from_checkpoint and not c.pretrained_checkpoint:
        if c.load:
            log.info("--load %s holds no checkpoint yet: starting a new run", c.load)
        else:
            log.warning("no --pretrained-checkpoint: RL starts from randomly initialised weights")
    if c.load is None and c.save is None:
        log.info("no --save: this run will not be resumable")


class _Loop:
    """What the loop does around each iteration: record, report and check its metrics, evaluate, save."""

    def __init__(self, cfg: TrainingConfig, rl: RLConfig, run: TrainingRun, ctx: StepContext, start: int):
        self.cfg, self.rl, self.run, self.ctx = cfg, rl, run, ctx
        self.writer = run.writer
        # on resume, the JSONL drops the lines past the start iteration
        self.jsonl = MetricsJsonl(rl.metrics_jsonl, start) if (rl.metrics_jsonl and parallel_utils.is_rank0()) else None
        if self.jsonl is not None:  # the run's name: its W&B name, else the directory holding the metrics file
            self.jsonl.write_run_start(cfg.logging.wandb_exp_name or self.jsonl.path.resolve().parent.name, start)
        o = rl.observe
        self.checks = RunWarnings(o.warning_thresholds, o.warn_interval, rl.max_new_tokens,
                                  report=parallel_utils.is_rank0())
        self.guard = CollapseGuard(o.env_collapse_action, o.env_collapse_patience)
        self.stop_reason: str | None = None
        self.evaluates = bool(cfg.train.eval_interval) and rl.prompts_per_eval > 0
        self.history: list[dict[str, float]] = []
        self.evals: list[dict[str, float]] = []
        self.all_failed = 0

    def record(self, iteration: int, result: IterationResult) -> None:
        """Warnings, history, the iteration line, TensorBoard / W&B / JSONL, and the checks that stop a run."""
        rl, metrics = self.rl, result.metrics
        findings = self.checks.check(metrics, result.observations)
        metrics.update(warning_metrics(findings))
        acted, stop = apply_guard_actions(self.guard.update(findings, iteration), self.ctx.agent,
                                          rl.observe.env_collapse_weight_factor, report=parallel_utils.is_rank0())
        metrics.update(acted)
        self.stop_reason = self.stop_reason or stop
        if self.run.threads is not None:  # the count this iteration ran with: a change moves a run's floats
            metrics["cpu_threads"] = float(self.run.threads.threads)
        record = {"iteration": iteration, **metrics}
        self.history.append(record)
        finite_or_raise(metrics)
        train_iters = self.cfg.train.train_iters
        if iteration % self.cfg.logging.log_interval == 0 or iteration == train_iters:
            lr = float(self.ctx.optimizer.param_groups[0]["lr"])
            log.info(format_rl_line(iteration, train_iters, metrics, lr, rl.observe.log_line,
                                    self.evals[-1] if self.evals else None))
        self.checks.report(findings, iteration)
        self.emit(record)
        ledger = self.ctx.rollouts.ledger()
        if ledger is not None and self.jsonl is not None:  # rollout bank: this rank's group uids, for audits
            self.jsonl.write({"iteration": iteration, "rollout_groups": ledger})
        if self.run.threads is not None:  # fewer CPU threads while other processes keep cores busy
            self.run.threads.update()
        self.all_failed = count_all_failed(self.all_failed, metrics, rl.rollouts_per_step)
        if rl.max_all_failed_iterations and self.all_failed >= rl.max_all_failed_iterations:
            raise AllRolloutsFailedError(
                f"every rollout failed in {self.all_failed} consecutive iterations (up to iteration {iteration}); "
                f"the warnings above give each failure's reason (backend or environment errors). Fix the cause, "
                f"or raise --rl-max-all-failed-iterations (0 never stops).")
        check_policy_gap(metrics, iteration, rl.max_policy_logprob_gap,
                         rl.off_policy_server or rl.async_rollouts.off_policy,
                         rl.inference_backend, first=len(self.history) == 1)
        self.emit_samples(iteration, result)

    def emit(self, record: dict[str, Any]) -> None:
        if self.writer is not None:
            self.writer.log_scalars({k: v for k, v in record.items() if k != "iteration"}, record["iteration"])
        if self.jsonl is not None:
            self.jsonl.write(record)

    def emit_samples(self, iteration: int, result: IterationResult) -> None:
        samples = result.observations.samples if result.observations is not None else []
        if not samples:
            return
        if self.writer is not None:
            self.writer.log_text("rl/samples", samples_markdown(samples), iteration)
        if self.jsonl is not None:
            self.jsonl.write({"iteration": iteration, "samples": samples})

    def evaluate(self, iteration: int) -> None:
        start = time.perf_counter()
        result = {"iteration": iteration, **evaluate(self.ctx.agent, self.ctx.inference, self.rl, self.ctx.seed)}
        findings = self.checks.check_eval(result)
        result.update(warning_metrics(findings))
        self.evals.append(result)
        self.emit(result)
        self.checks.report(findings, iteration)
        log.info(" evaluation at iteration %d | %s | %.1fs", iteration, format_eval_line(result),
                 time.perf_counter() - start)

    def save(self, iteration: int) -> None:
        # every rank's durable groups: a resume whose bank holds fewer says so (emptied, deleted or cut files)
        banked = parallel_utils.all_gather_object(self.ctx.rollouts.durable_groups())
        state = {"iteration": iteration, "agent": self.ctx.agent.state_dict()}
        if any(n is not None for n in banked):
            state["rollout_bank_groups"] = banked
        # what was measured at this iteration (training metrics, an evaluation): --save-retain-best's scores
        measured = [r for r in (self.history[-1:] + self.evals[-1:]) if r["iteration"] == iteration]
        metrics = {k: v for r in measured for k, v in r.items() if k != "iteration"}
        self.run.save(iteration, state, metrics)
        self.ctx.rollouts.checkpoint_saved(iteration)  # a rollout bank forgets what this checkpoint trained
