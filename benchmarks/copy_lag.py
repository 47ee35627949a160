"""How fast copies ran and how long they waited after they were issued, per stream, from a
trace.

    python benchmarks/copy_lag.py TRACE.json.gz [--streams 13,21] [--compute 7]

For a ``torch.profiler`` trace of ``offload_bench.py --profile-dir`` (two profiled steps):
for each stream named (default: every stream that copies), the rate its copies moved
bytes at while they ran, and their lag, from the ``cudaMemcpyAsync`` call that issued
each to its start on the device (ms: median, and the largest with the time they started,
from the trace's first event); then the gaps of more than ``--gap-ms`` between kernels on
the compute stream (default: the stream that ran most kernels), with the time each
began. A prefetch that waits behind other copies shows as a long lag on the runtime's h2d
stream beside a gap in compute ([Note: paced ring] in offload_optim/streamed.py). Stream
numbers are the trace's own; the row's ``profile_streams`` says what each carried.
``--window START:END`` (ms) also prints what every stream ran in that span and each copy
that started in it: what a gap in compute waited behind. ``--publishes`` also prints,
for each streamed region issued in the trace, when its copies down landed and when it was
published (the runtime's next use of the region waits for the publish).
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import statistics
from pathlib import Path
from typing import Any


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's events (gzip or plain JSON)."""
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        events: list[dict[str, Any]] = json.load(f)["traceEvents"]
    return events


def start_us(events: list[dict[str, Any]]) -> float:
    """The trace's first span's start (us): the zero of the times printed."""
    return min(float(e["ts"]) for e in events if e.get("ph") == "X" and "ts" in e)


def runtime_calls(spans: list[dict[str, Any]]) -> dict[Any, tuple[float, Any]]:
    """Each CUDA runtime call's correlation id -> (when it was made: us, trace time; the
    thread that made it)."""
    return {
        e["args"]["correlation"]: (float(e["ts"]), e.get("tid"))
        for e in spans
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }


def issued_at(spans: list[dict[str, Any]]) -> dict[Any, float]:
    """Each CUDA runtime call's correlation id -> when it was made (us, trace time)."""
    return {corr: at for corr, (at, _) in runtime_calls(spans).items()}


def copy_lags(events: list[dict[str, Any]], t0: float) -> dict[str, list[tuple[float, float]]]:
    """Per stream, (lag ms, device start ms from ``t0``) of every copy whose issuing
    runtime call is in the trace."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    issued = issued_at(spans)
    out: dict[str, list[tuple[float, float]]] = collections.defaultdict(list)
    for e in spans:
        if e.get("cat") != "gpu_memcpy":
            continue
        at = issued.get(e.get("args", {}).get("correlation"))
        if at is not None:
            out[str(e["tid"])].append(((float(e["ts"]) - at) / 1e3, (float(e["ts"]) - t0) / 1e3))
    return dict(out)


def copy_rates(events: list[dict[str, Any]]) -> dict[str, tuple[int, float]]:
    """Per stream, (bytes copied, seconds the copies ran) over the trace."""
    out: dict[str, tuple[int, float]] = {}
    for e in events:
        if e.get("cat") == "gpu_memcpy" and e.get("ph") == "X":
            sid = str(e["tid"])
            moved, took = out.get(sid, (0, 0.0))
            out[sid] = (moved + int(e.get("args", {}).get("bytes", 0)), took + e["dur"] / 1e6)
    return out


def compute_gaps(
    events: list[dict[str, Any]], t0: float, stream: str | None, gap_ms: float
) -> tuple[str, list[tuple[float, float]]]:
    """(the compute stream, [(gap start ms from ``t0``, gap ms)]) between its kernels."""
    kernels = [e for e in events if e.get("cat") == "kernel" and e.get("ph") == "X"]
    if stream is None:
        stream = collections.Counter(str(e["tid"]) for e in kernels).most_common(1)[0][0]
    mine = sorted((e for e in kernels if str(e["tid"]) == stream), key=lambda e: e["ts"])
    gaps = []
    for a, b in itertools.pairwise(mine):
        end = float(a["ts"]) + float(a["dur"])
        gap = (float(b["ts"]) - end) / 1e3
        if gap > gap_ms:
            gaps.append(((end - t0) / 1e3, gap))
    return stream, gaps


def window_activity(
    events: list[dict[str, Any]], t0: float, lo: float, hi: float
) -> dict[tuple[str, str], tuple[int, float, float, float]]:
    """Per (stream, kind: ``gpu_memcpy``, ``kernel`` or ``gpu_memset``), what ran on the
    device overlapping ``lo``-``hi`` ms from ``t0``: (how many, busy ms inside the window,
    first start ms, last end ms)."""
    out: dict[tuple[str, str], tuple[int, float, float, float]] = {}
    for e in events:
        cat = e.get("cat")
        if e.get("ph") != "X" or cat not in ("gpu_memcpy", "kernel", "gpu_memset"):
            continue
        a = (float(e["ts"]) - t0) / 1e3
        b = a + float(e["dur"]) / 1e3
        if b <= lo or a >= hi:
            continue
        key = (str(e["tid"]), str(cat))
        n, busy, first, last = out.get(key, (0, 0.0, a, b))
        out[key] = (n + 1, busy + min(b, hi) - max(a, lo), min(first, a), max(last, b))
    return out


def window_copies(
    events: list[dict[str, Any]], t0: float, lo: float, hi: float
) -> list[tuple[str, float, float, float, int]]:
    """Copies that started within ``lo``-``hi`` ms from ``t0``, in start order: (stream,
    issued ms, started ms, ran ms, bytes); issued is NaN where the runtime call is not in
    the trace."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    issued = issued_at(spans)
    out = []
    for e in spans:
        if e.get("cat") != "gpu_memcpy":
            continue
        start = (float(e["ts"]) - t0) / 1e3
        if not lo <= start < hi:
            continue
        at = issued.get(e.get("args", {}).get("correlation"))
        when = float("nan") if at is None else (at - t0) / 1e3
        moved = int(e.get("args", {}).get("bytes", 0))
        out.append((str(e["tid"]), when, start, float(e["dur"]) / 1e3, moved))
    return sorted(out, key=lambda c: c[2])


def publish_lags(
    events: list[dict[str, Any]], t0: float
) -> list[tuple[int, float, float, float, float]]:
    """Each streamed region's issue (a ``streamed step R (issue)`` span) in time order:
    (region, issue start ms, issue end ms, landed ms: the end of the last copy down issued
    by that thread inside the span, published ms: the start of the region's next
    ``streamed step R (publish)`` span), all from ``t0``. Issues without a traced copy
    down or a later publish are left out."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e]
    calls = runtime_calls(spans)
    downs = []  # (issued us, issuing thread, device end us)
    for e in spans:
        if e.get("cat") == "gpu_memcpy" and "DtoH" in str(e.get("name", "")):
            call = calls.get(e.get("args", {}).get("correlation"))
            if call is not None:
                downs.append((call[0], call[1], float(e["ts"]) + float(e["dur"])))
    marks: dict[str, list[dict[str, Any]]] = {"issue": [], "publish": []}
    for e in spans:
        name = str(e.get("name", ""))
        if e.get("cat") == "user_annotation" and name.startswith("streamed step "):
            kind = name.rsplit("(", 1)[-1].rstrip(")")
            if kind in marks:
                marks[kind].append(e)
    out = []
    for issue in sorted(marks["issue"], key=lambda e: float(e["ts"])):
        region = issue["name"].split()[2]
        a = float(issue["ts"])
        b = a + float(issue["dur"])
        ends = [end for at, tid, end in downs if a <= at <= b and tid == issue.get("tid")]
        later = [
            float(p["ts"])
            for p in marks["publish"]
            if p["name"].split()[2] == region and float(p["ts"]) >= a
        ]
        if ends and later:
            out.append(
                (
                    int(region),
                    (a - t0) / 1e3,
                    (b - t0) / 1e3,
                    (max(ends) - t0) / 1e3,
                    (min(later) - t0) / 1e3,
                )
            )
    return out


def _window(text: str) -> tuple[float, float]:
    lo, sep, hi = text.partition(":")
    try:
        a, b = float(lo), float(hi)
    except ValueError:
        a = b = float("nan")
    if not sep or not a < b:  # also refuses NaN
        raise argparse.ArgumentTypeError(f"{text!r}: give START:END in ms, START < END")
    return a, b


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--streams", help="comma-separated stream numbers (default: all)")
    parser.add_argument("--compute", help="the compute stream (default: most kernels)")
    parser.add_argument("--gap-ms", type=float, default=5.0)
    parser.add_argument("--top", type=int, default=3, help="largest lags shown per stream")
    parser.add_argument(
        "--window",
        type=_window,
        metavar="START:END",
        help="also print what each stream ran in this span (ms from the trace's first "
        "span), and each copy that started in it, when it was issued and when it ran",
    )
    parser.add_argument(
        "--publishes",
        action="store_true",
        help="also print each streamed region's landing and publish, and how long it "
        "waited between them",
    )
    args = parser.parse_args(argv)
    events = load(args.trace)
    t0 = start_us(events)
    lags = copy_lags(events, t0)
    rates = copy_rates(events)
    wanted = args.streams.split(",") if args.streams else sorted(lags, key=int)
    for sid in wanted:
        rows = lags.get(sid, [])
        if not rows:
            print(f"stream {sid}: no copies")
            continue
        top = sorted(rows, reverse=True)[: args.top]
        shown = ", ".join(f"{lag:.0f} ms at {at:.0f}" for lag, at in top)
        median = statistics.median(r[0] for r in rows)
        moved, took = rates[sid]
        print(
            f"stream {sid}: {len(rows)} copies, {moved / took / 1e9:.1f} GB/s while copying "
            f"({took * 1e3:.0f} ms), lag median {median:.1f} ms, largest {shown}"
        )
    stream, gaps = compute_gaps(events, t0, args.compute, args.gap_ms)
    listed = ", ".join(f"{g:.0f} ms at {at:.0f}" for at, g in gaps)
    total = sum(g for _, g in gaps)
    print(
        f"compute stream {stream}: {len(gaps)} gaps over {args.gap_ms:g} ms, {total:.0f} ms in "
        f"all: {listed}"
    )
    if args.window is not None:
        lo, hi = args.window
        print(f"{lo:g}-{hi:g} ms:")
        for (sid, cat), (n, busy, first, last) in sorted(
            window_activity(events, t0, lo, hi).items(), key=lambda kv: (int(kv[0][0]), kv[0][1])
        ):
            print(
                f"  stream {sid} {cat}: {n}, {busy:.1f} ms busy in the window, "
                f"{first:.1f}-{last:.1f} ms"
            )
        for sid, when, start, ran, moved in window_copies(events, t0, lo, hi):
            if wanted and sid not in wanted:
                continue
            print(
                f"  copy on {sid}: issued {when:.1f}, ran {start:.1f}-{start + ran:.1f} ms, "
                f"{moved / 1e6:.1f} MB, lag {start - when:.1f} ms"
            )
    if args.publishes:
        waits = []
        for region, a, b, landed, published in publish_lags(events, t0):
            waits.append(published - landed)
            print(
                f"  streamed region {region}: issued {a:.1f}-{b:.1f}, landed {landed:.1f}, "
                f"published {published:.1f} ms (+{published - landed:.1f})"
            )
        if waits:
            print(
                f"publishes: {len(waits)}, {statistics.median(waits):.1f} ms after landing "
                f"by the median, {max(waits):.1f} at most, {sum(waits):.0f} ms in all"
            )
        else:
            print("publishes: no streamed region issued and published in the trace")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
