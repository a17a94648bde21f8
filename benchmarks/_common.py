"""Shared pieces of the training benchmarks: model flags, building model + optimizer, tables, timing.

Every benchmark builds its model through the same path as ``train_rl.py`` (``parse_args`` ->
``initialize_megatron`` -> ``build_model`` -> ``build_optimizer``), so what is measured is what the trainer
runs: megatron-core ``GPTModel`` with the local layer spec (on CPU) inside Megatron DDP, and
megatron-core's optimizer.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ARITHMETIC_ENV = REPO / "examples" / "rl" / "environment_configs" / "arithmetic.yaml"


def child_env(threads: int | str) -> dict[str, str]:
    """The environment of a benchmark's subprocess: ``threads`` OpenMP threads (``"auto"``: no OMP_NUM_THREADS,
    the process chooses), this checkout first on the path and the caller's ``PYTHONPATH`` kept after it (a GPU
    machine may bring megatron-core through it)."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    if threads != "auto":
        env["OMP_NUM_THREADS"] = str(threads)
    return {**env, "PYTHONPATH": path}


def model_flags(hidden: int, layers: int, heads: int, seq_length: int) -> list[str]:
    """Megatron flags of the quickstart's model family (RoPE, RMSNorm, SwiGLU, no biases, byte tokenizer),
    without dropout (RL recipes disable it; it would only add noise to timings)."""
    return ["--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
            "--seq-length", str(seq_length), "--max-position-embeddings", str(seq_length), "--swiglu",
            "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--hidden-dropout", "0.0", "--attention-dropout", "0.0",
            "--tokenizer-type", "ByteLevelTokenizer", "--seed", "1", "--log-level", "WARNING"]


def optim_flags(micro_batch_size: int, global_batch_size: int, train_iters: int = 1000) -> list[str]:
    return ["--micro-batch-size", str(micro_batch_size), "--global-batch-size", str(global_batch_size),
            "--train-iters", str(train_iters), "--lr", "1e-5", "--lr-decay-style", "constant", "--clip-grad", "1.0"]


@dataclasses.dataclass
class Trainer:
    """What the benchmarks drive: the parsed config, the DDP model chunks, optimizer, scheduler, device, tokenizer."""

    cfg: object
    model: list
    optimizer: object
    scheduler: object
    device: object
    tokenizer: object


def quiet() -> None:
    """Benchmarks print tables; megatron-core's one-time warnings (no Apex, deprecated defaults) are noise."""
    import logging
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    logging.getLogger().setLevel(logging.WARNING)


def build_trainer(argv: list[str], extra_args_providers=()) -> Trainer:
    """Initialise megatron (one process) and build the model and optimizer exactly as the trainer does."""
    quiet()
    from megatron.rl.training.config import parse_args
    from megatron.rl.training.initialize import initialize_megatron
    from megatron.rl.training.model_provider import build_model
    from megatron.rl.training.optimizer import build_optimizer
    from megatron.rl.training.tokenizer import build_tokenizer

    cfg = parse_args(argv, extra_args_providers=list(extra_args_providers), world_size=1)
    runtime = initialize_megatron(cfg)
    tokenizer = build_tokenizer(cfg.tokenizer.tokenizer_type, cfg.tokenizer.tokenizer_model)
    model = build_model(cfg, tokenizer=tokenizer)
    optimizer, scheduler = build_optimizer(cfg, model)
    return Trainer(cfg, model, optimizer, scheduler, runtime.device, tokenizer)


@contextlib.contextmanager
def without_device_mode():
    """This thread without torch-function modes while a peer's code runs in the process (HF ``generate``).

    :func:`build_trainer` enters the CPU layer's device-rewriting mode on the calling thread, and a mode makes every
    torch call of that thread a Python call first. The engine's own steps run on a thread without it; a peer
    measured on the benchmark's main thread must run without it too, or its figures carry our layer's cost."""
    from torch.overrides import _get_current_function_mode_stack, _pop_mode_temporarily

    with contextlib.ExitStack() as stack:
        for _ in range(len(_get_current_function_mode_stack())):
            stack.enter_context(_pop_mode_temporarily())
        yield


def teardown() -> None:
    from megatron.rl.training.initialize import destroy_megatron

    destroy_megatron()


def measured_rl_iterations(argv: list[str], iters: int) -> list[dict]:
    """Run ``train_rl.py``'s driver in this process on ``argv``; the metrics of the iterations after the first
    (a warm-up: engine and allocator first-call costs) that updated the policy."""
    from megatron.rl.rl_config import add_rl_args, rl_config_from_args
    from megatron.rl.rl_loop import run_rl
    from megatron.rl.training.config import parse_args

    if iters < 2:
        raise SystemExit(f"--iters={iters}: need >= 2 (the first iteration is a warm-up, left out)")
    quiet()
    cfg = parse_args(argv, extra_args_providers=[add_rl_args], world_size=1)
    rl = rl_config_from_args(cfg)
    try:
        result = run_rl(cfg, rl)
    finally:
        teardown()
    measured = [h for h in result.history[1:] if not h.get("skipped_update")]
    if not measured:
        raise SystemExit("every measured iteration skipped its update; nothing to report")
    return measured


def matmul_params(model_chunks: list, vocab_size: int, hidden: int) -> int:
    """Parameters that take part in a matmul per token: every 2-D weight of the decoder layers plus the
    output projection (``vocab x hidden``, counted once whether tied to the embedding or not). The input
    embedding is a lookup, not a matmul, so it is excluded (Kaplan et al.'s non-embedding count + head)."""
    from megatron.rl.training.model_provider import unwrap_model

    n = 0
    for gpt in unwrap_model(model_chunks):
        n += sum(p.numel() for name, p in gpt.named_parameters() if "decoder." in name and p.dim() == 2)
    return n + vocab_size * hidden


def training_flops(n_matmul_params: int, tokens: int, layers: int, seq_length: int, hidden: int) -> float:
    """FLOPs of forward + backward over ``tokens`` positions (all rows, padding included), the standard formula:

    ``6 * N * tokens`` (2 FLOPs per multiply-add, forward 1x + backward 2x) plus attention's two
    S x S products per layer, ``QK^T`` and ``AV``: forward ``4 * S * h`` per token per layer, so
    ``12 * L * S * h * tokens`` with backward (no causal discount: the local spec computes the full
    ``S x S`` scores and masks them; Megatron-LM's MFU formula counts it the same way).
    """
    return 6.0 * n_matmul_params * tokens + 12.0 * layers * seq_length * hidden * tokens


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def timed_wall_cpu(fn: Callable[[], object]) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process, all threads). CPU time is steadier than wall time on a
    shared machine: time the process spends descheduled by other jobs is not counted."""
    w0, c0 = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - w0, time.process_time() - c0


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], title: str | None = None) -> str:
    """A GitHub-markdown table (readable in a terminal and pasteable into docs)."""
    def cell(x):
        if isinstance(x, float):
            return f"{x:.3g}" if abs(x) < 1e4 else f"{x:,.0f}"
        return str(x)

    cells = [[cell(x) for x in r] for r in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    lines = [] if title is None else [f"\n{title}\n"]
    lines.append("| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths)) + " |")
    lines.append("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    lines += ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in cells]
    return "\n".join(lines)


def machine_line() -> str:
    """Where the numbers come from: CPU model, cores, torch threads, load average."""
    import platform

    import torch

    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    load = " ".join(f"{x:.2f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return (f"machine: {cpu}; {os.cpu_count()} logical CPUs; torch {torch.__version__} with "
            f"{torch.get_num_threads()} threads; device {dev}; load average (1/5/15 min) {load}")
