"""Check and time the refit of an inference copy from a trainer (megatron-core ``swap_model_weights``).

Builds a training model (random weights) and an inference copy at another layout exactly as ``train_rl.py``
does with ``--rl-inference-*-model-parallel-size``, refits it ``--repeats`` times (the first call also
plans), and checks that the copy agrees with the trainer: full logits on a probe batch (when neither
side is pipelined) and the log-probs the copy's inference engine reports vs the trainer's teacher-forced
ones (what ``--rl-verify-model-weights-swap`` does). Exits non-zero on a mismatch.

    # 2 GPUs, NCCL refit, train TP=2 -> infer TP=1
    torchrun --nproc-per-node 2 tools/check_refit.py --refit-method nccl \\
        --tensor-model-parallel-size 2 --rl-inference-tensor-model-parallel-size 1
    # 1 GPU (TP=1 -> TP=1: local copies through the NCCL copy service)
    torchrun --nproc-per-node 1 tools/check_refit.py --refit-method nccl --rl-inference-tensor-model-parallel-size 1
    # CPU, gloo
    torchrun --nproc-per-node 2 tools/check_refit.py --tensor-model-parallel-size 2 \\
        --rl-inference-tensor-model-parallel-size 1

Any other Megatron model flag (``--num-layers``, ``--hidden-size``, ``--bf16``, ``--num-experts`` ...) is
passed through; defaults are a small GPT (see ``DEFAULTS``).
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DEFAULTS = {"--num-layers": "4", "--hidden-size": "256", "--num-attention-heads": "8", "--seq-length": "256",
            "--max-position-embeddings": "256", "--micro-batch-size": "1", "--lr": "1e-5", "--train-iters": "1",
            "--tokenizer-type": "ByteLevelTokenizer", "--rl-max-new-tokens": "16"}

def _with_defaults(argv: list[str], world: int) -> list[str]:
    out = list(argv)
    # only the RL batch-arithmetic checks read these: one group of 8 per rank, one optimizer step
    defaults = {**DEFAULTS, "--grpo-prompts-per-step": str(world), "--grpo-group-size": "8",
                "--global-batch-size": str(8 * world)}
    for flag, value in defaults.items():
        if flag not in out:
            out += [flag, value]
    return out


def _full_logits(model, ids):
    """Gathered logits [len, vocab] of one sequence from an unpipelined model (trainer or copy)."""
    import torch
    from megatron.core.utils import unwrap_model

    gpt = unwrap_model(model)
    device = next(gpt.parameters()).device
    with torch.no_grad():
        tokens = torch.tensor([ids], device=device)
        logits = model(tokens, torch.arange(len(ids), device=device)[None], None)
        tp = gpt.pg_collection.tp
        if tp.size() > 1:
            parts = [torch.empty_like(logits) for _ in range(tp.size())]
            import torch.distributed as dist

            dist.all_gather(parts, logits.contiguous(), group=tp)
            logits = torch.cat(parts, dim=-1)
    return logits[0].float()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], add_help=False)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--help", "-h", action="store_true")
    own, rest = p.parse_known_args(argv)
    if own.help:
        print(__doc__)
        return 0
    from megatron.rl.logging import setup_distributed_logging

    setup_distributed_logging()  # before megatron-core loads: its missing-kernel warnings become one INFO line
    import torch
    import torch.distributed as dist

    from megatron.rl import parallel_utils
    from megatron.rl.layout.parity import verify_weights_swap
    from megatron.rl.layout.refit import build_layout_inference, model_bytes
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_utils import StepContext, probe_logprob_gap
    from megatron.rl.training.config import ConfigError, parse_args
    from megatron.rl.training.initialize import destroy_megatron, initialize_megatron
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.tokenizer import build_tokenizer

    world = int(os.environ.get("WORLD_SIZE", "1"))
    with tempfile.TemporaryDirectory() as tmp:
        env = Path(tmp) / "env.yaml"
        env.write_text("environments: [{type: arithmetic, weight: 1}]\n")
        args = _with_defaults(rest, world) + ["--langrl-env-config", str(env), "--rl-default-temperature", "1.0"]
        cfg = parse_args(args, extra_args_providers=[add_rl_args])
        rl = rl_config_from_args(cfg)
    if not rl.inference_layout.enabled:
        raise ConfigError("give the inference layout: --rl-inference-tensor-model-parallel-size N "
                          "(and/or --rl-inference-pipeline-/expert-model-parallel-size)")
    runtime = initialize_megatron(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
    model = build_model(cfg, tokenizer=tokenizer)
    inference = build_layout_inference(cfg, rl.inference_layout, model, tokenizer)
    times = []
    for _ in range(max(own.repeats, 1)):
        inference.mark_trainer_updated()
        dist.barrier()
        times.append(inference.refit_if_stale())
    status = 0
    rank0 = dist.get_rank() == 0
    s = rl.inference_layout.sizes(cfg)
    if cfg.parallel.pipeline_model_parallel_size == 1 and s.pp == 1:
        ids = [int(t) for t in tokenizer.tokenize("The refit must reproduce the trainer's logits exactly. 12345")]
        for c in model + inference.copy.model:
            c.eval()
        diff = (_full_logits(model[0], ids) - _full_logits(inference.copy.model[0], ids)).abs().max()
        worst = torch.tensor([float(diff)], dtype=torch.float64)
        parallel_utils.all_reduce_max(worst)
        if rank0:
            print(f"max |logit(trainer) - logit(copy)| on the probe sequence: {float(worst[0]):.3e}")
        half = cfg.model.bf16 or cfg.model.fp16
        if float(worst[0]) > (5e-2 if half else 1e-4):
            status = 1
        for c in model:
            c.train()
    ctx = StepContext(model=model, optimizer=None, scheduler=None, agent=None, inference=inference,
                      pad_token_id=tokenizer.pad, seq_length=cfg.model.seq_length,
                      micro_batch_size=cfg.train.micro_batch_size, global_batch_size=cfg.train.global_batch_size,
                      seed=cfg.train.seed, device=runtime.device)
    try:
        gap = verify_weights_swap(inference, functools.partial(probe_logprob_gap, ctx, rl), rl.max_new_tokens,
                                  rl.temperature)
        if rank0:
            print(f"max |log-prob(copy engine) - log-prob(trainer, teacher-forced)|: {gap:.3e}")
    except RuntimeError as e:
        if rank0:
            print(f"MISMATCH: {e}")
        status = 1
    if rank0:
        later = times[1:] or times
        print(f"device {runtime.device}, world {world}: trainer TP={cfg.parallel.tensor_model_parallel_size} "
              f"PP={cfg.parallel.pipeline_model_parallel_size} EP={cfg.parallel.expert_model_parallel_size} -> copy "
              f"TP={s.tp} PP={s.pp} EP={s.ep}; copy {model_bytes(inference.copy.model) / 2**20:.1f} MB on rank 0; "
              f"refit via {inference.copy.refit_method}: first {times[0] * 1e3:.1f} ms (plans), then median "
              f"{statistics.median(later) * 1e3:.1f} ms over {len(later)}")
        print("REFIT OK" if status == 0 else "REFIT FAILED")
    inference.close()
    destroy_megatron()
    return status


if __name__ == "__main__":
    sys.exit(main())
