"""One GRPO iteration of a Qwen2.5-0.5B-shaped model on a GPU: tokens/s, peak memory, MFU, phase split.

Runs ``train_rl.py``'s driver (:func:`megatron.rl.rl_loop.run_rl`) in this process with random weights
(nothing is downloaded) on the arithmetic environment, generating with the in-process megatron-core
engine. The shape is Qwen2.5-0.5B's: 24 layers, hidden 896, 14 heads / 2 KV groups, SwiGLU FFN 4864,
RMSNorm, RoPE (base 1e6), QKV bias, tied embeddings, and its 151,936-entry vocabulary (the byte tokenizer's
vocabulary padded to that size with ``--make-vocab-size-divisible-by``, so the output layer costs what
Qwen's does). Random weights rarely emit EOS, so responses run to ``--max-new-tokens``.

MFU counts matmul FLOPs only: 6·N per trained token (forward + backward), 2·N per scored token (the
old-log-prob pass, when it runs) and 2·N per generated or prefilled token, with N the parameter count;
attention score FLOPs are left out (sequences are short). The peak is the GPU's dense bf16 (or TF32)
figure given by ``--peak-tflops``.

    python benchmarks/gpu_grpo_step.py [--bf16] [--iters 4] [--prompts 32 --group-size 8 --max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common as C  # noqa: E402

QWEN25_05B = dict(layers=24, hidden=896, heads=14, kv_groups=2, ffn=4864, vocab=151936)


def build_argv(a) -> list[str]:
    s = QWEN25_05B
    rollouts = a.prompts * a.group_size
    argv = ["--num-layers", str(s["layers"]), "--hidden-size", str(s["hidden"]),
            "--num-attention-heads", str(s["heads"]), "--group-query-attention", "--num-query-groups",
            str(s["kv_groups"]), "--ffn-hidden-size", str(s["ffn"]), "--seq-length", str(a.seq_length),
            "--max-position-embeddings", str(a.seq_length), "--swiglu", "--normalization", "RMSNorm",
            "--norm-epsilon", "1e-6", "--position-embedding-type", "rope", "--rotary-base", "1000000",
            "--disable-bias-linear", "--add-qkv-bias", "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
            "--tokenizer-type", "ByteLevelTokenizer", "--make-vocab-size-divisible-by", str(s["vocab"]),
            "--seed", "1", "--log-level", "WARNING",
            "--langrl-env-config", str(env_config(a.max_new_tokens)), "--grpo-prompts-per-step", str(a.prompts),
            "--grpo-group-size", str(a.group_size), "--rl-use-sequence-packing",
            "--rl-max-new-tokens", str(a.max_new_tokens), "--rl-default-temperature", "1.0",
            "--rl-prompts-per-eval", "0", "--inference-backend", "megatron"]
    argv += C.optim_flags(a.micro_batch_size, rollouts, train_iters=a.iters)
    if a.bf16:
        argv.append("--bf16")
    if a.transformer_impl:
        argv += ["--transformer-impl", a.transformer_impl]
    return argv + list(a.extra)


def env_config(max_tokens: int) -> Path:
    """The arithmetic environment with its per-answer cap (16 tokens) raised to ``max_tokens``."""
    import tempfile

    path = Path(tempfile.mkdtemp(prefix="gpu_grpo_step_")) / "arithmetic.yaml"
    path.write_text("environments:\n  - type: arithmetic\n    weight: 1\n    args: {min_operands: 2, max_operands: 2,"
                    f" min_digits: 1, max_digits: 2, operators: '+-', max_tokens: {max_tokens}}}\n")
    return path


def run(a) -> dict:
    import torch

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    profiler = None
    if a.profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    measured = C.measured_rl_iterations(build_argv(a), a.iters)
    if profiler is not None:
        import pstats

        profiler.disable()
        with open(a.profile, "w") as f:
            pstats.Stats(profiler, stream=f).sort_stats("cumulative").print_stats(60)
    params = parameter_count(**QWEN25_05B)
    peak_gib = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")

    med = {k: C.median([h[k] for h in measured]) for k in
           ("time_total_s", "time_generate_s", "time_logprobs_s", "time_train_s", "generation_tokens_per_s",
            "train_tokens_per_s", "num_sequences", "response_length_mean")}
    gen_tokens = med["generation_tokens_per_s"] * med["time_generate_s"]
    train_tokens = med["train_tokens_per_s"] * med["time_train_s"]  # real (unpadded) tokens, all passes
    flops = 2 * params * gen_tokens + 6 * params * train_tokens
    if med["time_logprobs_s"] > 0:
        flops += 2 * params * train_tokens
    peak = a.peak_tflops * 1e12
    rows = [
        ["parameters", f"{params / 1e6:.1f} M"],
        ["rollouts x mean response tokens", f"{med['num_sequences']:.0f} x {med['response_length_mean']:.1f}"],
        ["iteration (median)", f"{med['time_total_s']:.3f} s"],
        ["  generate", f"{med['time_generate_s']:.3f} s ({med['generation_tokens_per_s']:,.0f} tok/s)"],
        ["  old log-probs", f"{med['time_logprobs_s']:.3f} s"],
        ["  train (fwd+bwd+opt)", f"{med['time_train_s']:.3f} s ({med['train_tokens_per_s']:,.0f} tok/s)"],
        ["iteration tokens/s (trained tokens)", f"{train_tokens / med['time_total_s']:,.0f}"],
        ["peak GPU memory allocated", f"{peak_gib:.2f} GiB"],
        ["MFU, train phase", f"{6 * params * train_tokens / med['time_train_s'] / peak:.1%}"],
        ["MFU, whole iteration", f"{flops / med['time_total_s'] / peak:.1%}"],
    ]
    title = (f"GRPO iteration, Qwen2.5-0.5B shape, {'bf16' if a.bf16 else 'fp32'}, "
             f"{a.transformer_impl or 'default'} layers, peak {a.peak_tflops:.0f} TFLOP/s")
    print(C.format_table(["metric", "value"], rows, title=title))
    return {"median": med, "params": params, "peak_gib": peak_gib}


def parameter_count(layers: int, hidden: int, heads: int, kv_groups: int, ffn: int, vocab: int) -> int:
    """Parameters of the shape above (tied embeddings, QKV bias, SwiGLU, RMSNorm): 494.0M for Qwen2.5-0.5B."""
    head_dim = hidden // heads
    qkv_out = hidden + 2 * kv_groups * head_dim
    per_layer = hidden * qkv_out + qkv_out + hidden * hidden + 3 * hidden * ffn + 2 * hidden
    return vocab * hidden + layers * per_layer + hidden


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--transformer-impl", choices=["local", "transformer_engine"], default=None)
    p.add_argument("--seq-length", type=int, default=320)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--iters", type=int, default=4, help="RL iterations (the first is a warm-up)")
    p.add_argument("--profile", default=None, help="write a cProfile summary (cumulative time) to this file")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100 SXM: 989)")
    p.add_argument("extra", nargs="*", help="more train_rl.py flags, after --")
    return p.parse_args(argv)


def main(argv=None) -> int:
    run(parse(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
