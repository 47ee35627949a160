"""The host worker's region steps in a profiled run, step by step, from its trace.

    python benchmarks/host_timeline.py benchmarks/results/s23c4_trace_W4_ours_io_stream.json.gz

Reads a ``torch.profiler`` Chrome trace that ``offload_bench.py --profile-dir`` saved
(``trace_<workload>_<kind>.json.gz``). The backward passes are the CPU-side spans of the
autograd engine's thread (its ``autograd::engine::evaluate_function`` ops, merged where
less than ``--gap-ms`` apart); the host worker is the thread of the ``host step`` and
``streamed step`` annotations. It ends with the host worker's time issuing streamed
regions per profiled step and the ring chunks issued (fused Adam launches inside those
spans), and, with ``--workload``, the median rates of speculative and plain host steps.
``--engines`` also prints, for each step's phases (backward's CPU side; from its end to
the end of the host worker's last region step; from there to the last streamed region's
publish), how long each took and how busy the copy engines (H2D, D2H), the kernels and
backward's thread were in it, and when ``step()`` ran; ``--contended OP`` the median time
of operator ``OP`` while a host region step ran and otherwise (does the host step slow
issuing?).
For each backward it prints, in ms from the trace's start:
how many regions its hooks stepped speculatively (``speculative step`` spans, fp16 with
``speculate_fp16``) and when; when backward's CPU side ran, when the host worker's first
and last other region work of that step ran (until the next backward), how many regions
were stepped by the hooks of regions landing after the answer (and how many of those were
streamed regions only issued there), how many step()'s task stepped or issued, and, with
``--spans``, every span.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace, union_us

HOOK_MARK = "(landed after the answer)"
FUSED_ADAM_OPS = ("aten::_fused_adamw_", "aten::_fused_adam_")
ENGINES = (("H2D", "HtoD"), ("D2H", "DtoH"))
MIN_STEP_MS = 2.0
"""Host-step spans shorter than this only commit a speculative step or publish."""


def load(path: Path) -> list[dict[str, Any]]:
    """The complete-span (``X``) events of a Chrome trace (``step_trace.load_trace``)."""
    doc: Any = load_trace(path)
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
    parser.add_argument(
        "--spans", action="store_true", help="print every host worker span (speculative too)"
    )
    parser.add_argument(
        "--engines", action="store_true", help="print each phase's copy-engine and kernel time"
    )
    parser.add_argument(
        "--contended",
        action="append",
        default=[],
        metavar="OP",
        help="print OP's median time during host region steps and otherwise (repeatable)",
    )
    parser.add_argument(
        "--workload",
        default=None,
        help="the trace's workload (W1-W4): also print the median rate of speculative and "
        "of plain host steps, with region sizes from its traced profile",
    )
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

    groups = engine_groups(events) if args.engines else {}
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
            if args.spans:
                for e in spec:
                    print(f"  {ms(float(e['ts'])):9.1f} {float(e['dur']) / 1e3:6.1f} {e['name']}")
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
        if args.engines:
            steps = [e for e in mine if str(e["name"]).startswith("host step")]
            last_step = max(
                (
                    float(e["ts"]) + float(e["dur"])
                    for e in steps
                    if float(e["dur"]) >= MIN_STEP_MS * 1e3
                ),
                default=b_end,
            )
            publishes = [float(e["ts"]) for e in mine if str(e["name"]).endswith("(publish)")]
            phases = [("backward (CPU side)", b_start, b_end)]
            phases.append(("then to the host's last region step", b_end, last_step))
            if publishes and max(publishes) > last_step:
                phases.append(("then to the last streamed publish", last_step, max(publishes)))
            for label, a, b in phases:
                print("  " + phase_engines(groups, label, a, b))
            for e in region_spans(events, ("Optimizer.step#",)):
                if b_start <= float(e["ts"]) < until:
                    start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
                    print(f"  step(): {ms(start):.0f}-{ms(end):.0f} ms")
    print_issue_cost(events, len(windows))
    if args.workload is not None:
        print_step_rates(events, args.workload)
    for op in args.contended:
        print(contended(events, op))
    return 0


def _busy_ms(events: list[dict[str, Any]], a: float, b: float) -> float:
    """Union of ``events``' spans clipped to [a, b), in ms."""
    return (
        union_us(
            [
                (max(float(e["ts"]), a), min(float(e["ts"]) + float(e["dur"]), b))
                for e in events
                if float(e["ts"]) < b and float(e["ts"]) + float(e["dur"]) > a
            ]
        )
        / 1e3
    )


def engine_groups(events: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """What ``--engines`` sums per phase, picked out of ``events`` once: each copy
    engine's copies (``ENGINES``), the kernels, and backward's thread's operators."""
    copies = [e for e in events if e.get("cat") == "gpu_memcpy"]
    groups = {name: [e for e in copies if tag in str(e["name"])] for name, tag in ENGINES}
    groups["kernels"] = [e for e in events if e.get("cat") == "kernel"]
    autograd = {e["tid"] for e in events if str(e.get("name", "")).startswith("autograd::engine::")}
    groups["backward's thread"] = [
        e for e in events if e.get("cat") == "cpu_op" and e["tid"] in autograd
    ]
    return groups


def phase_engines(groups: dict[str, list[dict[str, Any]]], label: str, a: float, b: float) -> str:
    """One ``--engines`` line: phase [a, b) (trace microseconds) and each of
    :func:`engine_groups`' busy time in it."""
    parts = ", ".join(f"{name} {_busy_ms(group, a, b):.0f}" for name, group in groups.items())
    return f"{label}: {(b - a) / 1e3:.0f} ms; busy (ms): {parts}"


def contended(events: list[dict[str, Any]], op: str) -> str:
    """``--contended``: ``op``'s median time while a host region step (``host step`` or
    ``speculative step`` of at least ``MIN_STEP_MS``) ran, and otherwise."""
    steps = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]))
        for e in region_spans(events, ("host step", "speculative step"))
        if float(e["dur"]) >= MIN_STEP_MS * 1e3
    ]
    during: list[float] = []
    otherwise: list[float] = []
    for e in events:
        if e.get("cat") != "cpu_op" or e["name"] != op:
            continue
        a, b = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        (during if any(x < b and y > a for x, y in steps) else otherwise).append(float(e["dur"]))

    def med(xs: list[float]) -> str:
        return f"{statistics.median(xs):.0f} us (n={len(xs)})" if xs else "- (n=0)"

    return f"{op}: median {med(during)} during host region steps, {med(otherwise)} otherwise"


def print_issue_cost(events: list[dict[str, Any]], steps: int) -> None:
    """The host worker's time issuing streamed regions (``streamed step N (issue)``
    spans) per profiled step, and the ring chunks issued in them (one fused Adam launch
    per chunk)."""
    issues = [e for e in region_spans(events, ("streamed step",)) if e["name"].endswith("(issue)")]
    if not issues or steps < 1:
        return
    fused = sorted(
        float(e["ts"])
        for e in events
        if e.get("cat") == "cpu_op" and str(e.get("name")) in FUSED_ADAM_OPS
    )
    chunks = sum(
        1 for t in fused for e in issues if float(e["ts"]) <= t < float(e["ts"]) + float(e["dur"])
    )
    total_ms = sum(float(e["dur"]) for e in issues) / 1e3
    print(
        f"issuing streamed regions: {total_ms / steps:.0f} ms per profiled step for "
        f"{len(issues) / steps:.0f} regions in {chunks / steps:.0f} ring chunks "
        f"({total_ms / max(1, chunks):.2f} ms per chunk)"
    )


def print_step_rates(events: list[dict[str, Any]], workload: str) -> None:
    """Median Gparam/s of the speculative and of the plain host steps of at least
    ``MIN_STEP_MS`` (shorter ones only commit or publish), region sizes from the
    workload's traced profile."""
    from replay_bench import workload_profile

    from offload_solver import SimulationContext, default_hardware

    numel = SimulationContext.build(workload_profile(workload), default_hardware()).numel
    rates: dict[str, list[float]] = {"speculative": [], "host": []}
    for e in region_spans(events, ("speculative step", "host step")):
        m = re.fullmatch(r"(speculative|host) step (\d+)", str(e["name"]))
        seconds = float(e["dur"]) / 1e6
        if m is None or seconds * 1e3 < MIN_STEP_MS:
            continue
        rates[m.group(1)].append(numel[int(m.group(2))] / seconds / 1e9)
    for kind, values in rates.items():
        if values:
            print(
                f"{kind} steps: {len(values)}, median {statistics.median(values):.2f} Gparam/s "
                f"({min(values):.2f}-{max(values):.2f})"
            )


if __name__ == "__main__":
    raise SystemExit(main())
