"""Each call of one operator in a recorded trace, with its host time (CPU only).

    python benchmarks/op_calls.py benchmarks/results/s35c4_trace_W1_1_ours.json.gz aten::embedding

Reads a ``torch.profiler`` trace that ``offload_bench.py --profile-dir`` kept and prints,
in time order, every call of the named operator: when it started (ms from the trace's
first operator), the thread, and its host duration (us), with the child that took longest
inside it, and the profiler's own work (its ``overhead`` events, on any thread) that
overlaps the call. In every W1 trace on record ours' first token-embedding call of the two
profiled steps takes 2.1-3.2 ms, nearly all in ``aten::index_select``, where every other
embedding call in those traces, either kind's, takes 0.03-0.31 ms (BENCHMARKS.md,
session 35). The profiler's ``Activity Buffer Request`` (1.9-2.8 ms, as profiling starts)
overlaps each of those first calls, and comes before the first embedding in full-GPU
training's traces: the profiler's cost, which timed steps do not pay (session 36).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace


@dataclass(frozen=True)
class Call:
    start_ms: float
    tid: Any
    duration_us: float
    longest_child: str
    longest_child_us: float
    profiler_overhead: tuple[tuple[str, float], ...] = ()
    """The profiler's ``overhead`` events (name, us) that overlap the call, any thread."""


def op_calls(trace: dict[str, Any], name: str) -> list[Call]:
    """Every complete event named ``name`` among the trace's host operators, in time order,
    with the longest host operator or runtime call nested in it on its thread."""
    host = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "cuda_runtime")
    ]
    if not host:
        return []
    overhead = [
        e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") == "overhead"
    ]
    origin = min(e["ts"] for e in host)
    calls = []
    for e in sorted((e for e in host if e["name"] == name), key=lambda e: e["ts"]):
        end = e["ts"] + e["dur"]
        inside = [
            k
            for k in host
            if k is not e and k["tid"] == e["tid"] and e["ts"] <= k["ts"] and k["ts"] < end
        ]
        top = max(inside, key=lambda k: k["dur"], default=None)
        profiler = tuple(
            (o["name"], float(o["dur"]))
            for o in overhead
            if o["ts"] < end and e["ts"] < o["ts"] + o["dur"]
        )
        calls.append(
            Call(
                (e["ts"] - origin) / 1e3,
                e["tid"],
                float(e["dur"]),
                top["name"] if top else "-",
                float(top["dur"]) if top else 0.0,
                profiler,
            )
        )
    return calls


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("op", help="operator name as the trace records it, e.g. aten::embedding")
    args = parser.parse_args(argv)
    if not args.trace.is_file():
        parser.error(f"no such file: {args.trace}")
    calls = op_calls(load_trace(args.trace), args.op)
    if not calls:
        print(f"{args.trace.name}: no call of {args.op}")
        return 0
    for c in calls:
        beside = "".join(
            f"; overlapping the profiler's {name} {us:.0f} us" for name, us in c.profiler_overhead
        )
        print(
            f"{args.trace.name}: {args.op} at {c.start_ms:.1f} ms on thread {c.tid}: "
            f"{c.duration_us:.0f} us (longest inside: {c.longest_child} "
            f"{c.longest_child_us:.0f} us{beside})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
