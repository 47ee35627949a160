"""One kind's step in every ``offload_bench.py --json`` file given (CPU only).

    python benchmarks/row_steps.py W2 fsdp2 benchmarks/results/s3[0-5]c*W2*.json --at-least 627

Prints, per file holding a successful row of that workload and kind, its step (mean of the
5 fastest timed steps) and run mean in ms; then their range, and with ``--at-least MS``
how many steps are at least that long (session 35: how many of FSDP2's W2 rows stepped
slowly enough for W2 at its host-memory bound to meet 0.55x, BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def row_steps(paths: list[Path], workload: str, kind: str) -> list[tuple[str, float, float]]:
    """(file name, step ms, run mean ms) of each file's successful ``kind`` row."""
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        row = data.get("results", {}).get(workload, {}).get(kind)
        if row and row.get("ok"):
            out.append((path.name, float(row["step_ms"]), float(row["step_mean_ms"])))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload")
    parser.add_argument("kind")
    parser.add_argument("json", nargs="+", type=Path)
    parser.add_argument("--at-least", type=float, default=None, metavar="MS")
    args = parser.parse_args(argv)
    rows = row_steps(args.json, args.workload, args.kind)
    for name, step, mean in rows:
        print(f"{name}: {args.kind} {step:.0f} ms (run {mean:.0f})")
    if not rows:
        print(f"no successful {args.workload} {args.kind} row")
        return 0
    steps = [s for _, s, _ in rows]
    print(f"{len(rows)} rows: {min(steps):.0f}-{max(steps):.0f} ms")
    if args.at_least is not None:
        slow = sum(s >= args.at_least for s in steps)
        print(f"{slow} of {len(rows)} at {args.at_least:g} ms or more")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
