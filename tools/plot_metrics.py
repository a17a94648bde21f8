"""Plot training curves from a metrics JSONL file (``--rl-metrics-jsonl``) or a TensorBoard directory.

    python tools/plot_metrics.py runs/quickstart/metrics.jsonl --out reward_curve.png --smooth 0.9
    python tools/plot_metrics.py runs/tb --metrics reward_mean eval/pass@1 --out curves.png
    python tools/plot_metrics.py metrics.jsonl --metrics 'env/*/reward_mean' --out envs.png   # one panel per env
    python tools/plot_metrics.py metrics.jsonl --envs --out envs.png   # one panel per metric, a line per env

One panel per metric, x = iteration. JSONL records are dicts with an ``iteration`` key (training records
and evaluation records may be interleaved; each metric is plotted where it is present).

The figure's title names the run and when it started: from the run record ``train_rl.py`` writes at the top of
the JSONL file (``{"run": {"name", "started"}}``; the earliest, for a resumed run), else the file's directory name;
for a TensorBoard directory, its name and the first event's time. ``--title`` adds a line above it. A metric that
never changes (``failed_rollouts`` at 0 the whole run) gets no panel: the constant metrics are one line of text
under the figure (``constant: failed_rollouts = 0, skipped_update = 0``).

``--smooth W`` draws an exponential moving average over iterations (weight W per iteration: 0.9 averages over
about 10 iterations) over the raw line, which stays faint; sparse series (evaluations, under 30 points) are drawn
as they are, with markers. ``--envs`` compares the environments of one run: a panel per metric (``reward_mean``,
``response_length_mean``, ``failed_rollouts``, ``pass@1`` by default; the run's ``env/<name>/<metric>`` and
``eval/<name>/<metric>`` series), one line per environment.
"""
from __future__ import annotations

import argparse
import datetime
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


def run_info(path: Path) -> tuple[str, str | None]:
    """(the run's name, when it started as ``YYYY-MM-DD HH:MM UTC`` or None when unknown) for a metrics JSONL
    file or a TensorBoard directory (see the module docstring)."""
    path = Path(path)
    if path.is_dir():
        return path.resolve().name, _tensorboard_start(path)
    name, started = path.resolve().parent.name or path.stem, None
    for record in iter_records(path):
        run = record.get("run") if isinstance(record, dict) else None
        if isinstance(run, dict) and isinstance(run.get("started"), str):
            if started is None or run["started"] < started:
                name, started = str(run.get("name") or name), run["started"]
    if started is None:
        return name, None
    try:
        when = datetime.datetime.fromisoformat(started).astimezone(datetime.timezone.utc)
    except ValueError:
        return name, started
    return name, when.strftime("%Y-%m-%d %H:%M UTC")


def _tensorboard_start(path: Path) -> str | None:
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    except ImportError:
        return None
    acc = EventAccumulator(str(path), size_guidance={"scalars": 0})
    acc.Reload()
    times = [e.wall_time for tag in acc.Tags().get("scalars", []) for e in acc.Scalars(tag)]
    if not times:
        return None
    when = datetime.datetime.fromtimestamp(min(times), datetime.timezone.utc)
    return when.strftime("%Y-%m-%d %H:%M UTC")


def run_title(name: str, started: str | None, title: str = "") -> str:
    """The figure's title: ``title`` (when given) over ``run NAME, started WHEN``."""
    run = f"run {name}" + (f", started {started}" if started else "")
    return f"{title}\n{run}" if title else run


def constant_value(lines: dict[str, list[tuple[int, float]]]) -> float | None:
    """The one value every point of ``lines`` (a panel's series) has, or None when they differ. Pure."""
    values = {v for points in lines.values() for _, v in points}
    return values.pop() if len(values) == 1 else None


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


def ema(points: list[tuple[int, float]], weight: float) -> list[tuple[int, float]]:
    """Exponential moving average of ``(iteration, value)`` points (sorted by iteration). Pure.

    A point ``d`` iterations after the previous one decays the average by ``weight ** d``; the average is divided
    by the weight it has accumulated, so the first points are not pulled toward 0 (TensorBoard's debiasing).
    ``weight`` 0 returns the points unchanged.
    """
    if not 0.0 <= weight < 1.0:
        raise SystemExit(f"--smooth {weight}: must be in [0, 1) (0: no smoothing, 0.9: about 10 iterations)")
    out, num, den, last = [], 0.0, 0.0, None
    for it, value in points:
        keep = weight ** (it - last) if last is not None else 0.0
        num, den, last = keep * num + (1 - keep) * value, keep * den + (1 - keep), it
        out.append((it, num / den if den > 0 else value))
    return out


ENV_METRICS = ("reward_mean", "response_length_mean", "failed_rollouts", "pass@1")


def env_panels(series: dict[str, list[tuple[int, float]]], metrics=ENV_METRICS) -> list[tuple[str, dict]]:
    """``[(metric, {environment: points})]`` for the metrics some environment of the run has, from its
    ``env/<name>/<metric>`` (training) and ``eval/<name>/<metric>`` (evaluation) series. Pure."""
    panels = []
    for metric in metrics:
        for prefix in ("env", "eval"):
            lines = {}
            for name in sorted(series):
                parts = name.split("/")
                if len(parts) == 3 and parts[0] == prefix and parts[2] == metric and series[name]:
                    lines[parts[1]] = series[name]
            if lines:
                panels.append((metric if prefix == "env" else f"eval {metric}", lines))
    return panels


_SPARSE = 30  # fewer points (evaluations): drawn with markers, never smoothed (each point is already an average)


def _draw(ax, points, label, color, smooth: float, many: bool) -> None:
    xs, ys = zip(*sorted(points))
    marker = "o" if len(xs) < _SPARSE else None
    if smooth > 0 and len(xs) >= _SPARSE:
        ax.plot(xs, ys, color=color, alpha=0.25, linewidth=1, marker=marker, markersize=2)
        sx, sy = zip(*ema(sorted(points), smooth))
        ax.plot(sx, sy, color=color, linewidth=1.8, label=label)
    else:
        ax.plot(xs, ys, color=color, marker=marker, markersize=3, label=label, linewidth=1.4 if many else 1.6)


def plot(series: dict[str, list[tuple[int, float]]], metrics: list[str], out: Path, title: str = "",
         smooth: float = 0.0, envs: bool = False) -> Path:
    """Write the PNG of :func:`figure` to ``out``; returns ``out``."""
    import matplotlib.pyplot as plt

    fig = figure(series, metrics, title, smooth, envs)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out


def figure(series: dict[str, list[tuple[int, float]]], metrics: list[str], title: str = "", smooth: float = 0.0,
           envs: bool = False):
    """A matplotlib figure with one panel per metric (``envs``: per metric of :func:`env_panels`, one line per
    environment); ``smooth``: see :func:`ema`."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if envs:
        panels = env_panels(series, metrics or ENV_METRICS)
        if not panels:
            raise SystemExit(f"no per-environment series (env/<name>/<metric>, eval/<name>/<metric>) for {metrics}; "
                             f"available: {sorted(series)}")
    else:
        present = [m for m in expand_metrics(metrics, list(series)) if series.get(m)]
        if not present:
            raise SystemExit(f"none of {metrics} is in the data; available: {sorted(series)}")
        panels = [(name, {"": series[name]}) for name in present]
    folded = [(name, constant_value(lines)) for name, lines in panels if constant_value(lines) is not None]
    changing = [(name, lines) for name, lines in panels if constant_value(lines) is None]
    if changing:  # (when every metric is constant, they keep their panels: there would be nothing to draw)
        panels = changing
    else:
        folded = []
    # constrained layout places the title above the top panel (tight_layout let it overlap with many panels)
    fig, axes = plt.subplots(len(panels), 1, figsize=(7.5, 1.2 + 2.2 * len(panels)), sharex=True, squeeze=False,
                             layout="constrained")
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    names = sorted({env for _, lines in panels for env in lines})
    for ax, (name, lines) in zip(axes[:, 0], panels):
        for env, points in lines.items():
            _draw(ax, points, env or None, colors[names.index(env) % len(colors)], smooth, len(lines) > 1)
        ax.set_title(name, loc="left", fontsize=10)  # above the panel: long names never run into the next one
        ax.grid(alpha=0.3)
    if envs:
        handles = [plt.Line2D([], [], color=colors[i % len(colors)], linewidth=2) for i in range(len(names))]
        fig.legend(handles, names, loc="outside lower center", ncols=min(len(names), 5), title="environment")
    axes[-1, 0].set_xlabel("iteration" + (f"  (lines: EMA {smooth:g} per iteration, faint: raw)" if smooth else ""))
    if title:
        fig.suptitle(title)
    if folded:
        fig.supxlabel("constant: " + ", ".join(f"{name} = {value:g}" for name, value in folded), fontsize=9)
    return fig


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source", type=Path, help="metrics JSONL file or TensorBoard log directory")
    p.add_argument("--metrics", nargs="+", default=None,
                   help=f"metrics (shell patterns allowed); default {' '.join(DEFAULT_METRICS)}, with --envs "
                        f"{' '.join(ENV_METRICS)}")
    p.add_argument("--out", type=Path, default=Path("metrics.png"), help="PNG to write")
    p.add_argument("--title", default="", help="a title line above the run's name and start time")
    p.add_argument("--smooth", type=float, default=0.0,
                   help="EMA weight per iteration drawn over the faint raw line (0: off; 0.9: about 10 iterations)")
    p.add_argument("--envs", action="store_true",
                   help="compare the run's environments: a panel per metric, a line per environment")
    args = p.parse_args(argv)
    metrics = args.metrics or list(ENV_METRICS if args.envs else DEFAULT_METRICS)
    series = load_series(args.source)
    out = plot(series, metrics, args.out, run_title(*run_info(args.source), args.title), args.smooth, args.envs)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
