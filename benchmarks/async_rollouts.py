"""Asynchronous rollouts on a long-tail length distribution: synchronous vs lag 1 vs lag 1 + partial rollouts.

```
python benchmarks/async_rollouts.py                 # 9 iterations per setting, 16 prompts, tiny model, CPU
python benchmarks/async_rollouts.py --rounds 3      # interleaved three times, the fastest round of each kept
python benchmarks/async_rollouts.py --alpha 1.0     # the lighter tail of the first version (4-128 tokens)
```

Workload (:class:`LongTailAgent`): every prompt asks for an answer whose length budget follows a Pareto
distribution (tail index ``--alpha``, default 0.8, from 4 tokens, capped at 256), stratified so that each
iteration's batch holds the same lengths: with 16 prompts, 4 4 4 5 6 6 7 8 10 12 15 19 26 40 77 256 tokens
(answers of 4-256 tokens, median 9). Alpha 1 would give 16 quantiles that stop at 128 tokens (4 ... 42 128): a
lighter tail than the one this benchmark is for. A random-weight policy almost never emits EOS, so a
rollout is as long as its budget; the reward is a hash of the answer (it varies, so every iteration trains).

Each setting runs ``train_rl.py`` with the same seed and model, one after the other in one invocation, so the
ratios are side by side. Reported per setting (iterations 2..N; the first has nothing generated ahead):
iteration time, the process's CPU seconds per iteration (every thread; with one OpenMP thread the engine and the
trainer take turns, so on a quiet machine it is the iteration time, and another job on the machine inflates it
far less), trained generated tokens per second of iteration time, mean engine batch occupancy (requests per
engine step, from the engine's counters), the CPU seconds of the whole run, token staleness and the reward.
Timings on a shared machine are noisy: compare the ratios of one run (``--rounds`` interleaves the settings and
keeps the fastest round of each).

Keep the number of measured iterations (``--iters`` - 1) even: with lag 1 and partial rollouts the iterations
alternate between one that waits for the 256-token answer of the batch before (~250 engine steps) and one whose
groups are already done (~10 steps); an odd count holds one more long iteration than short ones (7 measured
iterations, the first version's default, understated the speedup by ~10%).

Where the gain comes from: with partial rollouts an iteration waits for its first ``P`` groups, not its slowest,
and the long answers carry over, so two iterations share one wait for the longest answer (about half the engine
steps of the synchronous loop) and the engine's batch stays fuller (higher occupancy). Only the fixed part of a
step's cost shrinks with fewer steps: on this tiny CPU model ~7-8 ms of a step is per-step work (module dispatch of
the forward, the engine's bookkeeping, sampling), and the per-request work (MLP rows, attention over the cached
tokens) is the same tokens in either schedule. The recompute of the old log-probs (decoupled PPO) costs each
asynchronous iteration one scoring pass. See the README for the measured tables and what limits the speedup here.
"""
from __future__ import annotations

import argparse
import json
import logging
import resource
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import _common as C  # noqa: E402
from megatron.rl.agent import RewardOnlyAgent  # noqa: E402

log = logging.getLogger(__name__)

SETTINGS = {
    "synchronous": [],
    "lag 1": ["--rl-generation-lag", "1", "--rl-submission-granularity", "G", "--rl-consumption-granularity", "G"],
    "lag 1 + partial": ["--rl-generation-lag", "1", "--rl-partial-rollouts", "--rl-submission-granularity", "G",
                        "--rl-consumption-granularity", "G"],
}


def answer_budget(index: int, batch: int = 16, alpha: float = 0.8, low: int = 4, cap: int = 256) -> int:
    """Answer length budget of prompt ``index``: Pareto(alpha) quantiles from ``low`` tokens, capped, stratified so
    that every run of ``batch`` consecutive prompts (one iteration's batch) has the same lengths in a different
    order; the settings then face the same work per iteration whichever batch an iteration trains on."""
    j = (index * 7 + index // batch) % batch  # a different order in every batch (7 is coprime with 2^k)
    u = (j + 0.5) / batch
    return min(cap, int(low / u ** (1 / alpha)))


class LongTailAgent(RewardOnlyAgent):
    """Prompts whose answers need between 4 and 256 tokens (see the module docstring)."""

    stop: list[str] = []
    batch: int = 16  # prompts per iteration (--grpo-prompts-per-step)
    alpha: float = 0.8  # Pareto tail index of the answer budgets (smaller: heavier tail)

    def get_problem(self, index: int, validation: bool) -> dict:
        return {"prompt": f"Q{index % 97}:", "id": f"t{index}",
                "budget": answer_budget(index, self.batch, self.alpha)}

    def compute_reward(self, problem: dict, completion: str) -> float:
        return (sum(completion.encode("utf-8", "replace")) % 11) / 10.0

    async def _single_turn_group(self, iface, problem, pid, prompt, ga, group_size, seed):
        ga = ga.model_copy(update={"max_tokens": min(ga.max_tokens, problem["budget"])})
        return await super()._single_turn_group(iface, problem, pid, prompt, ga, group_size, seed)


def run_setting(name: str, extra: list[str], args, tmp: Path) -> list[dict]:
    env = tmp / "env.yaml"
    env.write_text('environments: [{type: "benchmarks.async_rollouts:LongTailAgent", weight: 1, '
                   f'args: {{batch: {args.prompts}, alpha: {args.alpha}}}}}]\n')
    out = tmp / f"{name.replace(' ', '_').replace('+', 'p')}.jsonl"
    seq = 320
    cmd = [sys.executable, str(REPO / "train_rl.py"), "--num-layers", str(args.layers), "--hidden-size",
           str(args.hidden), "--num-attention-heads", str(args.heads), "--seq-length", str(seq),
           "--max-position-embeddings", str(seq), "--micro-batch-size", "8",
           "--global-batch-size", str(args.prompts * args.group_size),
           "--train-iters", str(args.iters), "--lr", "1e-4", "--lr-decay-style", "constant", "--seed", "3",
           "--grpo-prompts-per-step", str(args.prompts), "--grpo-group-size", str(args.group_size),
           "--rl-max-new-tokens", "256", "--rl-use-sequence-packing", "--langrl-allow-imports",
           "--langrl-env-config", str(env), "--rl-prompts-per-eval", "0", "--log-interval", "1",
           "--rl-metrics-jsonl", str(out), "--log-level", "WARNING", *args.extra, *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=C.child_env(args.threads))
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"{name} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    records = [r for r in map(json.loads, out.read_text().splitlines()) if "reward_mean" in r]
    # CPU seconds of the whole run (start-up included, the same for every setting): steadier than wall time on a
    # shared machine, where another job can take the cores away from one setting and not the next
    records[-1]["_cpu_s"] = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return records


def summarize(records: list[dict], rollouts: int) -> dict[str, float]:
    rs = records[1:] or records
    t = sum(r["time_total_s"] for r in rs)

    def tokens(rows):
        return sum(r["response_length_mean"] * (rollouts - r.get("failed_rollouts", 0)) for r in rows)

    # Requests per engine step over the whole run: trained generated tokens / engine steps (tokens generated
    # ahead and never trained count as steps only, so the asynchronous settings are underestimated slightly).
    steps = records[-1].get("engine_steps_total", float("nan"))
    cpu = [r.get("time_cpu_s", float("nan")) for r in rs]
    return {"iter_s": t / len(rs), "iter_cpu_s": sum(cpu) / len(cpu), "tok_s": tokens(rs) / t,
            "occupancy": tokens(records) / steps,
            "cpu_s": records[-1]["_cpu_s"],
            "stale_mean": statistics.fmean(r.get("staleness_mean", 0.0) for r in rs),
            "stale_max": max(r.get("staleness_max", 0.0) for r in rs),
            "reward": statistics.fmean(r["reward_mean"] for r in rs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=9, help="iterations per setting; iterations 2..N are measured "
                   "(keep N - 1 even, see the module docstring)")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.8,
                   help="Pareto tail index of the answer budgets (0.8: 4-256 tokens per batch; 1.0: 4-128)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1, help="interleaved repetitions; the fastest of each is kept")
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("extra", nargs=argparse.REMAINDER,
                   help="after --: more train_rl.py flags for every setting (e.g. -- --bf16)")
    args = p.parse_args(argv)
    args.extra = [a for a in args.extra if a != "--"]
    if (args.iters - 1) % 2:
        log.warning("--iters %d measures an odd number of iterations: lag 1 + partial rollouts alternates long and "
                    "short iterations, so its mean is off by half an iteration's difference", args.iters)
    runs: dict[str, list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.rounds):  # settings interleaved, the fastest round of each kept (shared machines)
            for name in args.settings:
                runs.setdefault(name, []).append(
                    summarize(run_setting(name, SETTINGS[name], args, Path(tmp)), args.prompts * args.group_size))
    rows = {name: {**min(rs, key=lambda r: r["iter_s"]), "iter_cpu_s": min(r["iter_cpu_s"] for r in rs)}
            for name, rs in runs.items()}
    base = rows.get("synchronous")
    budgets = [answer_budget(i, args.prompts, args.alpha) for i in range(args.prompts)]
    print(f"\nlong-tail answers ({min(budgets)}-{max(budgets)} tokens, alpha {args.alpha}), {args.prompts} prompts x "
          f"{args.group_size} rollouts, hidden {args.hidden}, {args.layers} layers, iterations 2..{args.iters}\n")
    print("| setting | iteration s | speedup | iteration CPU s | CPU speedup | trained gen tok/s | "
          "engine batch occupancy | run CPU s | staleness mean | staleness max | reward |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        speedup = base["iter_s"] / r["iter_s"] if base else float("nan")
        cpu_speedup = base["iter_cpu_s"] / r["iter_cpu_s"] if base else float("nan")
        print(f"| {name} | {r['iter_s']:.2f} | {speedup:.2f}x | {r['iter_cpu_s']:.2f} | {cpu_speedup:.2f}x | "
              f"{r['tok_s']:.0f} | {r['occupancy']:.1f} | {r['cpu_s']:.0f} | {r['stale_mean']:.2f} | "
              f"{r['stale_max']:.0f} | {r['reward']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
