"""Compare two runs' metrics value by value: is a change behaviour-neutral, is a run reproducible?

    python tools/compare_runs.py runs/before/metrics.jsonl runs/after/metrics.jsonl
    python tools/compare_runs.py runs/before runs/after --show 20      # a run directory holding metrics.jsonl

Every number of every training and evaluation record is compared exactly (timings, rates, the CPU thread count
and the engine's step count left out), and the logged sample completions record by record. A run whose CPU
thread count changed (``cpu_threads``: ``--cpu-threads auto`` gives up threads while other processes keep cores
busy) adds its reductions in another order, so its figures are not another run's bit for bit: the report says so.

Exit status: 0 when nothing differs, 1 when something does, 2 when a file is missing or the runs logged other
iterations.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.plot_metrics import iter_records  # noqa: E402 (needs the repository root on sys.path)

# Values that measure the machine, not what the run computed: the thread count, and the engine's step count, which
# depends on when requests reached it (an idle engine waits a few ms for more before it steps), not on the tokens
# or log-probs of any step.
_ENVIRONMENT = ("cpu_threads", "engine_steps_total")


def measures_the_machine(key: str) -> bool:
    """Timings (``time_*``), rates (``*_per_s``), the thread and engine step counts: they differ between identical
    runs."""
    return key.startswith("time_") or key.endswith("_per_s") or key in _ENVIRONMENT


def record_kind(record: dict) -> str | None:
    """``training``, ``evaluation`` or ``samples``; None for the run's header and rollout-bank ledgers."""
    if "samples" in record:
        return "samples"
    if any(key.startswith("eval/") for key in record):
        return "evaluation"
    if "run" in record or "rollout_groups" in record:
        return None
    return "training"


def load(path: Path) -> dict[tuple[str, int], dict]:
    """The records of a metrics JSONL file (or of a directory's ``metrics.jsonl``) by (kind, iteration)."""
    path = path / "metrics.jsonl" if path.is_dir() else path
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file (give a --rl-metrics-jsonl file or a directory holding one)")
    out = {}
    for record in iter_records(path):
        kind = record_kind(record) if isinstance(record, dict) else None
        if kind is not None:
            out[(kind, int(record["iteration"]))] = record  # a resumed run rewrote what came after its start
    return out


@dataclasses.dataclass
class Comparison:
    values: int = 0  # numbers compared
    differ: list[tuple[str, int, str, object, object]] = dataclasses.field(default_factory=list)
    samples: int = 0  # sample records compared
    samples_differ: list[int] = dataclasses.field(default_factory=list)  # their iterations
    only_in: dict[str, list[tuple[str, int]]] = dataclasses.field(default_factory=dict)
    threads: dict[str, list[int]] = dataclasses.field(default_factory=dict)  # each run's counts, as they changed


def changes(counts: list[int]) -> list[int]:
    """``counts`` with repeats in a row folded: ``[2, 2, 1, 1, 2]`` -> ``[2, 1, 2]`` (pure)."""
    return [c for i, c in enumerate(counts) if i == 0 or c != counts[i - 1]]


def thread_path(records: dict[tuple[str, int], dict]) -> list[int]:
    """The run's CPU thread counts in iteration order, each change once (``[2]``: never changed)."""
    return changes([int(r["cpu_threads"]) for (kind, _), r in sorted(records.items(), key=lambda x: x[0][1])
                    if kind == "training" and "cpu_threads" in r])


def compare(a: dict[tuple[str, int], dict], b: dict[tuple[str, int], dict]) -> Comparison:
    """Every shared record's values, exactly (pure)."""
    out = Comparison(only_in={"first": sorted(set(a) - set(b)), "second": sorted(set(b) - set(a))},
                     threads={"first": thread_path(a), "second": thread_path(b)})
    for kind, iteration in sorted(set(a) & set(b), key=lambda x: (x[1], x[0])):
        x, y = a[(kind, iteration)], b[(kind, iteration)]
        if kind == "samples":
            out.samples += 1
            if x["samples"] != y["samples"]:
                out.samples_differ.append(iteration)
            continue
        for key in sorted(set(x) | set(y)):
            if key == "iteration" or measures_the_machine(key):
                continue
            u, v = x.get(key), y.get(key)
            if isinstance(u, (int, float)) or isinstance(v, (int, float)):
                out.values += 1
                if u != v:
                    out.differ.append((kind, iteration, key, u, v))
    return out


def report(c: Comparison, show: int) -> list[str]:
    lines = [f"{c.values} values compared, {len(c.differ)} differ; {c.samples} sample records compared, "
             f"{len(c.samples_differ)} differ"]
    for kind, iteration, key, u, v in c.differ[:show]:
        lines.append(f"  iteration {iteration} {kind} {key}: {u!r} vs {v!r}")
    if len(c.differ) > show:
        lines.append(f"  ... {len(c.differ) - show} more (--show N)")
    if c.samples_differ:
        lines.append(f"  sample completions differ from iteration {c.samples_differ[0]} on")
    for side, missing in c.only_in.items():
        if missing:
            names = ", ".join(f"{kind} {it}" for kind, it in missing[:8])
            lines.append(f"only in the {side} run: {names}{' ...' if len(missing) > 8 else ''} ({len(missing)})")
    changed = {side: path for side, path in c.threads.items() if len(path) > 1}
    if changed or (all(c.threads.values()) and c.threads["first"] != c.threads["second"]):
        paths = "; ".join(f"{side}: {' -> '.join(map(str, path)) or 'not logged'}" for side, path in c.threads.items())
        lines.append(f"CPU threads ({paths}): the runs reduced over other numbers of threads, so their figures "
                     f"need not agree bit for bit; compare runs made with a fixed count (--cpu-threads N) or on an "
                     f"idle machine")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("first", type=Path, help="a --rl-metrics-jsonl file, or a run directory holding metrics.jsonl")
    p.add_argument("second", type=Path)
    p.add_argument("--show", type=int, default=10, help="differences to print (default 10)")
    args = p.parse_args(argv)
    try:
        c = compare(load(args.first), load(args.second))
    except FileNotFoundError as e:
        print(f"compare_runs.py: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(report(c, args.show)))
    if any(c.only_in.values()):
        return 2
    return 1 if c.differ or c.samples_differ else 0


if __name__ == "__main__":
    sys.exit(main())
