"""Measured steps grouped by how many regions their plan streamed (no GPU).

    python benchmarks/streamed_count.py benchmarks/results/s4[2-9]c*.json \
        benchmarks/results/s50c*.json

For one workload and kind (default W3 ``ours_io_spec1_stream``), every successful row of
``offload_bench.py --json`` files under the workload's own budget (``targets.load_rows``)
is put in a group by the number of regions its plan streamed
(``streamed_region_indices``): per group, how many rows and from which sessions, the
range of the 5 fastest steps' mean (``step_ms``) and of the plan's prediction
(``pred_step_ms``). The rows differ in machine and host rate, so it is a lead for an A/B
on one plan (``gpu_session.sh streamcap``), not a measurement.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import call_of, load_rows


@dataclass
class Group:
    """Rows whose plans streamed the same number of regions."""

    steps_ms: list[float] = field(default_factory=list)
    predicted_ms: list[float] = field(default_factory=list)
    sessions: set[str] = field(default_factory=set)


def groups(paths: list[Path], workload: str, kind: str) -> dict[int, Group]:
    """The rows of ``workload`` and ``kind`` in ``paths``, by regions streamed."""
    out: dict[int, Group] = {}
    for row in load_rows(paths, {kind}):
        if row.workload != workload:
            continue
        n = len(row.result.get("streamed_region_indices") or [])
        group = out.setdefault(n, Group())
        group.steps_ms.append(float(row.result["step_ms"]))
        if "pred_step_ms" in row.result:
            group.predicted_ms.append(float(row.result["pred_step_ms"]))
        group.sessions.add(call_of(Path(row.file)).split("c")[0])
    return out


def _span(values: list[float]) -> str:
    return f"{min(values):.1f}-{max(values):.1f}" if values else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--workload", default="W3")
    parser.add_argument("--kind", default="ours_io_spec1_stream")
    args = parser.parse_args(argv)
    found = groups(args.files, args.workload, args.kind)
    print("| regions streamed | rows | 5 fastest steps (ms) | predicted (ms) |")
    print("|---|---|---|---|")
    for n, group in sorted(found.items()):
        sessions = ", ".join(sorted(group.sessions))
        print(
            f"| {n} | {len(group.steps_ms)} ({sessions}) | {_span(group.steps_ms)} | "
            f"{_span(group.predicted_ms)} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
