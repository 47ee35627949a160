"""The rows an ``offload_bench.py`` run printed, as its ``--json`` file would hold them.

    python benchmarks/log_rows.py benchmarks/results/s37c4_W4_fsp.log \\
        --commit 188c413 --date 2026-12-01 --torch 2.11.0+cu130 --json W4_fsp.json

A run cut off by its call's time limit (a peer still measuring) writes no ``--json``
file, but its log holds every finished row: each measurement prints
``[bench] WORKLOAD KIND: {...}``. This collects those rows so that ``targets.py``,
``pin_rows.py`` and ``replay_bench.py`` read them like any other run's; the file's
``meta.command`` names the log it came from. Rows that did not finish are absent, never
guessed. Nothing is allocated; no GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

ROW = re.compile(r"^\[bench\] (W\d+) (\S+): (\{.*\})\s*$")


def rows_from_log(text: str) -> dict[str, dict[str, dict[str, Any]]]:
    """``{workload: {kind: row}}`` from the ``[bench]`` lines of a log (the last line of a
    workload and kind wins, as the bench's table does)."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for line in text.splitlines():
        m = ROW.match(line)
        if m is None:
            continue
        try:
            row = json.loads(m.group(3))
        except json.JSONDecodeError:
            continue  # a line cut off mid-write
        if isinstance(row, dict):
            out.setdefault(m.group(1), {})[m.group(2)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("log", type=Path)
    ap.add_argument("--commit", required=True, help="the commit the run measured")
    ap.add_argument("--date", required=True, help="the run's date, YYYY-MM-DD")
    ap.add_argument("--torch", required=True, help="the torch version it ran under")
    ap.add_argument("--gpu", default="NVIDIA H200")
    ap.add_argument("--json", type=Path, required=True, help="where to write the rows")
    args = ap.parse_args(argv)
    results = rows_from_log(args.log.read_text())
    if not results:
        print(f"{args.log}: no finished [bench] rows", file=sys.stderr)
        return 1
    meta = {
        "date": args.date,
        "commit": args.commit,
        "gpu": args.gpu,
        "torch": args.torch,
        "command": f"rows printed in {args.log.name} (benchmarks/log_rows.py): "
        "the run was cut off before it wrote its --json file",
    }
    args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=1) + "\n")
    for w, by_kind in results.items():
        print(f"{w}: {', '.join(by_kind)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
