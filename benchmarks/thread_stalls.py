"""Cheap operators that took long on the threads that issue GPU work, from a trace.

    python benchmarks/thread_stalls.py TRACE.json.gz [TRACE ...] [--over-ms 1]

A view, a ``detach`` or a kernel launch takes microseconds of CPU; in a ``torch.profiler``
trace of ``offload_bench.py --profile-dir`` one that spans milliseconds is a thread that
was not running: descheduled while other threads (the host Adam's intra-op pool, the
host worker, the issuing thread) held the cores, or waiting for a lock. On the main
thread (the one that ran ``Optimizer.step``) and the thread driving backward (the one
that ran ``autograd::engine`` functions), such a stall leaves the GPU without the work
the thread was about to issue. For each trace this prints, per thread, how many cheap
operators it ran, those over ``--over-ms`` (default 1) with when each began (ms from the
trace's first event) and the operator enclosing it, and their total.

A ``cudaMemcpyAsync`` into pageable memory waits for the stream by design (the step's
one read of the answer), so copies are left out of the cheap set.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from copy_lag import load, start_us

CHEAP = frozenset(
    {
        "aten::alias",
        "aten::as_strided",
        "aten::detach",
        "detach",
        "aten::empty",
        "aten::empty_strided",
        "aten::expand",
        "aten::narrow",
        "aten::permute",
        "aten::reshape",
        "aten::_reshape_alias",
        "aten::select",
        "aten::slice",
        "aten::split",
        "aten::squeeze",
        "aten::t",
        "aten::transpose",
        "aten::unsqueeze",
        "aten::view",
        "cudaEventRecord",
        "cudaLaunchKernel",
        "cudaStreamWaitEvent",
    }
)
"""Operators and runtime calls that take microseconds of CPU when their thread runs."""


@dataclass(frozen=True)
class Stall:
    """One cheap operator that took long: when it began (ms from the trace's first event),
    how long it took (ms), its name and the outermost operator of its thread around it."""

    at_ms: float
    ms: float
    name: str
    inside: str


def issuing_threads(spans: list[dict[str, Any]]) -> dict[str, set[Any]]:
    """The trace's main thread(s) (ran ``Optimizer.step``) and backward thread(s) (ran an
    ``autograd::engine`` function), by thread id."""
    out: dict[str, set[Any]] = {"main": set(), "backward": set()}
    for e in spans:
        name = str(e.get("name", ""))
        if name.startswith("Optimizer.step"):
            out["main"].add(e.get("tid"))
        elif name.startswith("autograd::engine::evaluate_function"):
            out["backward"].add(e.get("tid"))
    out["backward"] -= out["main"]
    return out


def stalls(events: list[dict[str, Any]], over_ms: float) -> dict[str, tuple[int, list[Stall]]]:
    """Per issuing thread kind (``main``, ``backward``): how many cheap operators it ran,
    and those that took over ``over_ms``, in time order (one nested in another that is
    kept, such as the ``as_strided`` of an ``unsqueeze``, is the same wait: left out)."""
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    t0 = start_us(events)
    out: dict[str, tuple[int, list[Stall]]] = {}
    for kind, tids in issuing_threads(spans).items():
        mine = sorted(
            (e for e in spans if e.get("tid") in tids), key=lambda e: (e["ts"], -e["dur"])
        )
        cheap = [e for e in mine if e.get("name") in CHEAP]
        found = []
        until = -1.0  # the end of the last stall kept: one nested in it is the same wait
        for e in cheap:
            begin, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
            if float(e["dur"]) <= over_ms * 1e3 or end <= until:
                continue
            until = end
            around = [
                o
                for o in mine
                if o is not e
                and o.get("name") not in CHEAP
                and float(o["ts"]) <= begin
                and float(o["ts"]) + float(o["dur"]) >= end
            ]
            outer = max(around, key=lambda o: float(o["dur"]))["name"] if around else "-"
            found.append(Stall((begin - t0) / 1e3, float(e["dur"]) / 1e3, e["name"], outer))
        out[kind] = (len(cheap), found)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", type=Path)
    parser.add_argument("--over-ms", type=float, default=1.0)
    args = parser.parse_args(argv)
    if not args.over_ms > 0:
        parser.error(f"--over-ms must be > 0, got {args.over_ms}")
    for path in args.traces:
        found = stalls(load(path), args.over_ms)
        parts = []
        for kind, (count, long) in found.items():
            total = sum(s.ms for s in long)
            parts.append(
                f"{kind}: {count} cheap operators, {len(long)} over {args.over_ms:g} ms "
                f"({total:.1f} ms)"
            )
        print(f"{path.name}: " + "; ".join(parts))
        for kind, (_, long) in found.items():
            for s in long:
                print(f"    {kind} {s.at_ms:8.1f} ms: {s.name} {s.ms:.1f} ms, in {s.inside}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
