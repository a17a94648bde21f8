"""One RL update on FIXED rollouts, per variant: metrics, gradients and updated weights (rank 0 writes JSON).

    torchrun --nproc-per-node 1 rl_step_shortcuts.py --variants VARIANTS.json --ckpt DIR --out OUT.json

Every variant parses its flags through the real RL flag path, builds the model and optimizer, loads the
same weights (the first variant saves them), lays out the fixed rollouts of rl_step_parity.py with
:func:`megatron.rl.rl_utils.build_step_batches` and runs :func:`megatron.rl.rl_utils.update_policy`, the
iteration's whole scoring + training part. It records the metrics (timings dropped), every parameter's
gradient after the last step, the updated weights, how many old-policy scoring passes ran, and the
micro-batch shapes the model saw.
"""
import json
import os
import sys

sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), *[os.pardir] * 4)))
sys.path.insert(0, os.path.dirname(__file__))


def run_variant(argv, ckpt, save_ckpt):
    import torch

    from megatron.rl import rl_utils
    from megatron.rl.rl_config import step_layout
    from megatron.rl.rollout.sequences import groups_to_sequences
    from megatron.rl.training.model_provider import unwrap_model
    from rl_step_parity import build_from_weights, fixed_groups

    cfg, rl, runtime, model, optimizer, scheduler, ref_model = build_from_weights(argv, ckpt, save_ckpt)

    sequences = groups_to_sequences(fixed_groups(), rl.advantage_estimator, rl.filter_same_reward)
    t = cfg.train
    rows = step_layout(rl, cfg)  # --rl-layout: row length and rows per micro-batch, as train_rl.py runs them
    ctx = rl_utils.StepContext(model=model, optimizer=optimizer, scheduler=scheduler, agent=None, inference=None,
                               pad_token_id=257, seq_length=rows.row_length, micro_batch_size=rows.microbatch_rows,
                               global_batch_size=t.global_batch_size, seed=t.seed, device=runtime.device,
                               ref_model=ref_model)
    steps = rl_utils.build_step_batches(sequences, rl, ctx, rl.rollouts_per_step // t.global_batch_size,
                                        need_ref=ref_model is not None)

    scored, shapes = [], []
    real_score = rl_utils.score

    def counting_score(m, step, value_name, *a, **k):
        scored.append(value_name)
        return real_score(m, step, value_name, *a, **k)

    gpt = unwrap_model(model)[0]
    hook = gpt.register_forward_hook(lambda mod, inp, out: shapes.append(list(inp[0].shape)))
    rl_utils.score = counting_score
    try:
        metrics = rl_utils.update_policy(ctx, rl, steps)
    finally:
        rl_utils.score = real_score
        hook.remove()
    params = [(n, p) for n, p in model[0].named_parameters()]
    return {
        "metrics": {k: v for k, v in metrics.items() if not k.startswith("time_") and not k.endswith("_per_s")},
        "grads": {n: p.main_grad.flatten().tolist() for n, p in params},
        "weights": {n: p.detach().flatten().tolist() for n, p in params},
        "old_logprobs": [s.batch.values["old_logprobs"].flatten().tolist() for s in steps],
        "scoring_passes": scored,
        "shapes": shapes,
        "num_token_slots": [s.num_token_slots for s in steps],
        "num_real_tokens": [s.num_real_tokens for s in steps],
        "any_grad_nonzero": any(bool(torch.any(p.main_grad != 0)) for _, p in params),
    }


def main():
    import argparse

    import torch.distributed as dist

    from megatron.rl.training.initialize import destroy_megatron

    p = argparse.ArgumentParser()
    p.add_argument("--variants", required=True)
    p.add_argument("--ckpt", required=True)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    variants = json.loads(open(a.variants).read())
    results = {}
    for i, (name, argv) in enumerate(variants.items()):
        results[name] = run_variant(argv, a.ckpt, save_ckpt=i == 0)
    if dist.get_rank() == 0:
        with open(a.out, "w") as f:
            json.dump(results, f)
    destroy_megatron()


if __name__ == "__main__":
    main()
