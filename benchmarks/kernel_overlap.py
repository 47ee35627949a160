"""Do the compute stream's kernels run longer while copies run? (CPU only)

    python benchmarks/kernel_overlap.py benchmarks/results/s38c3_trace_W3_write1.json.gz

Reads a ``torch.profiler`` trace that ``offload_bench.py --profile-dir`` kept and, for
each kernel of the compute stream (the stream with the most kernels) with at least
``--min-count`` launches of one name and grid, compares the median duration of the
launches that ran mostly beside a copy (more than half of their time overlapping a
``gpu_memcpy`` of any stream longer than ``--min-copy-us``) with that of the launches
that ran with no copy beside them (under 5% of their time), heaviest kernels first.

With ``--against OTHER``, each kernel's median over every launch of the same name and
grid in another trace too (full-GPU training's, say), and ours' alone median over it.
One name and grid can stand for GEMMs of several shapes (persistent kernels launch one
grid whatever the shape); such a row's medians mix them, and its ratios mean little.

Session 38 asked why ours' GEMMs took 7-17% longer than full-GPU training's in one call
(``issue_compare.py --kernels``); a ratio near 1 beside copies says that the copies
running beside them are not why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace

BESIDE = 0.5
"""A launch runs beside copies when more than this share of it overlaps them."""
ALONE = 0.05
"""... and alone when less than this share does."""


@dataclass(frozen=True)
class KernelOverlap:
    """One kernel (name and grid) of the compute stream, durations in us."""

    name: str
    grid: str
    total_us: float
    beside: int
    beside_median_us: float
    alone: int
    alone_median_us: float

    @property
    def ratio(self) -> float:
        return self.beside_median_us / self.alone_median_us


def _overlap_us(start: float, end: float, spans: list[tuple[float, float]]) -> float:
    """How much of [start, end) the sorted, possibly overlapping ``spans`` cover (each
    span counted, so overlapping copies count twice: a share above 1 is still "beside")."""
    total = 0.0
    for a, b in spans:
        if a >= end:
            break
        if b > start:
            total += min(b, end) - max(a, start)
    return total


def kernel_overlaps(
    events: list[dict[str, Any]], *, min_count: int = 40, min_copy_us: float = 50.0
) -> list[KernelOverlap]:
    """The compute stream's kernels with at least ``min_count`` launches and at least 5
    launches each beside and apart from copies, heaviest first (see the module
    docstring)."""
    kernels = [e for e in events if e.get("ph") == "X" and e.get("cat") == "kernel"]
    if not kernels:
        return []
    compute = Counter(e["tid"] for e in kernels).most_common(1)[0][0]
    copies = sorted(
        (e["ts"], e["ts"] + e["dur"])
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "gpu_memcpy" and e["dur"] > min_copy_us
    )
    groups: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for e in kernels:
        if e["tid"] != compute or e["dur"] <= 0:
            continue
        share = _overlap_us(e["ts"], e["ts"] + e["dur"], copies) / e["dur"]
        key = (e["name"], str(e.get("args", {}).get("grid", "")))
        groups.setdefault(key, []).append((e["dur"], share))
    out = []
    for (name, grid), launches in groups.items():
        beside = [d for d, share in launches if share > BESIDE]
        alone = [d for d, share in launches if share < ALONE]
        if len(launches) < min_count or len(beside) < 5 or len(alone) < 5:
            continue
        out.append(
            KernelOverlap(
                name,
                grid,
                sum(d for d, _ in launches),
                len(beside),
                statistics.median(beside),
                len(alone),
                statistics.median(alone),
            )
        )
    return sorted(out, key=lambda k: -k.total_us)


def medians_by_kernel(events: list[dict[str, Any]]) -> dict[tuple[str, str], float]:
    """Median duration (us) of every kernel name and grid's launches, on any stream."""
    groups: dict[tuple[str, str], list[float]] = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "kernel":
            key = (e["name"], str(e.get("args", {}).get("grid", "")))
            groups.setdefault(key, []).append(e["dur"])
    return {k: statistics.median(v) for k, v in groups.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--min-count", type=int, default=40)
    parser.add_argument("--min-copy-us", type=float, default=50.0)
    parser.add_argument(
        "--against", type=Path, default=None, help="another trace: each kernel's median there"
    )
    args = parser.parse_args(argv)
    events = load_trace(args.trace)["traceEvents"]
    other = medians_by_kernel(load_trace(args.against)["traceEvents"]) if args.against else None
    found = kernel_overlaps(events, min_count=args.min_count, min_copy_us=args.min_copy_us)
    if not found:
        print("no kernel with enough launches both beside copies and apart from them")
        return 0
    head = (
        "| kernel | grid | total ms | beside copies: n, median us | alone: n, median us | ratio |"
    )
    rule = "|---|---|---|---|---|---|"
    if other is not None:
        head += " other trace: median us | alone / other |"
        rule += "---|---|"
    print(head)
    print(rule)
    for k in found[: args.top]:
        line = (
            f"| {k.name[:60]} | {k.grid} | {k.total_us / 1e3:.1f} | {k.beside}, "
            f"{k.beside_median_us:.1f} | {k.alone}, {k.alone_median_us:.1f} | {k.ratio:.3f} |"
        )
        if other is not None:
            there = other.get((k.name, k.grid))
            line += (
                " - | - |" if there is None else f" {there:.1f} | {k.alone_median_us / there:.3f} |"
            )
        print(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
