"""Quickstart: pretrain a tiny GPT on arithmetic, post-train it with GRPO, evaluate, plot the reward curve.

    python examples/rl/quickstart.py                 # CPU: a few minutes on 2 cores
    python examples/rl/quickstart.py --out runs/qs --rl-iters 40

1. writes a noisy arithmetic corpus ("Q: 3+5=? A: 8" with a share of wrong answers), so the pretrained
   policy is only partly right;
2. ``pretrain_gpt.py`` trains a small byte-level GPT on it and saves a checkpoint;
3. ``train_rl.py`` runs GRPO from that checkpoint on the arithmetic environment (the embedded default
   task), with the in-process megatron-core inference engine, evaluating held-out pass@1 as it goes;
4. ``tools/plot_metrics.py`` turns the metrics into ``reward_curve.png``.

Each stage is skipped when its output already exists, so an interrupted quickstart resumes (the RL
stage resumes from its own last checkpoint); a banner says so, and each phase's banner gives an estimate and
the time elapsed, its iteration lines the time left. With CUDA available the model is scaled up and every
visible GPU is used through torchrun.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

# Task: single-digit addition. 100 distinct problems: a tiny model memorises the format fast.
TASK = dict(min_operands=2, max_operands=2, min_digits=1, max_digits=1, operators="+")
NOISE = 0.3  # share of wrong answers in the pretraining corpus: the policy starts only partly right


def model_flags(gpu: bool) -> list[str]:
    if gpu:
        shape = ["--num-layers", "12", "--hidden-size", "768", "--num-attention-heads", "12"]
    else:
        shape = ["--num-layers", "4", "--hidden-size", "128", "--num-attention-heads", "4"]
    return shape + ["--seq-length", "64", "--max-position-embeddings", "128", "--swiglu",
                    "--normalization", "RMSNorm", "--position-embedding-type", "rope",
                    "--disable-bias-linear", "--tokenizer-type", "ByteLevelTokenizer", "--seed", "1"]


def rl_flags(pre_ckpt: Path, rl_ckpt: Path, env_config: Path, metrics: Path, tensorboard: Path, *, nproc: int,
             group_size: int = 8, lr: str = "5e-4", iters: int = 200, steps_per_iteration: int = 1) -> list[str]:
    """The GRPO stage's flags after the model's (shared with tools/async_quality.py, which runs this recipe
    synchronously and with asynchronous rollouts from one pretrained checkpoint). ``steps_per_iteration``: optimizer
    steps per iteration's rollouts (the global batch is divided by it; after the first, the steps train on
    rollouts of an older policy than the one they update).

    ``lr``: a constant 5e-4 (with --clip-grad 1.0) is high for GRPO, and right for this task only: 100 distinct
    single-digit sums whose answer format the pretrained model already writes, so 200 iterations of 16 prompts
    reach the gain in a few CPU minutes (the recipe's first version ran 2e-4 for 60 iterations). Other tasks from
    this model need less: see examples/rl/README.md, "Learning rate"."""
    n = max(nproc, 1)
    return ["--pretrained-checkpoint", str(pre_ckpt), "--load", str(rl_ckpt), "--save", str(rl_ckpt),
            "--save-interval", "10", "--save-retain-last", "2", "--save-retain-best", "eval/pass@1", "1",
            "--langrl-env-config", str(env_config),
            "--grpo-prompts-per-step", str(16 * n), "--grpo-group-size", str(group_size),
            "--micro-batch-size", "8", "--global-batch-size", str(16 * group_size * n // steps_per_iteration),
            "--rl-use-sequence-packing", "--rl-max-new-tokens", "8", "--rl-default-temperature", "1.0",
            "--lr", lr, "--lr-decay-style", "constant", "--clip-grad", "1.0",
            "--train-iters", str(iters), "--eval-interval", "10", "--rl-prompts-per-eval", "200",
            "--rl-eval-temperature", "1.0", "--log-interval", "1", "--rl-metrics-jsonl", str(metrics),
            "--tensorboard-dir", str(tensorboard)]


def write_env_config(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("environments:\n  - type: arithmetic\n    weight: 1\n    args: " + json.dumps(TASK) + "\n")
    return path


def launcher(nproc: int) -> list[str]:
    if nproc <= 1:
        return [sys.executable]
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}"]


# Console lines worth showing from a stage's output: iteration lines (whole: they start with the iteration
# number), evaluations, warnings about the run, and errors.
_SHOW = (" iteration ", "evaluation", "possible training problem", "error", "cpu threads:")
_ERROR = re.compile(r"(\S+\.py: error: .*|\b[A-Za-z]*Error: .*)")


def console_line(line: str) -> str | None:
    """The line to echo to the console for one line of a stage's output (None: only in the log file)."""
    text = line.rstrip()
    return text if any(key in text.lower() for key in _SHOW) else None


def first_error(lines: list[str]) -> str | None:
    """The first error message in a stage's output: the one-line report of bad input, else the last line of
    a Python traceback; torchrun's own failure report (ChildFailedError) is skipped."""
    found = [m.group(1) for line in lines for m in [_ERROR.search(line)] if m and "ChildFailedError" not in line]
    reported = [f for f in found if ": error: " in f]
    return (reported or found or [None])[0]


def thread_changes(points: list[tuple[int, float]]) -> str | None:
    """A line when torch's CPU thread count changed during the RL run (``cpu_threads`` per iteration): another
    process kept cores busy, and reductions over another number of threads add in another order."""
    from tools.compare_runs import changes

    path = changes([int(v) for _, v in sorted(points)])
    if len(path) < 2:
        return None
    return (f"CPU threads changed during RL ({' -> '.join(map(str, path))}): other processes kept cores busy, so "
            f"this run's figures are not bitwise those of a run on an idle machine (--cpu-threads N fixes the count)")


def clock(seconds: float) -> str:
    """``m:ss`` (``h:mm:ss`` from an hour on)."""
    m, s = divmod(int(round(seconds)), 60)
    return f"{m // 60}:{m % 60:02d}:{s:02d}" if m >= 60 else f"{m}:{s:02d}"


class Phases:
    """Phase banners: ``[i/n] name``, what it does, an estimate, the time elapsed since the start; a line when a
    phase is skipped because its output exists, and its duration when it ends."""

    def __init__(self, total: int, start: float | None = None):
        self.total, self.index = total, 0
        self.start = time.time() if start is None else start
        self.name, self.phase_start = "", self.start

    def _head(self, name: str) -> str:
        self.index += 1
        self.name = name
        return f"[{self.index}/{self.total}] {name}"

    def begin(self, name: str, what: str, estimate: str) -> None:
        self.phase_start = time.time()
        print(f"\n=== {self._head(name)}: {what}; {estimate} ({clock(self.phase_start - self.start)} elapsed) ===",
              flush=True)

    def skip(self, name: str, why: str) -> None:
        print(f"\n=== {self._head(name)}: skipped, {why} ===", flush=True)

    def end(self) -> None:
        now = time.time()
        print(f"    {self.name} done in {clock(now - self.phase_start)} ({clock(now - self.start)} elapsed)", flush=True)


_ITERATION = re.compile(r" iteration\s+(\d+)/\s*(\d+)")


class Eta:
    """Time left in a stage from its iteration lines: the rate since the first iteration line it saw (a resumed
    stage starts counting where it resumed)."""

    def __init__(self):
        self.first: tuple[float, int] | None = None

    def prefix(self, line: str, now: float | None = None) -> str:
        """``"[12/200, ~1:05 left] "`` for an iteration line once a rate is known, ``""`` otherwise."""
        m = _ITERATION.search(line)
        if m is None:
            return ""
        now = time.time() if now is None else now
        done, total = int(m.group(1)), int(m.group(2))
        if self.first is None or done <= self.first[1]:
            self.first = self.first or (now, done)
            return f"[{done}/{total}] "
        rate = (now - self.first[0]) / (done - self.first[1])
        return f"[{done}/{total}, ~{clock(rate * (total - done))} left] "


def run(cmd: list[str], log_path: Path) -> None:
    """Run a stage, teeing its output to a log file; on failure, name the error before the log's path."""
    print("$", " ".join(cmd), flush=True)
    print(f"    (full output: {log_path}; iteration lines, evaluations and warnings below)", flush=True)
    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    lines, eta = [], Eta()
    with log_path.open("w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for line in proc.stdout:
            log.write(line)
            lines.append(line)
            shown = console_line(line)
            if shown is not None:
                print("   ", eta.prefix(shown) + shown, flush=True)
        if proc.wait() != 0:
            error = first_error(lines)
            raise SystemExit(f"stage failed (exit {proc.returncode})" + (f": {error}" if error else "")
                             + f"\nfull log: {log_path}")


def final_pass_at_1(evals: list[tuple[int, float]]) -> float:
    """Mean of the last three evaluations: one evaluation of 200 sampled answers is noisy (about +-0.03)."""
    tail = [v for _, v in sorted(evals)[-3:]]
    return sum(tail) / len(tail)


def has_checkpoint(path: Path) -> bool:
    return (path / "latest_checkpointed_iteration.txt").exists()


def saved_iteration(path: Path) -> str | None:
    """The iteration of the latest checkpoint under ``path`` ("release" for converted ones), None without one."""
    tracker = path / "latest_checkpointed_iteration.txt"
    return tracker.read_text().strip() if tracker.exists() else None


# Rough durations of the CPU stages on an idle 2-core machine (docs/benchmarks.md has measured runs); a busy or
# slower machine takes longer, and the iteration lines then say how long is left.
_CPU_ESTIMATE = {"pretrain": 0.17, "rl": 0.35}  # seconds per iteration (RL: with its evaluations)


def _estimate(stage: str, iters: int, gpu: bool) -> str:
    if gpu:
        return "time left shown once iterations run"
    low = _CPU_ESTIMATE[stage] * iters
    return f"about {clock(low)}-{clock(3 * low)} on 2 idle CPU cores"


def pretrain(out: Path, *, nproc: int, gpu: bool, iters: int = 600, noise: float = NOISE,
             phases: Phases | None = None) -> Path:
    """Stages 1-2: the noisy corpus and the pretrained checkpoint under ``out`` (each skipped when present)."""
    phases = phases or Phases(2)
    corpus, pre_ckpt = out / "data" / "arithmetic.jsonl", out / "pretrain"
    if corpus.exists():
        phases.skip("corpus", f"{corpus} exists")
    else:
        phases.begin("corpus", "4000 arithmetic documents with a share of wrong answers", "a few seconds")
        from megatron.rl.environments.arithmetic import write_pretraining_corpus

        write_pretraining_corpus(corpus, num_documents=4000, examples_per_document=16, noise=noise, seed=7, **TASK)
        print(f"    wrote {corpus}")
        phases.end()
    if has_checkpoint(pre_ckpt):
        phases.skip("pretraining", f"reusing the pretrained checkpoint {pre_ckpt} (iteration "
                                   f"{saved_iteration(pre_ckpt)}; delete the directory to pretrain again)")
        return pre_ckpt
    phases.begin("pretraining", f"{iters} iterations of a small byte-level GPT on the corpus",
                 _estimate("pretrain", iters, gpu))
    run(launcher(nproc) + [str(REPO / "pretrain_gpt.py"), *model_flags(gpu),
         "--micro-batch-size", "32", "--global-batch-size", str(32 * max(nproc, 1)),
         "--train-iters", str(iters), "--lr", "3e-3", "--min-lr", "3e-4",
         "--lr-decay-style", "cosine", "--lr-warmup-iters", str(min(20, iters // 5)), "--weight-decay", "0.01",
         "--clip-grad", "1.0", "--data-path", str(corpus), "--split", "98,2,0", "--log-interval", "25",
         "--save", str(pre_ckpt)], out / "logs" / "pretrain.log")
    phases.end()
    return pre_ckpt


def main(argv=None) -> int:
    start = time.time()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "runs" / "quickstart",
                   help="directory of every output (corpus, checkpoints, logs, metrics, plot); a stage whose output "
                        "is there is skipped, an interrupted RL stage resumes")
    p.add_argument("--pretrain-iters", type=int, default=600, help="pretraining iterations")
    p.add_argument("--rl-iters", type=int, default=200, help="GRPO iterations")
    p.add_argument("--rl-lr", default="5e-4",
                   help="GRPO learning rate (constant). 5e-4 is tuned to this task, 100 distinct sums whose answer "
                        "format the pretrained model already writes, so that 200 iterations reach the gain in "
                        "minutes; for other tasks from this model start at 2e-4 (examples/rl/README.md, 'Learning "
                        "rate')")
    p.add_argument("--group-size", type=int, default=8, help="rollouts per prompt")
    p.add_argument("--noise", type=float, default=NOISE, help="share of wrong answers in the pretraining corpus")
    p.add_argument("--nproc", type=int, default=0, help="processes; 0: one per GPU, or 1 on CPU")
    p.add_argument("--policy-loss", default="ppo_clip", choices=("ppo_clip", "gspo", "cispo"),
                   help="GRPO's policy loss (--grpo-policy-loss), with its published clip range")
    p.add_argument("--steps-per-iteration", type=int, default=1, choices=(1, 2, 4, 8),
                   help="optimizer steps per iteration's rollouts (1: every step on-policy)")
    args = p.parse_args(argv)
    print(f"megatron-rl quickstart: corpus -> pretraining -> GRPO -> plot, in {args.out} (loading torch...)",
          flush=True)
    import torch

    from megatron.rl.runtime.machine import machine_type

    # what the model learns moves with the CPU's float kernels: figures are compared per machine type
    print(f"machine: {machine_type()}", flush=True)
    gpu = torch.cuda.is_available()
    nproc = args.nproc or (torch.cuda.device_count() if gpu else 1)
    out = args.out.resolve()
    rl_ckpt, metrics = out / "rl", out / "metrics.jsonl"
    phases = Phases(4, start)

    pre_ckpt = pretrain(out, nproc=nproc, gpu=gpu, iters=args.pretrain_iters, noise=args.noise, phases=phases)
    env_config = write_env_config(out / "arithmetic.yaml")
    resumed = saved_iteration(rl_ckpt)
    if resumed is not None and resumed.isdigit() and int(resumed) >= args.rl_iters:
        phases.skip("GRPO", f"{rl_ckpt} already holds iteration {resumed} of {args.rl_iters} (delete it to run RL "
                            f"again)")
    else:
        where = f"resuming from {rl_ckpt} at iteration {resumed}" if resumed else f"from {pre_ckpt}"
        phases.begin("GRPO", f"{args.rl_iters} iterations on the arithmetic environment, {where}, evaluating "
                             f"held-out pass@1 every 10", _estimate("rl", args.rl_iters - int(resumed or 0), gpu))
        run(launcher(nproc) + [str(REPO / "train_rl.py"), *model_flags(gpu),
             *rl_flags(pre_ckpt, rl_ckpt, env_config, metrics, out / "tensorboard", nproc=nproc,
                       group_size=args.group_size, lr=args.rl_lr, iters=args.rl_iters,
                       steps_per_iteration=args.steps_per_iteration),
             "--grpo-policy-loss", args.policy_loss], out / "logs" / "train_rl.log")
        phases.end()

    phases.begin("plot", "the reward and pass@1 curves", "seconds")
    from tools.plot_metrics import load_series, plot, run_info, run_title

    series = load_series(metrics)
    png = plot(series, ["eval/pass@1", "reward_mean", "rl_loss", "response_length_mean"], out / "reward_curve.png",
               title=run_title(*run_info(metrics), "GRPO on arithmetic (quickstart)"), smooth=0.9)
    phases.end()
    evals = sorted(series.get("eval/pass@1", []))
    if evals:
        first, final = evals[0][1], final_pass_at_1(evals)
        print(f"held-out pass@1 (sampled at T=1, 200 prompts): {first:.3f} at iteration {evals[0][0]} -> {final:.3f} "
              f"(mean of the last {min(3, len(evals))} evaluations, up to iteration {evals[-1][0]}); "
              f"change {final - first:+.3f}; on {machine_type()}")
    changed = thread_changes(series.get("cpu_threads", []))
    if changed:
        print(changed)
    print(f"reward curve: {png}; metrics: {metrics}; total {clock(time.time() - start)}")
    print(f"sample completions: python tools/show_samples.py {metrics} --last 1")
    return 0


if __name__ == "__main__":
    sys.exit(main())
