"""Where a GRPO iteration's time goes: generate / log-probs / train, with the in-process megatron backend.

Runs ``train_rl.py``'s driver (:func:`megatron.rl.rl_loop.run_rl`) in this process on the quickstart's
tiny model (random weights: no checkpoint needed) and the arithmetic environment, with megatron-core's
dynamic inference engine generating the rollouts from the policy's own weights. Each RL iteration reports
the time of its three phases (see :func:`megatron.rl.rl_utils.rl_iteration`):

- generate: rollout collection (engine generation + environment scoring);
- log-probs: the forward-only pass recomputing old-policy log-probs of every packed sequence (~0 when
  one optimizer step consumes the rollouts: they then come from the training forward itself);
- train: ``--grpo-iterations`` passes of optimizer steps (forward + backward + optimizer).

The first iteration is a warm-up (engine and allocator first-call costs) and is left out; the table
shows the median of the rest per phase and its share of the iteration.

    python benchmarks/grpo_step.py [--iters 4 --prompts 8 --group-size 8 --max-new-tokens 32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

PHASES = (("generate", "time_generate_s"), ("log-probs", "time_logprobs_s"), ("train", "time_train_s"))


def build_argv(a) -> list[str]:
    rollouts = a.prompts * a.group_size
    return (C.model_flags(a.hidden, a.layers, a.heads, a.seq_length)
            + C.optim_flags(a.micro_batch_size, rollouts, train_iters=a.iters)
            + ["--langrl-env-config", str(C.ARITHMETIC_ENV), "--grpo-prompts-per-step", str(a.prompts),
               "--grpo-group-size", str(a.group_size), "--rl-use-sequence-packing",
               "--rl-max-new-tokens", str(a.max_new_tokens), "--rl-default-temperature", "1.0",
               "--rl-prompts-per-eval", "0", "--inference-backend", "megatron"])


def run(a) -> dict:
    measured = C.measured_rl_iterations(build_argv(a), a.iters)

    total = C.median([h["time_total_s"] for h in measured])
    rows, out = [], {"iterations": measured}
    for name, key in PHASES:
        t = C.median([h[key] for h in measured])
        out[name] = t
        rows.append([name, f"{t:.3f}", f"{100 * t / total:.0f}%"])
    other = max(total - sum(out[n] for n, _ in PHASES), 0.0)
    rows.append(["other (gather, packing, metrics)", f"{other:.3f}", f"{100 * other / total:.0f}%"])
    rows.append(["total", f"{total:.3f}", "100%"])
    out["total"] = total
    gen_tps = C.median([h["generation_tokens_per_s"] for h in measured])
    train_tps = C.median([h["train_tokens_per_s"] for h in measured])
    print(C.machine_line())
    print(f"model: {a.layers} layers, hidden {a.hidden}, {a.heads} heads, seq-length {a.seq_length} (random weights); "
          f"{a.prompts} prompts x {a.group_size} rollouts = {a.prompts * a.group_size} sequences per iteration, "
          f"<= {a.max_new_tokens} new tokens each, 1 optimizer step, packed, micro-batch {a.micro_batch_size}; "
          f"median of iterations 2..{a.iters}")
    print(f"mean response length {C.median([h['response_length_mean'] for h in measured]):.1f} tokens; generation "
          f"{gen_tps:,.0f} tokens/s; training {train_tps:,.0f} tokens/s; packing efficiency "
          f"{C.median([h['packing_efficiency'] for h in measured]):.3f}")
    print(C.format_table(["phase", "seconds (median)", "share"], rows, title="GRPO iteration time by phase"))
    return out


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq-length", type=int, default=128)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=4, help="RL iterations (the first is a warm-up)")
    return p.parse_args(argv)


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
