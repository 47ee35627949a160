"""The host worker's region steps in a profiled run, step by step, from its trace.

    python benchmarks/host_timeline.py benchmarks/results/s23c4_trace_W4_ours_io_stream.json.gz

Reads a ``torch.profiler`` Chrome trace that ``offload_bench.py --profile-dir`` saved
(``trace_<workload>_<kind>.json.gz``). The backward passes are the CPU-side spans of the
autograd engine's thread (its ``autograd::engine::evaluate_function`` ops, merged where
less than ``--gap-ms`` apart); the host worker is the thread of the ``host step`` and
``streamed step`` annotations. For each backward it prints, in ms from the trace's start:
how many regions its hooks stepped speculatively (``speculative step`` spans, fp16 with
``speculate_fp16``) and when; when backward's CPU side ran, when the host worker's first
and last other region work of that step ran (until the next backward), how many regions
were stepped by the hooks of regions landing after the answer (and how many of those were
streamed regions only issued there), how many step()'s task stepped or issued, and, with
``--spans``, every span.
"""

from __future__ import annotations

import argparse
import gzip
import json
from pathlib import Path
from typing import Any

HOOK_MARK = "(landed after the answer)"


def load(path: Path) -> list[dict[str, Any]]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        doc = json.load(f)
    events: list[dict[str, Any]] = doc["traceEvents"] if isinstance(doc, dict) else doc
    return [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]


def region_spans(events: list[dict[str, Any]], prefixes: tuple[str, ...]) -> list[dict[str, Any]]:
    """The CPU-side ``record_function`` spans whose names start with ``prefixes``, by start."""
    return sorted(
        (
            e
            for e in events
            if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith(prefixes)
        ),
        key=lambda e: float(e["ts"]),
    )


def extent(spans: list[dict[str, Any]]) -> tuple[float, float]:
    """(first start, last end) of time-ordered spans, in the trace's microseconds."""
    return float(spans[0]["ts"]), max(float(e["ts"]) + float(e["dur"]) for e in spans)


def backward_windows(events: list[dict[str, Any]], gap_us: float) -> list[tuple[float, float]]:
    """CPU-side spans of backward: the autograd thread's ops, merged across small gaps."""
    ops = [e for e in events if str(e.get("name", "")).startswith("autograd::engine::")]
    if not ops:
        return []
    tids = {e["tid"] for e in ops}
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e["tid"] in tids
    )
    windows: list[tuple[float, float]] = []
    for start, end in spans:
        if windows and start - windows[-1][1] < gap_us:
            windows[-1] = (windows[-1][0], max(windows[-1][1], end))
        else:
            windows.append((start, end))
    return windows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", type=Path)
    parser.add_argument("--gap-ms", type=float, default=50.0)
    parser.add_argument("--spans", action="store_true", help="print every host worker span")
    args = parser.parse_args(argv)
    events = load(args.trace)
    t0 = min(float(e["ts"]) for e in events)
    work = region_spans(events, ("host step", "streamed step"))
    speculative = region_spans(events, ("speculative step",))
    windows = backward_windows(events, args.gap_ms * 1e3)
    if not windows or not work:
        parser.error(f"{args.trace}: no backward or no host worker region spans found")

    def ms(us: float) -> float:
        return (us - t0) / 1e3

    for i, (b_start, b_end) in enumerate(windows):
        until = windows[i + 1][0] if i + 1 < len(windows) else float("inf")
        spec = [e for e in speculative if b_start <= float(e["ts"]) < until]
        if spec:
            s_first, s_last = extent(spec)
            print(
                f"backward {i + 1}: {len(spec)} regions stepped speculatively in their hooks, "
                f"{ms(s_first):.0f}-{ms(s_last):.0f} ms ({(s_first - b_start) / 1e3:.0f} ms "
                f"after backward's CPU side began; "
                f"{sum(float(e['dur']) for e in spec) / 1e3:.0f} ms busy)"
            )
        mine = [e for e in work if b_end <= float(e["ts"]) < until]
        if not mine:
            print(f"backward {i + 1}: {ms(b_start):.0f}-{ms(b_end):.0f} ms, no host work after it")
            continue
        names = [str(e["name"]) for e in mine]
        hooks = [n for n in names if n.startswith("host step") and HOOK_MARK in n]
        hook_regions = {n.split()[2] for n in hooks}
        issued = [n for n in names if n.endswith("(issue)")]
        issued_in_hooks = [n for n in issued if n.split()[2] in hook_regions]
        task_steps = [n for n in names if n.startswith("host step") and HOOK_MARK not in n]
        # Issue to publish of the streamed regions the hooks issued.
        at = {str(e["name"]): float(e["ts"]) for e in mine}
        waits = [
            (at[f"streamed step {r} (publish)"] - at[f"streamed step {r} (issue)"]) / 1e3
            for r in (n.split()[2] for n in issued_in_hooks)
            if f"streamed step {r} (publish)" in at
        ]
        hook_ms = [float(e["dur"]) / 1e3 for e in mine if str(e["name"]) in set(hooks)]
        streamed_hook_ms = [
            float(e["dur"]) / 1e3
            for e in mine
            if HOOK_MARK in str(e["name"])
            and str(e["name"]).split()[2] in {n.split()[2] for n in issued_in_hooks}
        ]
        first, last = extent(mine)
        print(
            f"backward {i + 1}: {ms(b_start):.0f}-{ms(b_end):.0f} ms; host work "
            f"{ms(first):.0f}-{ms(last):.0f} ms ({(first - b_end) / 1e3:.0f} ms after "
            f"backward's CPU side); {len(hooks)} regions in hooks landing after the answer "
            f"({len(issued_in_hooks)} streamed, only issued); step()'s task: "
            f"{len(task_steps)} host steps, {len(issued) - len(issued_in_hooks)} streamed issued"
        )
        if waits:
            other_hooks_ms = sum(hook_ms) - sum(streamed_hook_ms)
            print(
                f"  streamed regions issued in hooks: each hook {min(streamed_hook_ms):.1f}-"
                f"{max(streamed_hook_ms):.1f} ms, published {min(waits):.0f}-{max(waits):.0f} "
                f"ms after issue; the other hooks stepped for {other_hooks_ms:.0f} ms"
            )
        if args.spans:
            for e in mine:
                print(f"  {ms(float(e['ts'])):9.1f} {float(e['dur']) / 1e3:6.1f} {e['name']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
