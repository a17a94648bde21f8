"""Plot training curves from a metrics JSONL file (``--rl-metrics-jsonl``) or a TensorBoard directory.

    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --out reward_curve.png
    python tools/plot_metrics.py runs/tb --metrics reward_mean eval/pass@1 --out curves.png
    python tools/plot_metrics.py metrics.jsonl --metrics 'env/*/reward_mean' --out envs.png   # one panel per env

One panel per metric, x = iteration. JSONL records are dicts with an ``iteration`` key (training records
and evaluation records may be interleaved; each metric is plotted where it is present).
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import sys
from pathlib import Path

DEFAULT_METRICS = ("reward_mean", "eval/pass@1", "rl_loss", "response_length_mean", "logprob_gap_max")


def iter_records(path: Path):
    """The JSON records of a metrics JSONL file, one per non-empty line (an unparsable line is an error)."""
    with path.open(encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise SystemExit(f"{path}:{line_no}: not JSON ({e.msg}); is this a --rl-metrics-jsonl file?")


def read_jsonl(path: Path) -> dict[str, list[tuple[int, float]]]:
    series: dict[str, list[tuple[int, float]]] = {}
    for record in iter_records(path):
        it = record.get("iteration")
        if it is None:
            continue
        for key, value in record.items():
            if key != "iteration" and isinstance(value, (int, float)) and math.isfinite(value):
                series.setdefault(key, []).append((int(it), float(value)))
    return series


def read_tensorboard(path: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags().get("scalars", [])}


def load_series(path: Path) -> dict[str, list[tuple[int, float]]]:
    if not path.exists():
        raise SystemExit(f"{path}: no such file or directory")
    return read_tensorboard(path) if path.is_dir() else read_jsonl(path)


def expand_metrics(metrics: list[str], available: list[str]) -> list[str]:
    """Names, with shell-style patterns (``env/*/reward_mean``) replaced by the matching names, sorted."""
    out: list[str] = []
    for m in metrics:
        matches = sorted(fnmatch.filter(available, m)) if any(c in m for c in "*?[") else [m]
        out.extend(x for x in matches if x not in out)
    return out


def plot(series: dict[str, list[tuple[int, float]]], metrics: list[str], out: Path, title: str = "") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    present = [m for m in expand_metrics(metrics, list(series)) if series.get(m)]
    if not present:
        raise SystemExit(f"none of {metrics} is in the data; available: {sorted(series)}")
    fig, axes = plt.subplots(len(present), 1, figsize=(7, 2.4 * len(present)), sharex=True, squeeze=False)
    for ax, name in zip(axes[:, 0], present):
        xs, ys = zip(*sorted(series[name]))
        ax.plot(xs, ys, marker="o" if len(xs) < 30 else None, markersize=3)
        ax.set_ylabel(name)
        ax.grid(alpha=0.3)
    axes[-1, 0].set_xlabel("iteration")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="metrics JSONL file or TensorBoard log directory")
    p.add_argument("--metrics", nargs="+", default=list(DEFAULT_METRICS))
    p.add_argument("--out", type=Path, default=Path("metrics.png"))
    p.add_argument("--title", default="")
    args = p.parse_args(argv)
    out = plot(load_series(args.source), args.metrics, args.out, args.title)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
