"""Cost of the CPU runtime layer's device-rewriting torch-function mode on a training step.

Builds a small GPT with the whole CPU layer installed, then times the model's forward + backward
(through Megatron DDP) with the CudaToCpuMode active and with it suspended, interleaved in rounds so
machine noise hits both alike. That is the part of a step where both work: megatron's schedules and
optimizer allocate with device="cuda" themselves, so the full training step (also reported, mode
active) cannot run without the mode.

    python benchmarks/runtime_overhead.py [--hidden 256 --layers 4 --seq 128 --batch 8 --rounds 5]
"""
import argparse
import statistics
import time

import torch


def build(args):
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_config import TransformerConfig

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29591", rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(0)
    cfg = TransformerConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.hidden // 32,
                            use_cpu_initialization=True, hidden_dropout=0.0, attention_dropout=0.0,
                            normalization="RMSNorm", gated_linear_unit=True, bias_activation_fusion=False,
                            bias_dropout_fusion=False, apply_rope_fusion=False, masked_softmax_fusion=False,
                            gradient_accumulation_fusion=False)
    cfg.finalize_model_grads_func = finalize_model_grads
    model = GPTModel(config=cfg, transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
                     vocab_size=512, max_sequence_length=args.seq, position_embedding_type="rope")
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-4, clip_grad=1.0), [ddp])
    return ddp, opt, sum(p.numel() for p in model.parameters())


def make_fwd_bwd(ddp, args):
    data = torch.randint(0, 512, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.seq)[None].expand(args.batch, -1)
    # An explicit causal mask (True = masked): with None, megatron builds one with device="cuda".
    mask = torch.triu(torch.ones(args.seq, args.seq, dtype=torch.bool), diagonal=1)[None, None]

    def fwd_bwd():
        ddp.zero_grad_buffer()
        ddp(data[:, :-1], pos, mask, labels=data[:, 1:]).float().mean().backward()

    return fwd_bwd


def make_step(ddp, opt, args):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    data = torch.randint(0, 512, (args.batch, args.seq + 1), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(args.seq)[None].expand(args.batch, -1)
    fb = get_forward_backward_func()

    def fwd(it, model):
        b = next(it)
        out = model(b[:, :-1], pos, None, labels=b[:, 1:])
        return out, lambda o: (o.float().mean(), {})

    def step():
        ddp.zero_grad_buffer()
        opt.zero_grad()
        fb(forward_step_func=fwd, data_iterator=iter([data]), model=ddp, num_microbatches=1,
           seq_length=args.seq, micro_batch_size=args.batch, forward_only=False)
        opt.step()

    return step


def time_steps(step, n):
    """(wall seconds, process CPU seconds) per call. CPU time is what to compare on a busy machine:
    other processes inflate wall time but not this process's CPU time."""
    w, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        step()
    return (time.perf_counter() - w) / n, (time.process_time() - c) / n


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps per timing")
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()

    from torch.overrides import _pop_mode_temporarily

    from megatron.rl.runtime import setup_runtime
    from megatron.rl.runtime.cpu_patches import cpu_mode_active

    setup_runtime()
    ddp, opt, nparams = build(args)
    step, fwd_bwd = make_step(ddp, opt, args), make_fwd_bwd(ddp, args)
    step()  # warm-up
    with_mode, without_mode, full = [], [], []
    for _ in range(args.rounds):
        assert cpu_mode_active()
        with_mode.append(time_steps(fwd_bwd, args.steps))
        with _pop_mode_temporarily():
            assert not cpu_mode_active()
            without_mode.append(time_steps(fwd_bwd, args.steps))
        full.append(time_steps(step, args.steps))
    a, b = (statistics.median(x[0] for x in v) for v in (with_mode, without_mode))
    ac, bc = (statistics.median(x[1] for x in v) for v in (with_mode, without_mode))
    print(f"model: {nparams / 1e6:.2f}M params, {args.layers} layers, hidden {args.hidden}, "
          f"batch {args.batch} x seq {args.seq}, torch threads {torch.get_num_threads()}")
    print(f"| {'configuration':<28} | {'wall ms':>9} | {'CPU ms':>9} |")
    print(f"|{'-' * 30}|{'-' * 11}|{'-' * 11}|")
    print(f"| {'fwd+bwd, mode active':<28} | {a * 1e3:9.1f} | {ac * 1e3:9.1f} |")
    print(f"| {'fwd+bwd, mode suspended':<28} | {b * 1e3:9.1f} | {bc * 1e3:9.1f} |")
    fw, fc = (statistics.median(x[i] for x in full) for i in (0, 1))
    print(f"| {'full step (schedule+optim)':<28} | {fw * 1e3:9.1f} | {fc * 1e3:9.1f} |")
    print(f"overhead of the device-rewriting mode: wall {100 * (a / b - 1):+.1f}%, CPU {100 * (ac / bc - 1):+.1f}% "
          f"(CPU ratio {ac / bc:.3f})")


if __name__ == "__main__":
    main()
