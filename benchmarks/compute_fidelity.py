"""The simulator's forward and backward compute against a profiled run's kernels.

    python benchmarks/compute_fidelity.py benchmarks/results/s34c4_W3.json \\
        benchmarks/results/s34c4_trace_W3.json.gz

The simulator prices each traced operation as the largest of its FLOPs over the achieved
matmul rate, its estimated device-memory traffic over the memory bandwidth, and the cost
of issuing it ([Note: memory-bound operations] in ``offload_solver.model``). This sets the
sums of those prices over a step's forward and over its backward (the "compute alone" of
``plan_predict.py``, with the row's own profile: ``peak_tflops``, ``efficiency``,
``op_overhead_us``, ``device_memory_tbps``) beside what the GPU ran in the profiled steps
of ``offload_bench.py --profile-dir``'s trace of that row.

Measured, per profiled step: the kernels on the compute stream (the stream that ran the
most kernel time), split by the thread that launched them. Kernels launched by the
autograd engine's threads (those that ran ``autograd::engine::evaluate_function``) are
the backward's; the others, launched after the previous backward's call and before this
one's, the forward's, leaving out optimizer kernels (``OPTIMIZER_KERNELS``). Each side is
reported as kernel time (busy) and as the span from its first kernel's start to its last
kernel's end; the span also holds the waits for uploads and for the host, so the busy
time is the comparison for the compute model. Kernels time themselves on the device, so
the profiler's own overhead on the CPU does not enter them. Nothing is allocated; no GPU
is needed (the model is traced on the meta device).
"""

from __future__ import annotations

import argparse
import bisect
import json
import re
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_predict import add_compute_model_args
from step_trace import load_trace

BACKWARD_OP_PREFIX = "autograd::engine::evaluate_function"
OPTIMIZER_KERNELS = ("multi_tensor_apply", "fused_adam", "_fused_adamw", "FusedAdam")
"""Kernel-name fragments of optimizer steps (device-state regions' fused Adam), which are
neither forward nor backward."""
GAP_MS = 2.0
"""Idle gaps of the compute stream shorter than this between a side's kernels are not
listed (``Side.gaps_ms``)."""


@dataclass(frozen=True)
class Side:
    """One side (forward or backward) of one profiled step, in ms."""

    busy_ms: float
    span_ms: float
    kernels: int
    by_op: dict[str, float]
    """Kernel time (ms) by the outermost ``aten::`` operator that launched it (``?``
    where none encloses the launch)."""
    gaps_ms: tuple[float, ...] = ()
    """The compute stream's idle gaps of at least ``GAP_MS`` between the side's kernels,
    in order (waits for uploads or for the host)."""


@dataclass(frozen=True)
class StepCompute:
    """What the compute stream ran for one profiled step."""

    forward: Side
    backward: Side
    call_lag_ms: float = 0.0
    """From backward's call on the CPU to its first kernel's start on the device: how far
    the CPU ran ahead of the GPU."""
    forward_after_call_ms: float = 0.0
    """Forward kernel time that ran after backward's call (launched before it)."""


def _side(kernels: list[tuple[dict[str, Any], str]]) -> Side:
    """``kernels``: (kernel event, the operator that launched it)."""
    if not kernels:
        return Side(0.0, 0.0, 0, {})
    start = min(k["ts"] for k, _ in kernels)
    end = max(k["ts"] + k["dur"] for k, _ in kernels)
    by_op: dict[str, float] = {}
    gaps: list[float] = []
    done = start
    for k, op in sorted(kernels, key=lambda ko: ko[0]["ts"]):
        by_op[op] = by_op.get(op, 0.0) + k["dur"] / 1e3
        if (k["ts"] - done) / 1e3 >= GAP_MS:
            gaps.append((k["ts"] - done) / 1e3)
        done = max(done, k["ts"] + k["dur"])
    busy = sum(k["dur"] for k, _ in kernels) / 1e3
    return Side(busy, (end - start) / 1e3, len(kernels), by_op, tuple(gaps))


class _Launchers:
    """The outermost ``aten::`` operator around a launch, per thread (a sweep keeps the
    operators not nested in another, then a bisection finds the one around a time)."""

    def __init__(self, spans: list[dict[str, Any]]) -> None:
        by_tid: dict[Any, list[dict[str, Any]]] = {}
        for e in sorted(spans, key=lambda e: (e["ts"], -e["dur"])):
            if e.get("cat") != "cpu_op" or not str(e.get("name", "")).startswith("aten::"):
                continue
            top = by_tid.setdefault(e["tid"], [])
            if not top or e["ts"] >= top[-1]["ts"] + top[-1]["dur"]:
                top.append(e)
        self._top = by_tid
        self._starts = {tid: [e["ts"] for e in ops] for tid, ops in by_tid.items()}

    def op(self, launch: dict[str, Any]) -> str:
        ops = self._top.get(launch["tid"], [])
        i = bisect.bisect_right(self._starts.get(launch["tid"], []), launch["ts"]) - 1
        if i < 0 or launch["ts"] > ops[i]["ts"] + ops[i]["dur"]:
            return "?"
        return str(ops[i]["name"])[len("aten::") :]


def measured_steps(events: list[dict[str, Any]]) -> list[StepCompute]:
    """The forward and backward kernels of each profiled step (``events``: a Chrome
    trace's ``traceEvents``), one entry per backward pass in the trace, in order."""
    spans = [e for e in events if e.get("ph") == "X" and "ts" in e and "dur" in e]
    backward_ops = sorted(
        (e for e in spans if str(e.get("name", "")).startswith(BACKWARD_OP_PREFIX)),
        key=lambda e: e["ts"],
    )
    backward_tids = {e["tid"] for e in backward_ops}
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if not backward_ops or not kernels:
        return []
    busy_by_stream: dict[Any, float] = {}
    for k in kernels:
        busy_by_stream[k["tid"]] = busy_by_stream.get(k["tid"], 0.0) + k["dur"]
    compute = max(busy_by_stream, key=lambda s: busy_by_stream[s])
    launches = {
        e["args"]["correlation"]: e
        for e in spans
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    # Backward passes: a new one begins where a forward kernel was launched between the
    # end of the last backward op and the start of this one.
    forward_launches = sorted(
        launches[k["args"]["correlation"]]["ts"]
        for k in kernels
        if k["tid"] == compute
        and k.get("args", {}).get("correlation") in launches
        and launches[k["args"]["correlation"]]["tid"] not in backward_tids
    )
    calls: list[float] = []
    last_end = float("-inf")
    for op in backward_ops:
        if not calls or bisect.bisect_left(forward_launches, op["ts"]) > bisect.bisect_right(
            forward_launches, last_end
        ):
            calls.append(op["ts"])
        last_end = max(last_end, op["ts"] + op["dur"])
    launchers = _Launchers(spans)
    steps: list[StepCompute] = []
    bounds = [*calls, float("inf")]
    for i, call in enumerate(calls):
        prev = calls[i - 1] if i else float("-inf")
        fwd: list[tuple[dict[str, Any], str]] = []
        bwd: list[tuple[dict[str, Any], str]] = []
        for k in kernels:
            launch = launches.get(k.get("args", {}).get("correlation"))
            if k["tid"] != compute or launch is None:
                continue
            if any(part in k["name"] for part in OPTIMIZER_KERNELS):
                continue
            if launch["tid"] in backward_tids:
                if call <= launch["ts"] < bounds[i + 1]:
                    bwd.append((k, launchers.op(launch)))
            elif prev <= launch["ts"] < call:
                fwd.append((k, launchers.op(launch)))
        lag = min((k["ts"] for k, _ in bwd), default=call) - call
        after = sum(max(0.0, k["ts"] + k["dur"] - max(k["ts"], call)) for k, _ in fwd)
        steps.append(StepCompute(_side(fwd), _side(bwd), lag / 1e3, after / 1e3))
    return steps


@dataclass(frozen=True)
class Simulated:
    """A workload's forward and backward compute as the simulator prices it, in ms."""

    forward_ms: float
    backward_ms: float
    forward_by_op: dict[str, float]
    backward_by_op: dict[str, float]
    """By the traced operation's kind (its graph node's name without the trailing
    number: ``addmm``, ``view``, ``scaled_dot_product_attention``...)."""
    forward_issue_ms: float
    backward_issue_ms: float
    """The part priced at the issue cost alone (operations whose compute and traffic
    take less: views launch no kernel, so all of theirs)."""


def op_kind(node_name: str) -> str:
    """``addmm_12`` -> ``addmm``: a traced operation's kind from its graph node's name."""
    return re.sub(r"_\d+$", "", node_name)


def simulated(
    workload: str,
    profile: dict[str, Any],
    compute_model: argparse.Namespace | None = None,
    *,
    fuse_gelu: bool = False,
) -> Simulated:
    """``workload``'s forward and backward compute as the simulator prices it with the
    row's ``profile``: every traced operation back to back, with ``compute_model``'s
    options (``plan_predict.add_compute_model_args``). With ``issue_ahead`` each pass's
    total is the one ``HardwareProfile.issue_ahead`` gives (the host issuing ahead of the
    device, ``issued_starts``), and the by-op figures stay the operations' prices.
    ``fuse_gelu``: the workload traced with GPT-2's GELU as one operation, as a row that
    records ``fuse_gelu`` ran it."""
    from plan_predict import replay_hardware, with_compute_model
    from replay_bench import workload_profile

    from offload_solver.simulators._engine import issued_starts

    ops = workload_profile(workload, fuse_gelu=fuse_gelu).operations
    hw = replay_hardware(
        op_overhead_us=profile["op_overhead_us"],
        host_convert_gelem=profile.get("host_convert_gelem", 0.0),
        peak_tflops=profile["peak_tflops"],
        efficiency=profile["efficiency"],
        hbm_tbps=profile.get("device_memory_tbps"),
    )
    if compute_model is not None:
        hw = with_compute_model(hw, compute_model)
    totals = {"fwd": 0.0, "bwd": 0.0}
    issue = {"fwd": 0.0, "bwd": 0.0}
    by_op: dict[str, dict[str, float]] = {"fwd": {}, "bwd": {}}
    device: dict[str, list[float]] = {"fwd": [], "bwd": []}
    for op in ops:
        for side in ("fwd", "bwd"):
            device_s = hw.operation_device_s(op, backward=side == "bwd")
            device[side].append(device_s)
            ms = max(device_s, hw.op_overhead_s) * 1e3
            totals[side] += ms
            kind = op_kind(op.name)
            by_op[side][kind] = by_op[side].get(kind, 0.0) + ms
            if device_s < hw.op_overhead_s:
                issue[side] += ms
    if hw.issue_ahead:
        totals["fwd"] = issued_starts(device["fwd"], hw.op_overhead_s)[1] * 1e3
        totals["bwd"] = issued_starts(device["bwd"][::-1], hw.op_overhead_s)[1] * 1e3
    return Simulated(
        totals["fwd"], totals["bwd"], by_op["fwd"], by_op["bwd"], issue["fwd"], issue["bwd"]
    )


def row_of(path: Path) -> tuple[str, dict[str, Any]]:
    """The workload and our row (the first ``ours`` kind with a recorded profile) of an
    ``offload_bench.py --json`` file."""
    results = json.loads(path.read_text())["results"]
    for workload, by_kind in results.items():
        for kind, row in by_kind.items():
            if kind.startswith("ours") and row.get("ok") and "profile" in row:
                return workload, row
    raise SystemExit(f"{path}: no row of ours with a recorded profile")


def mean_by_op(steps: list[dict[str, float]]) -> dict[str, float]:
    """Each operator's kernel time per step, averaged over ``steps`` (ms)."""
    ops = {op for step in steps for op in step}
    return {op: sum(step.get(op, 0.0) for step in steps) / len(steps) for op in ops}


def _top(ms_by_op: dict[str, float], n: int) -> str:
    ranked = sorted(ms_by_op.items(), key=lambda kv: -kv[1])[:n]
    return (
        ", ".join(f"{op} {ms:.1f}" for op, ms in ranked) + f" (all: {sum(ms_by_op.values()):.1f})"
    )


def _error(simulated: float, measured: float) -> str:
    return f"{(simulated / measured - 1) * 100:+.1f}%" if measured > 0 else "-"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("row", type=Path, help="offload_bench.py --json output of the run")
    parser.add_argument("trace", type=Path, help="the trace its --profile-dir saved")
    add_compute_model_args(parser, "price")
    parser.add_argument(
        "--by-op",
        type=int,
        default=0,
        metavar="N",
        help="also print the N largest operators of each side, measured and simulated",
    )
    args = parser.parse_args(argv)
    workload, row = row_of(args.row)
    doc: Any = load_trace(args.trace)
    events = doc["traceEvents"] if isinstance(doc, dict) else doc
    steps = measured_steps(events)
    if not steps:
        print(f"{args.trace}: no backward pass or no kernels in the trace", file=sys.stderr)
        return 1
    sim = simulated(workload, row["profile"], args, fuse_gelu=bool(row.get("fuse_gelu")))
    print(f"{args.row.name} ({workload}) against {args.trace.name}, {len(steps)} profiled steps")
    print(
        "| step | forward busy / span (kernels) | backward busy / span (kernels) "
        "| backward's first kernel after its call; forward kernels after the call "
        f"| forward's idle gaps of {GAP_MS:g} ms or more |"
    )
    print("|---|---|---|---|---|")
    for i, s in enumerate(steps, 1):
        gaps = ", ".join(f"{g:.1f}" for g in s.forward.gaps_ms) or "-"
        print(
            f"| {i} | {s.forward.busy_ms:.1f} / {s.forward.span_ms:.1f} ms ({s.forward.kernels}) "
            f"| {s.backward.busy_ms:.1f} / {s.backward.span_ms:.1f} ms ({s.backward.kernels}) "
            f"| {s.call_lag_ms:.1f}; {s.forward_after_call_ms:.1f} ms | {gaps} |"
        )
    fwd = statistics.median(s.forward.busy_ms for s in steps)
    bwd = statistics.median(s.backward.busy_ms for s in steps)
    print(
        f"simulated: forward {sim.forward_ms:.1f} ms ({_error(sim.forward_ms, fwd)} against the "
        f"median busy {fwd:.1f}; {sim.forward_issue_ms:.1f} of it at the issue cost alone), "
        f"backward {sim.backward_ms:.1f} ms ({_error(sim.backward_ms, bwd)} against {bwd:.1f}; "
        f"{sim.backward_issue_ms:.1f} at the issue cost alone)"
    )
    if args.by_op:
        for name, measured, priced in (
            ("forward", [s.forward.by_op for s in steps], sim.forward_by_op),
            ("backward", [s.backward.by_op for s in steps], sim.backward_by_op),
        ):
            per_step = mean_by_op(measured)
            print(
                f"{name}, measured per step by outermost aten op (ms): {_top(per_step, args.by_op)}"
            )
            print(f"{name}, simulated by traced op kind (ms): {_top(priced, args.by_op)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
