"""How the backward's operators ran beside the host's speculative steps (CPU only).

    python benchmarks/backward_ops.py prof/trace_W3.json.gz [--against prof/trace_full.json.gz]

Reads a ``torch.profiler`` trace that ``offload_bench.py --profile-dir`` kept (every
profiled step) and prints, for each of a few backward operators (``--op``, repeatable;
by default the matrix products', layer norms' and gradient accumulations' autograd
nodes), how many ran and their median CPU duration while a speculative host step was
running and outside any, with their total; with ``--against``, the same operators' median
and total in another trace (full-GPU training of the same run). Then the gradient hooks
that took over ``--hook-us`` (the ``AccumulateGrad`` nodes in which a region's gradients
were complete and left for the host) and what ran inside them on their thread, by total
time: what a region's hook costs the backward's issue. Times in microseconds unless
marked ms.

Session 48's W3 backward ran its kernels 131 ms a step but spanned 160-180 ms, and the
thread issuing them was busy twice as long as full GPU's (``issue_compare.py``); this
splits that into the hooks and the operators slowed beside the host's steps.
"""

from __future__ import annotations

import argparse
import bisect
import statistics
import sys
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace

NODE = "autograd::engine::evaluate_function: "
ACCUMULATE = NODE + "torch::autograd::AccumulateGrad"
DEFAULT_OPS = ("AddmmBackward0", "NativeLayerNormBackward0", "torch::autograd::AccumulateGrad")
SPECULATIVE = "speculative step"


def spans(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The trace's complete spans (``ph`` X) with a duration."""
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def _overlaps(e: dict[str, Any], windows: list[tuple[float, float]]) -> bool:
    start, end = e["ts"], e["ts"] + e["dur"]
    return any(s < end and start < w_end for s, w_end in windows)


def op_split(events: list[dict[str, Any]], op: str) -> tuple[list[float], list[float]]:
    """Durations (us) of autograd node ``op`` that overlapped a speculative host step, and
    of the rest."""
    xs = spans(events)
    windows = [
        (e["ts"], e["ts"] + e["dur"]) for e in xs if str(e.get("name", "")).startswith(SPECULATIVE)
    ]
    during: list[float] = []
    outside: list[float] = []
    for e in xs:
        if e.get("name") == NODE + op:
            (during if _overlaps(e, windows) else outside).append(float(e["dur"]))
    return during, outside


def hook_children(
    events: list[dict[str, Any]], over_us: float
) -> tuple[int, float, Counter[str], Counter[str]]:
    """The ``AccumulateGrad`` nodes over ``over_us``: how many, their total (us), and the
    total time and count of each operator or runtime call inside them on their thread
    (autograd nodes left out)."""
    xs = spans(events)
    hooks = [e for e in xs if e.get("name") == ACCUMULATE and e["dur"] > over_us]
    # Each thread's spans by start, so that a hook's children are found by bisection
    # rather than by scanning the thread's every span per hook.
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in xs:
        by_tid.setdefault(e.get("tid"), []).append(e)
    starts: dict[Any, list[float]] = {}
    for tid, evs in by_tid.items():
        evs.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in evs]
    time_us: Counter[str] = Counter()
    count: Counter[str] = Counter()
    for h in hooks:
        end = h["ts"] + h["dur"]
        tid = h.get("tid")
        evs = by_tid[tid]
        for i in range(bisect.bisect_left(starts[tid], h["ts"]), len(evs)):
            e = evs[i]
            if e["ts"] >= end:
                break
            name = str(e.get("name", ""))
            if e is h or name.startswith(NODE) or name == "torch::autograd::AccumulateGrad":
                continue
            if e["ts"] + e["dur"] <= end:
                time_us[name] += e["dur"]
                count[name] += 1
    return len(hooks), float(sum(h["dur"] for h in hooks)), time_us, count


def _median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.0f}" if xs else "-"


def report(
    events: list[dict[str, Any]],
    ops: list[str],
    over_us: float,
    against: list[dict[str, Any]] | None = None,
    top: int = 10,
) -> list[str]:
    """The lines :func:`main` prints."""
    lines = []
    for op in ops:
        during, outside = op_split(events, op)
        line = (
            f"{op}: {len(during)} during speculative steps, median {_median(during)} us; "
            f"{len(outside)} outside, median {_median(outside)} us; "
            f"total {(sum(during) + sum(outside)) / 1e3:.1f} ms"
        )
        if against is not None:
            theirs = [float(e["dur"]) for e in spans(against) if e.get("name") == NODE + op]
            line += (
                f"; against: {len(theirs)}, median {_median(theirs)} us, "
                f"total {sum(theirs) / 1e3:.1f} ms"
            )
        lines.append(line)
    n, total, time_us, count = hook_children(events, over_us)
    lines.append(
        f"gradient hooks over {over_us:g} us: {n}, {total / 1e3:.1f} ms in all; inside them:"
    )
    for name, t in time_us.most_common(top):
        lines.append(f"  {t / 1e3:7.1f} ms {count[name]:6d}  {name}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--against", type=Path, help="another trace (full-GPU training)")
    parser.add_argument("--op", action="append", help="an autograd node's name (repeatable)")
    parser.add_argument("--hook-us", type=float, default=200.0)
    parser.add_argument("--top", type=int, default=10)
    args = parser.parse_args(argv)
    events = load_trace(args.trace)["traceEvents"]
    against = load_trace(args.against)["traceEvents"] if args.against else None
    ops = args.op or list(DEFAULT_OPS)
    print("\n".join(report(events, ops, args.hook_us, against, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
