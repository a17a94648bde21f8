"""Quality of asynchronous rollouts: the quickstart's GRPO recipe run synchronously and with a generation lag,
from one pretrained checkpoint, with held-out pass@1 side by side (the quality bar: lag 1 + partial
rollouts within 0.05 of the synchronous run at the same iteration).

    python tools/async_quality.py --out runs/async_quality                      # pretrains once, then the runs
    python tools/async_quality.py --out runs/aq --pretrained runs/quickstart/pretrain --seeds 1 2 --rl-iters 60

Every variant starts from the same pretrained checkpoint (pretrained here with the quickstart's recipe when
``--pretrained`` is not given; reused by later calls) and differs from the quickstart's RL command only in its
extra flags and ``--seed``. Runs that already finished (their metrics hold ``--rl-iters`` iterations) are not
run again, so an interrupted comparison resumes. One evaluation of 200 answers sampled at T=1 is about +-0.035:
use several seeds before reading a difference of a few hundredths.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "examples" / "rl"))

log = logging.getLogger("async_quality")

ASYNC = ["--rl-generation-lag", "1", "--rl-partial-rollouts"]
# name -> extra train_rl.py flags. "lag1_partial_GG" is the README's recommended setting; "lag1_partial_BB"
# consumes whole batches in submission order (no bias toward groups that finish first).
VARIANTS: dict[str, list[str]] = {
    "sync": [],
    "lag1_partial_GG": ASYNC + ["--rl-submission-granularity", "G", "--rl-consumption-granularity", "G"],
    "lag1_partial_BB": ASYNC + ["--rl-submission-granularity", "B", "--rl-consumption-granularity", "B"],
    "lag1_BB": ["--rl-generation-lag", "1"],
}
# Per-iteration metrics averaged over a run (staleness and IS statistics exist only for asynchronous runs).
SUMMARY = ("reward_mean", "staleness_mean", "off_policy_token_share", "is_truncated_fraction", "time_total_s")


def with_seed(flags: list[str], seed: int) -> list[str]:
    """``flags`` with ``--seed`` set to ``seed`` (replaced where present, else appended)."""
    out = list(flags)
    if "--seed" in out:
        out[out.index("--seed") + 1] = str(seed)
        return out
    return out + ["--seed", str(seed)]


def read_metrics(path: Path) -> tuple[dict[int, float], dict[int, dict]]:
    """(held-out pass@1 by iteration, training metrics by iteration) from a run's metrics JSONL."""
    evals: dict[int, float] = {}
    train: dict[int, dict] = {}
    if not path.exists():
        return evals, train
    for line in path.read_text().splitlines():
        row = json.loads(line)
        if "iteration" not in row:
            continue
        if "eval/pass@1" in row:
            evals[int(row["iteration"])] = float(row["eval/pass@1"])
        if "reward_mean" in row:
            train[int(row["iteration"])] = row
    return evals, train


def curve_table(curves: dict[str, dict[int, float]], baseline: str = "sync") -> list[str]:
    """Lines of a side-by-side table: one row per evaluated iteration, one column per curve, then each
    curve's difference to ``baseline`` at that iteration; last row: the mean of the last three evaluations."""
    names = list(curves)
    its = sorted(set().union(*(c.keys() for c in curves.values())))
    others = [n for n in names if n != baseline and baseline in curves]
    head = ["iter"] + names + [f"{n}-{baseline}" for n in others]
    widths = [max(len(h), 6) + 2 for h in head]
    lines = ["".join(h.rjust(w) for h, w in zip(head, widths))]

    def fmt(v):
        return "-" if v is None else f"{v:.3f}"

    def row(label, values):
        lines.append("".join(c.rjust(w) for c, w in zip([label] + [fmt(v) for v in values], widths)))

    for it in its:
        vals = [curves[n].get(it) for n in names]
        diffs = [None if curves[n].get(it) is None or curves[baseline].get(it) is None
                 else curves[n][it] - curves[baseline][it] for n in others]
        row(str(it), vals + diffs)
    tails = {n: last_three_mean(curves[n]) for n in names}
    row("last3", [tails[n] for n in names]
        + [None if tails[n] is None or tails[baseline] is None else tails[n] - tails[baseline] for n in others])
    return lines


def last_three_mean(curve: dict[int, float]) -> float | None:
    tail = [curve[i] for i in sorted(curve)[-3:]]
    return sum(tail) / len(tail) if tail else None


def mean_curve(curves: list[dict[int, float]]) -> dict[int, float]:
    """Pointwise mean over seeds, at the iterations every seed evaluated."""
    common = set.intersection(*(set(c) for c in curves)) if curves else set()
    return {it: statistics.fmean(c[it] for c in curves) for it in sorted(common)}


def run_variant(quickstart, name: str, extra: list[str], seed: int, *, pre_ckpt: Path, out: Path, iters: int,
                nproc: int) -> Path:
    run_dir = out / f"{name}_seed{seed}"
    metrics = run_dir / "metrics.jsonl"
    _, train = read_metrics(metrics)
    if len(train) >= iters:
        log.info("%s seed %d: already done (%s)", name, seed, metrics)
        return metrics
    # A partial run is restarted from scratch: its metrics file and checkpoints would mix two runs.
    shutil.rmtree(run_dir, ignore_errors=True)
    env_config = quickstart.write_env_config(run_dir / "arithmetic.yaml")
    cmd = quickstart.launcher(nproc) + [str(REPO / "train_rl.py"), *with_seed(quickstart.model_flags(False), seed),
                                        *quickstart.rl_flags(pre_ckpt, run_dir / "rl", env_config, metrics,
                                                             run_dir / "tensorboard", nproc=nproc, iters=iters),
                                        *extra]
    (run_dir / "cmd.txt").write_text(" ".join(cmd) + "\n")
    start = time.time()
    quickstart.run(cmd, run_dir / "train_rl.log")
    log.info("%s seed %d: %.0f s", name, seed, time.time() - start)
    return metrics


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "async_quality")
    p.add_argument("--pretrained", type=Path, default=None,
                   help="pretrained checkpoint to start every run from (default: pretrain one under --out)")
    p.add_argument("--pretrain-iters", type=int, default=600)
    p.add_argument("--rl-iters", type=int, default=60)
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--variants", nargs="+", default=["sync", "lag1_partial_GG", "lag1_partial_BB"],
                   choices=sorted(VARIANTS))
    p.add_argument("--nproc", type=int, default=1)
    args = p.parse_args(argv)
    import quickstart

    out = args.out.resolve()
    pre_ckpt = args.pretrained.resolve() if args.pretrained else None
    if pre_ckpt is None:
        pre_ckpt = quickstart.pretrain(out, nproc=args.nproc, gpu=False, iters=args.pretrain_iters)
    elif not quickstart.has_checkpoint(pre_ckpt):
        raise SystemExit(f"--pretrained {pre_ckpt}: no checkpoint there (latest_checkpointed_iteration.txt missing)")
    os.environ.setdefault("OMP_NUM_THREADS", "1")

    per_seed: dict[str, list[dict[int, float]]] = {v: [] for v in args.variants}
    summary: dict[str, dict[str, float]] = {}
    # Seeds outermost: an interrupted comparison still has every variant for the first seeds.
    for seed in args.seeds:
        for name in args.variants:
            metrics = run_variant(quickstart, name, VARIANTS[name], seed, pre_ckpt=pre_ckpt, out=out,
                                  iters=args.rl_iters, nproc=args.nproc)
            evals, train = read_metrics(metrics)
            per_seed[name].append(evals)
            for key in SUMMARY:
                vals = [r[key] for r in train.values() if key in r]
                if vals:
                    summary.setdefault(name, {}).setdefault(key, 0.0)
                    summary[name][key] += statistics.fmean(vals) / len(args.seeds)

    print(f"\nheld-out pass@1 (200 answers at T=1), pretrained checkpoint {pre_ckpt}, {args.rl_iters} RL iterations")
    for seed_index, seed in enumerate(args.seeds):
        print(f"\nseed {seed}")
        print("\n".join(curve_table({v: per_seed[v][seed_index] for v in args.variants})))
    if len(args.seeds) > 1:
        print(f"\nmean over seeds {args.seeds}")
        print("\n".join(curve_table({v: mean_curve(per_seed[v]) for v in args.variants})))
    print("\nper-iteration means over the run (and seeds)")
    print("variant".ljust(18) + "".join(k.rjust(24) for k in SUMMARY))
    for name in args.variants:
        print(name.ljust(18) + "".join(
            (f"{summary[name][k]:.4f}" if k in summary.get(name, {}) else "-").rjust(24) for k in SUMMARY))
    return 0


if __name__ == "__main__":
    sys.exit(main())
