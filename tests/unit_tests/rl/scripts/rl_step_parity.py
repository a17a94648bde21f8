"""RL step on FIXED rollouts under one or more layouts; writes per-step losses/grad norms as JSON (rank 0).

    [torchrun --nproc-per-node N] rl_step_parity.py --variants VARIANTS.json --out OUT.json

VARIANTS.json: ``{name: {"argv": [megatron + RL flags], "ckpt": DIR, "save_ckpt": bool}}``. Every variant
runs in this process group, one after the other: parse the flags with the RL flag provider
(parse_args + rl_config_from_args: the real flag path), initialise megatron for the layout, build the
model, (1-process only: save its fresh weights to ``ckpt`` when ``save_ckpt``), load the weights from
``ckpt`` (so every layout starts from the same weights; PP changes init RNG order), build the same
rollout groups, and run the trainer's pieces: groups_to_sequences -> build_step_batches -> score(old
log-probs) -> logprob_gap -> training_forward_step through train_step, one optimizer step per step
batch (2 steps with 16 rollouts and --global-batch-size 8).
"""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4)))


def fixed_groups(num_groups: int = 4, group_size: int = 4, seed: int = 20260):
    """Deterministic token rollouts of mixed lengths (prompt 3..9 tokens, 2..24 generated)."""
    import torch

    from megatron.rl.base.types import RolloutGroup, TokenRollout

    g = torch.Generator().manual_seed(seed)
    groups = []
    for gi in range(num_groups):
        n_prompt = int(torch.randint(3, 10, (1,), generator=g))
        prompt = torch.randint(0, 256, (n_prompt,), generator=g).tolist()
        rollouts = []
        for _ in range(group_size):
            n_gen = int(torch.randint(2, 25, (1,), generator=g))
            gen = torch.randint(0, 256, (n_gen,), generator=g).tolist()
            reward = float(torch.rand((), generator=g))
            # inference log-probs: a fixed value, so logprob_gap measures the scored old log-probs
            rollouts.append(TokenRollout(prompt="p", completion="c", reward=round(reward, 3), env_id="fixed",
                                         token_ids=prompt + gen, generation_mask=[0] * n_prompt + [1] * n_gen,
                                         logprobs=[0.0] * n_prompt + [-6.0] * n_gen, prompt_length=n_prompt))
        groups.append(RolloutGroup(rollouts=rollouts, env_id="fixed"))
    return groups


def build_from_weights(argv, ckpt, save_ckpt):
    """Parse the flags (the real RL flag path), initialise megatron, build model + optimizer, load ``ckpt``
    (saved first from this fresh model when ``save_ckpt``, 1 process only) and, when the loss needs one,
    the reference model. Returns (cfg, rl, runtime, model, optimizer, scheduler, ref_model)."""
    import torch.distributed as dist

    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.training.checkpoint.save_load import load_checkpoint, save_checkpoint
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.optimizer import build_optimizer

    cfg = parse_args(argv, extra_args_providers=[add_rl_args])
    rl = rl_config_from_args(cfg)
    runtime = initialize_megatron(cfg)
    model = build_model(cfg)
    optimizer, scheduler = build_optimizer(cfg, model)
    if save_ckpt:
        assert dist.get_world_size() == 1, "save the reference weights from a 1-process run"
        save_checkpoint(ckpt, 0, model, None, None, model_args=cfg.model_args())
    load_checkpoint(ckpt, model, None, None, load_optimizer=False, load_rng=False, model_args=cfg.model_args())
    ref_model = None
    if rl.loss.needs_ref_logprobs:  # the reference policy: the same starting weights, never trained
        ref_model = build_model(cfg, wrap_with_ddp=False)
        load_checkpoint(ckpt, ref_model, None, None, load_optimizer=False, load_rng=False,
                        model_args=cfg.model_args())
    return cfg, rl, runtime, model, optimizer, scheduler, ref_model


def run_variant(argv, ckpt, save_ckpt):
    from megatron.rl import rl_utils
    from megatron.rl.rl_config import step_layout
    from megatron.rl.rl_loss import training_forward_step
    from megatron.rl.rollout.sequences import groups_to_sequences
    from megatron.rl.training.loop import train_step

    cfg, rl, runtime, model, optimizer, scheduler, ref_model = build_from_weights(argv, ckpt, save_ckpt)

    sequences = groups_to_sequences(fixed_groups(), rl.advantage_estimator, rl.filter_same_reward)
    assert len(sequences) == rl.rollouts_per_step, (len(sequences), rl.rollouts_per_step)
    t = cfg.train
    rows = step_layout(rl, cfg)  # --rl-layout: row length and rows per micro-batch, as train_rl.py runs them
    ctx = rl_utils.StepContext(model=model, optimizer=optimizer, scheduler=scheduler, agent=None, inference=None,
                               pad_token_id=257, seq_length=rows.row_length, micro_batch_size=rows.microbatch_rows,
                               global_batch_size=t.global_batch_size, seed=t.seed, device=runtime.device,
                               packed_attention=rl.packed_attention)
    num_steps = rl.rollouts_per_step // t.global_batch_size
    steps = rl_utils.build_step_batches(sequences, rl, ctx, num_steps, need_ref=ref_model is not None)
    for step in steps:
        rl_utils.score(model, step, "old_logprobs", rl.temperature, ctx)
        if ref_model is not None:
            rl_utils.score(ref_model, step, "ref_logprobs", rl.temperature, ctx)
    gap = rl_utils.logprob_gap(steps)
    dp = cfg.parallel.data_parallel_size
    out = {"logprob_gap_mean": gap["logprob_gap_mean"], "losses": [], "grad_norms": [], "reports": [],
           "num_microbatches": [s.num_microbatches for s in steps], "num_steps": len(steps),
           "packed": rows.packed, "row_length": rows.row_length,
           "shared_tokens": sum(s.num_shared_tokens for s in steps)}
    for _ in range(rl.grpo_iterations):
        for step in steps:
            fwd = training_forward_step(rl.loss, rl.loss_aggregation, step.normalizers, rl.temperature,
                                        grad_scale=float(step.num_microbatches * dp), device=runtime.device,
                                        use_thd=False, packed_attention=ctx.packed_attention)
            loader = step.microbatches(ctx.micro_batch_size)
            report, grad_norm, skipped = train_step(fwd, iter(loader), model, optimizer, scheduler,
                                                    step.num_microbatches, **rl_utils.schedule_shape(ctx))
            assert not skipped
            out["losses"].append(report["rl loss"])
            out["grad_norms"].append(grad_norm)
            out["reports"].append(report)
    # after the updates: the new policy's log-probs on the same data (the update itself is compared)
    for step in steps:
        rl_utils.score(model, step, "old_logprobs", rl.temperature, ctx)
    out["logprob_gap_mean_after"] = rl_utils.logprob_gap(steps)["logprob_gap_mean"]
    return out


def main():
    import argparse

    import torch.distributed as dist

    from megatron.rl.training.initialize import destroy_megatron

    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    variants = json.loads(open(a.variants).read())
    results = {}
    for name, v in variants.items():
        results[name] = run_variant(v["argv"], v["ckpt"], v.get("save_ckpt", False))
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f, indent=1)
    destroy_megatron()


if __name__ == "__main__":
    main()
