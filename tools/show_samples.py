"""Print the sample completions a run logged (``--rl-log-samples``) from its ``--rl-metrics-jsonl`` file.

    python tools/show_samples.py runs/my_env/metrics.jsonl                 # the last iteration's samples
    python tools/show_samples.py runs/my_env/metrics.jsonl --last 3 --env arithmetic
    python tools/show_samples.py runs/my_env/metrics.jsonl --iteration 120

Completions are printed with ``repr`` so whitespace and control characters show (a policy that collapsed to
eight spaces prints ``'        '``, not an empty line).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tools.plot_metrics import iter_records  # noqa: E402 (needs the repository root on sys.path)


def read_samples(path: Path) -> dict[int, list[dict]]:
    """``{iteration: samples}`` from a metrics JSONL file (lines without samples are skipped)."""
    out: dict[int, list[dict]] = {}
    for record in iter_records(path):
        if isinstance(record, dict) and record.get("samples"):
            out.setdefault(int(record["iteration"]), []).extend(record["samples"])
    return out


def format_sample(iteration: int, s: dict) -> str:
    head = [f"iteration {iteration}", s.get("env", "?"), f"problem {s.get('problem_id')}",
            f"reward {s.get('reward', float('nan')):.4g}", str(s.get("status", "?"))]
    if s.get("response_tokens") is not None:
        head.append(f"{s['response_tokens']} tokens")
    if s.get("turns") not in (None, 1):
        head.append(f"{s['turns']} turns")
    if s.get("finish_reasons"):
        head.append("finish " + ",".join(s["finish_reasons"]))
    lines = [" | ".join(head)]
    if s.get("failure_reason"):
        lines.append(f"  failure:    {s['failure_reason']}")
    lines.append(f"  prompt:     {s.get('prompt', '')!r}")
    lines.append(f"  completion: {s.get('completion', '')!r}")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("source", type=Path, help="a --rl-metrics-jsonl file")
    p.add_argument("--iteration", type=int, default=None, help="this iteration's samples")
    p.add_argument("--last", type=int, default=1, help="the samples of the last N iterations (default 1)")
    p.add_argument("--env", default=None, help="only this environment's samples")
    args = p.parse_args(argv)
    if not args.source.is_file():
        raise SystemExit(f"{args.source}: no such file")
    samples = read_samples(args.source)
    if not samples:
        raise SystemExit(f"{args.source} holds no samples: was the run started with --rl-log-samples 0?")
    if args.iteration is not None:
        if args.iteration not in samples:
            raise SystemExit(f"no samples for iteration {args.iteration}; iterations with samples: "
                             f"{min(samples)}..{max(samples)}")
        chosen = [args.iteration]
    else:
        chosen = sorted(samples)[-max(args.last, 1):]
    blocks = [format_sample(it, s) for it in chosen for s in samples[it] if args.env in (None, s.get("env"))]
    print("\n\n".join(blocks) if blocks else f"no samples of environment {args.env!r} in iterations {chosen}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
