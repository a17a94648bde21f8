"""Training tokens/s with sequence packing vs padding, on a realistic RL length mix, measured side by side.

Both layouts train the same model on the same sequences with the same global batch, through exactly the
RL trainer's path: :func:`megatron.rl.rl_utils.build_step_batches` lays out the step (packed: first-fit
decreasing into ``--seq-length`` bins with up to ``--max-seqs-per-bin`` sequences; padded: one sequence
per row, i.e. ``max_sequences_per_bin=1``), :func:`megatron.rl.rl_loss.training_forward_step` computes the
GRPO loss with the block-diagonal causal attention mask the local layer spec needs on CPU, and
:func:`megatron.rl.training.loop.train_step` runs forward + backward + optimizer step through
megatron-core's schedule. Old log-probs are scored once per layout (untimed), as the RL step does before
its updates.

Length mix (seeded): prompt lengths uniform in [20, 200] tokens; response lengths log-normal (median
``--response-median`` tokens, sigma ``--response-sigma``: most answers short, a long tail) clipped to the
room the prompt leaves in ``--seq-length``. That is the shape of GRPO rollouts with a generous
``--rl-max-new-tokens``: a few rollouts use the budget, most stop far earlier.

tokens/s counts real (non-padding) tokens: ``sum(len(sequence))`` per step / step time. Packing efficiency
= real tokens / positions computed. Without pipeline parallelism each micro-batch is cropped to its rows'
real extent (:mod:`megatron.rl.packing.microbatches`), so padded rows cost their micro-batch's longest sequence,
not ``--seq-length``; ``--fixed-shapes`` runs both layouts at ``[micro-batch, seq-length]`` (the
``--rl-fixed-microbatch-shapes`` layout, also what pipeline parallelism uses). The
two layouts alternate within every round (order swapped each round), median step time per layout.

    python benchmarks/training_packing.py [--seq-length 1024 --num-seqs 64 --rounds 3]
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

PROMPT_RANGE = (20, 200)


def sample_lengths(num_seqs: int, seq_length: int, seed: int, response_median: float = 128.0,
                   response_sigma: float = 1.0) -> list[tuple[int, int]]:
    """(prompt_len, response_len) per sequence; prompt + response <= seq_length, response >= 1."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_seqs):
        prompt = min(rng.randint(*PROMPT_RANGE), seq_length - 1)
        response = int(round(rng.lognormvariate(math.log(response_median), response_sigma)))
        out.append((prompt, max(1, min(response, seq_length - prompt))))
    return out


def make_sequences(lengths: list[tuple[int, int]], vocab: int, seed: int, group_size: int):
    """Random-token :class:`TrainingSequence` s (loss on the response) with GRPO-like advantages."""
    import torch

    from megatron.rl.rollout.sequences import TrainingSequence

    g = torch.Generator().manual_seed(seed)
    seqs = []
    for i, (p, r) in enumerate(lengths):
        ids = torch.randint(0, vocab, (p + r,), generator=g).tolist()
        adv = float(torch.randn((), generator=g))
        seqs.append(TrainingSequence(token_ids=ids, loss_mask=[0] * p + [1] * r, inference_logprobs=None,
                                     advantage=adv, reward=adv, group_index=i // group_size, env_id="bench"))
    return seqs


def build_argv(a) -> list[str]:
    return (C.model_flags(a.hidden, a.layers, a.heads, a.seq_length)
            + C.optim_flags(a.micro_batch_size, a.num_seqs)
            + ["--langrl-env-config", str(C.ARITHMETIC_ENV), "--grpo-prompts-per-step", str(a.num_seqs // 8),
               "--grpo-group-size", "8", "--rl-use-sequence-packing",
               "--rl-sequence-packing-max-sequences-per-bin", str(a.max_seqs_per_bin),
               "--rl-max-new-tokens", str(a.seq_length - PROMPT_RANGE[0])]
            + (["--rl-fixed-microbatch-shapes"] if a.fixed_shapes else []))


def run(a) -> dict:
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loss import training_forward_step
    from megatron.rl.rl_utils import StepContext, build_step_batches, schedule_shape, score
    from megatron.rl.training.loop import train_step

    if a.num_seqs % 8:
        raise SystemExit(f"--num-seqs={a.num_seqs}: must be a multiple of 8 (8 rollouts per prompt group)")
    tr = C.build_trainer(build_argv(a), extra_args_providers=[add_rl_args])
    rl_packed = rl_config_from_args(tr.cfg)
    rl_padded = dataclasses.replace(rl_packed, use_sequence_packing=False)
    ctx = StepContext(model=tr.model, optimizer=tr.optimizer, scheduler=tr.scheduler, agent=None, inference=None,
                      pad_token_id=tr.tokenizer.pad, seq_length=a.seq_length, micro_batch_size=a.micro_batch_size,
                      global_batch_size=a.num_seqs, seed=a.seed, device=tr.device)
    lengths = sample_lengths(a.num_seqs, a.seq_length, a.seed, a.response_median, a.response_sigma)
    sequences = make_sequences(lengths, tr.tokenizer.vocab_size, a.seed, group_size=8)
    real_tokens = sum(p + r for p, r in lengths)

    # packed rows attend as --rl-packed-attention says (auto: per group of similar lengths where cheaper);
    # "packed, masked" is the one masked product per row that packing used before (its S x S work per row)
    rl_masked = dataclasses.replace(rl_packed, packed_attention="masked")
    layouts = {}
    for name, rl in (("packed", rl_packed), ("packed, masked", rl_masked), ("padded", rl_padded)):
        (step,) = build_step_batches(sequences, rl, ctx, num_steps=1, need_ref=False)
        score(ctx.model, step, "old_logprobs", rl.temperature, ctx)
        layouts[name] = (rl, step)

    def one_step(name: str) -> tuple[float, float]:
        """One optimizer step of ``name``'s layout, exactly as rl_iteration runs it: (wall s, CPU s)."""
        rl, step = layouts[name]
        fwd = training_forward_step(rl.loss, rl.loss_aggregation, step.normalizers, rl.temperature,
                                    grad_scale=float(step.num_microbatches), device=ctx.device, use_thd=False,
                                    packed_attention=rl.packed_attention)
        loader = step.microbatches(ctx.micro_batch_size)
        return C.timed_wall_cpu(lambda: train_step(fwd, iter(loader), ctx.model, ctx.optimizer, ctx.scheduler,
                                                   step.num_microbatches, **schedule_shape(ctx)))

    times = {name: [] for name in layouts}  # (wall s, CPU s) per measured step
    # Warm-up, untimed: the first step allocates the optimizer state and takes first-call paths, for
    # both layouts alike; one (cheaper, packed) step is enough.
    one_step("packed")
    for r in range(a.rounds):
        for name in (list(layouts) if r % 2 == 0 else list(layouts)[::-1]):
            times[name].append(one_step(name))
            wall, cpu = times[name][-1]
            print(f"round {r + 1}/{a.rounds} {name}: {wall:.2f}s wall, {cpu:.2f}s CPU", file=sys.stderr, flush=True)
    C.teardown()

    rows = []
    result = {"lengths": lengths, "real_tokens": real_tokens, "layouts": {}}
    for name, (rl, step) in layouts.items():
        wall = C.median([w for w, _ in times[name]])
        cpu = C.median([c for _, c in times[name]])
        eff = step.num_real_tokens / step.num_token_slots
        result["layouts"][name] = dict(rows=step.num_rows_total, microbatches=step.num_microbatches, efficiency=eff,
                                       step_s=wall, step_cpu_s=cpu, tokens_per_s=real_tokens / wall,
                                       tokens_per_cpu_s=real_tokens / cpu, times=times[name])
        rows.append([name, step.num_rows_total, step.num_microbatches, f"{100 * eff:.1f}%", f"{wall:.2f}",
                     f"{cpu:.2f}", f"{real_tokens / wall:,.0f}", f"{real_tokens / cpu:,.0f}",
                     f"{step.num_token_slots / cpu:,.0f}"])
    lay = result["layouts"]
    speedup = lay["packed"]["tokens_per_s"] / lay["padded"]["tokens_per_s"]
    speedup_cpu = lay["packed"]["tokens_per_cpu_s"] / lay["padded"]["tokens_per_cpu_s"]
    # Same real tokens on both sides, so a round's tokens/s ratio is padded time / packed time; the median
    # of the per-round ratios pairs steps run back to back.
    paired = C.median([tp[0] / tk[0] for tp, tk in zip(times["padded"], times["packed"])])
    paired_cpu = C.median([tp[1] / tk[1] for tp, tk in zip(times["padded"], times["packed"])])
    result.update(speedup=speedup, speedup_cpu=speedup_cpu, paired_speedup=paired, paired_speedup_cpu=paired_cpu)
    rows.append(["packed / padded", "", "", "", "", "", f"{speedup:.2f}x", f"{speedup_cpu:.2f}x", ""])
    rows.append(["packed / padded, per-round median", "", "", "", "", "", f"{paired:.2f}x", f"{paired_cpu:.2f}x", ""])
    masked = C.median([tm[0] / tk[0] for tm, tk in zip(times["packed, masked"], times["packed"])])
    masked_cpu = C.median([tm[1] / tk[1] for tm, tk in zip(times["packed, masked"], times["packed"])])
    result.update(vs_masked=masked, vs_masked_cpu=masked_cpu)
    rows.append(["packed / packed masked, per-round median", "", "", "", "", "", f"{masked:.2f}x",
                 f"{masked_cpu:.2f}x", ""])
    resp = sorted(r for _, r in lengths)
    print(C.machine_line())
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads; seq-length {a.seq_length}; "
          f"{a.num_seqs} sequences per step ({real_tokens} real tokens); micro-batch {a.micro_batch_size} rows; "
          f"packing: first-fit decreasing, <= {a.max_seqs_per_bin} sequences per bin")
    print(f"length mix (seed {a.seed}): prompt U[{PROMPT_RANGE[0]}, {PROMPT_RANGE[1]}], response lognormal(median "
          f"{a.response_median:g}, sigma {a.response_sigma:g}) clipped: response p50 {resp[len(resp) // 2]}, "
          f"p90 {resp[int(0.9 * (len(resp) - 1))]}, max {resp[-1]}; mean sequence {real_tokens / a.num_seqs:.0f} "
          f"tokens; {a.rounds} rounds, medians")
    print(C.format_table(["layout", "rows", "micro-batches", "packing efficiency", "step wall s", "step CPU s",
                          "real tokens/s", "real tokens/CPU-s", "row tokens/CPU-s"], rows,
                         title="Training throughput: packed vs padded (forward + backward + optimizer)"))
    return result


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # A small model keeps a 64 x 1024-token padded step to seconds on 2 CPU cores; the speed-up is the
    # ratio of real tokens per row, which does not depend on the model's size.
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--num-seqs", type=int, default=64, help="sequences per optimizer step (global batch)")
    p.add_argument("--micro-batch-size", type=int, default=1,
                   help="rows per micro-batch (both layouts); > 1 adds empty rows to fill the last micro-batch")
    p.add_argument("--max-seqs-per-bin", type=int, default=16)
    p.add_argument("--response-median", type=float, default=128.0)
    p.add_argument("--response-sigma", type=float, default=1.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--fixed-shapes", action="store_true",
                   help="every micro-batch at [--micro-batch-size, --seq-length] (no cropping of padding)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
