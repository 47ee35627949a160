"""What two profiled rows of one run issue per step, side by side (CPU only).

    python benchmarks/issue_compare.py prof/trace_W1_ours.json.gz prof/trace_W1_full_gpu.json.gz

Reads two ``torch.profiler`` traces that ``offload_bench.py --profile-dir`` kept (two
steps each, every thread recorded) and compares their second step: the window from the
end of the first ``Optimizer.step`` span to the end of the second (zero_grad, forward,
backward and the optimizer step). For each thread that ran operators in the window it
prints the top-level operators' count and busy time (ms) and the CUDA runtime and driver
calls; then the device's busy time; then the operators whose top-level time differs most
between the two traces (ms, count); with ``--kernels``, the kernels launched in the window
whose device time differs most (ms, each trace's ms, count), matched to their launch by
correlation id, as the device runs behind the host.

Launch-bound workloads (W1) take as long as their host takes to issue, and how long one
operator takes to issue changes by up to 1.7x between runs on a shared machine (session
26: 33.5 against 56.6 ms of the main thread's operators for one program). Two rows of one
run, profiled minutes apart, are what can be set side by side; the ratio of their busy
times says how much more one issues than the other, whatever the machine's speed then.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_trace import load_trace, union_us

HOST_CATS = ("cuda_runtime", "cuda_driver")
DEVICE_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


@dataclass
class ThreadIssue:
    """One thread's issuing in the window (times in ms)."""

    ops: int = 0
    busy_ms: float = 0.0
    runtime_calls: int = 0
    by_name_ms: Counter[str] = field(default_factory=Counter)
    by_name_count: Counter[str] = field(default_factory=Counter)


@dataclass
class StepIssue:
    """The second profiled step of a trace: its window and what was issued in it."""

    window_ms: float
    device_busy_ms: float
    kernels: int
    threads: dict[int, ThreadIssue]
    kernel_ms: Counter[str] = field(default_factory=Counter)
    """Device time per kernel name (every stream), ms, of the kernels launched in the
    window (matched to their launch by the trace's correlation ids)."""
    kernel_count: Counter[str] = field(default_factory=Counter)

    @property
    def total(self) -> ThreadIssue:
        t = ThreadIssue()
        for th in self.threads.values():
            t.ops += th.ops
            t.busy_ms += th.busy_ms
            t.runtime_calls += th.runtime_calls
            t.by_name_ms.update(th.by_name_ms)
            t.by_name_count.update(th.by_name_count)
        return t


def _top_level(spans: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The spans not nested in an earlier one of the same thread."""
    out: list[dict[str, Any]] = []
    end = -1.0
    for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
        if e["ts"] >= end:
            out.append(e)
            end = e["ts"] + e["dur"]
    return out


def second_step(trace: dict[str, Any]) -> StepIssue:
    """What ``trace``'s second step issued (see the module docstring)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    steps = sorted(
        (
            e
            for e in events
            if e.get("cat") == "user_annotation" and e["name"].startswith("Optimizer.step#")
        ),
        key=lambda e: e["ts"],
    )
    if len(steps) < 2:
        raise SystemExit(
            f"{len(steps)} Optimizer.step spans in the trace; two profiled steps are needed"
        )
    t0 = steps[0]["ts"] + steps[0]["dur"]
    t1 = steps[1]["ts"] + steps[1]["dur"]
    inside = [e for e in events if t0 <= e["ts"] < t1]
    threads: dict[int, ThreadIssue] = {}
    for tid in sorted({e["tid"] for e in inside if e.get("cat") == "cpu_op"}):
        ops = _top_level([e for e in inside if e["tid"] == tid and e.get("cat") == "cpu_op"])
        th = ThreadIssue(
            ops=len(ops),
            busy_ms=union_us([(e["ts"], e["ts"] + e["dur"]) for e in ops]) / 1e3,
            runtime_calls=sum(1 for e in inside if e["tid"] == tid and e.get("cat") in HOST_CATS),
        )
        for e in ops:
            th.by_name_ms[e["name"]] += e["dur"] / 1e3
            th.by_name_count[e["name"]] += 1
        threads[tid] = th
    device = [(e["ts"], e["ts"] + e["dur"]) for e in inside if e.get("cat") in DEVICE_WORK]
    step = StepIssue(
        window_ms=(t1 - t0) / 1e3,
        device_busy_ms=union_us(device) / 1e3,
        kernels=len(device),
        threads=threads,
    )
    # Kernels by when they were launched, not when they ran: the device runs behind.
    launched = {
        e["args"]["correlation"]
        for e in inside
        if e.get("cat") in HOST_CATS and "correlation" in e.get("args", {})
    }
    for e in events:
        if e.get("cat") == "kernel" and e.get("args", {}).get("correlation") in launched:
            step.kernel_ms[e["name"]] += e["dur"] / 1e3
            step.kernel_count[e["name"]] += 1
    return step


def compare_kernels(a: StepIssue, b: StepIssue, names: tuple[str, str], top: int) -> list[str]:
    """The kernels whose device time differs most between ``a`` and ``b`` (``--kernels``)."""
    ka, kb = sum(a.kernel_ms.values()), sum(b.kernel_ms.values())
    lines = [
        f"kernels: {names[0]} {ka:.1f} ms ({a.kernels} device tasks), {names[1]} {kb:.1f} ms; "
        f"{names[0]} minus {names[1]} (ms, count):"
    ]
    diff = {n: a.kernel_ms[n] - b.kernel_ms[n] for n in a.kernel_ms | b.kernel_ms}
    for n in sorted(diff, key=lambda n: -abs(diff[n]))[:top]:
        lines.append(
            f"  {diff[n]:+7.2f} ms ({a.kernel_ms[n]:6.2f} / {b.kernel_ms[n]:6.2f})  "
            f"{a.kernel_count[n]:5d} / {b.kernel_count[n]:<5d} {n[:90]}"
        )
    return lines


def compare(a: StepIssue, b: StepIssue, names: tuple[str, str], top: int) -> list[str]:
    """The lines this script prints for traces ``a`` and ``b`` (called ``names``)."""
    lines = []
    for name, s in zip(names, (a, b), strict=True):
        lines.append(
            f"{name}: step window {s.window_ms:.1f} ms (profiled), device busy "
            f"{s.device_busy_ms:.1f} ms ({s.kernels} kernels and copies)"
        )
        for tid, th in s.threads.items():
            lines.append(
                f"  thread {tid}: {th.ops} top-level operators busy {th.busy_ms:.1f} ms, "
                f"{th.runtime_calls} CUDA runtime/driver calls"
            )
    ta, tb = a.total, b.total
    lines.append(
        f"{names[0]} / {names[1]}: window {a.window_ms / b.window_ms:.2f}x, operators "
        f"{ta.ops} / {tb.ops}, busy {ta.busy_ms:.1f} / {tb.busy_ms:.1f} ms "
        f"({ta.busy_ms / tb.busy_ms:.2f}x), runtime calls {ta.runtime_calls} / "
        f"{tb.runtime_calls}"
    )
    diff = {n: ta.by_name_ms[n] - tb.by_name_ms[n] for n in ta.by_name_ms | tb.by_name_ms}
    lines.append(f"top-level operators, {names[0]} minus {names[1]} (ms, count):")
    for n in sorted(diff, key=lambda n: -abs(diff[n]))[:top]:
        lines.append(
            f"  {diff[n]:+7.2f} ms  {ta.by_name_count[n]:5d} / {tb.by_name_count[n]:<5d} {n[:70]}"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace_a", type=Path, help="e.g. trace_W1_ours.json.gz")
    parser.add_argument("trace_b", type=Path, help="e.g. trace_W1_full_gpu.json.gz")
    parser.add_argument("--top", type=int, default=12, help="operators to list")
    parser.add_argument(
        "--kernels",
        action="store_true",
        help="also list the kernels whose device time differs most (every stream)",
    )
    args = parser.parse_args(argv)
    names = (
        f"{args.trace_a.parent.name}/{args.trace_a.name}",
        f"{args.trace_b.parent.name}/{args.trace_b.name}",
    )
    a, b = (second_step(load_trace(p)) for p in (args.trace_a, args.trace_b))
    print("\n".join(compare(a, b, names, args.top)))
    if args.kernels:
        print("\n".join(compare_kernels(a, b, names, args.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
