"""Where an offloaded training step spends its time: phases, streams and a profiler trace.

For one workload and each solver asked for, on a CUDA machine:

    python benchmarks/step_trace.py --model gpt2_xl --batch 64 --seq 8 --budget-gib 3 \
        --solvers syn,asyn --out /tmp/trace

prints per-phase wall times (forward, backward, host gradient work, optimizer step) as
medians over ``--steps`` steps, the controller's counters (synchronous uploads,
prefetches, prefetch fallbacks), and a per-stream summary of one profiled step: how long
each CUDA stream was busy, how much of the copy streams' time overlapped compute, and how
long the compute stream sat idle. The profiled step is also written as a Chrome trace
(``<out>/<solver>.trace.json.gz``) for chrome://tracing or Perfetto.

``summarise_trace`` works on any Chrome trace torch.profiler writes, so a trace can be
summarised again on another machine: ``python benchmarks/step_trace.py --summarise FILE``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

GiB = 2**30


def union_us(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (microseconds)."""
    total = 0.0
    end = -1.0
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def _intersect_us(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length covered by both interval sets (microseconds)."""
    return union_us(a) + union_us(b) - union_us(a + b)


def summarise_trace(trace: dict[str, Any]) -> dict[str, Any]:
    """Per-stream busy time of the device events in a torch.profiler Chrome trace.

    Returns ``{"span_ms", "streams": {stream: {"busy_ms", "kinds"}}, "compute_stream",
    "copy_overlap_ms": {stream: ms overlapped with compute}, "compute_idle_ms"}``, and
    ``"host_steps"`` (:func:`summarise_host_steps`) where the trace has the host worker's
    region steps. The compute stream is the one with the most kernel time.
    """
    by_stream: dict[str, list[tuple[float, float]]] = {}
    kinds: dict[str, dict[str, float]] = {}
    kernel_us: dict[str, float] = {}
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X":
            continue
        cat = str(ev.get("cat", ""))
        if cat not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        stream = str(ev.get("args", {}).get("stream", "?"))
        start = float(ev["ts"])
        dur = float(ev.get("dur", 0.0))
        by_stream.setdefault(stream, []).append((start, start + dur))
        name = str(ev.get("name", ""))
        kind = cat
        if cat == "gpu_memcpy":  # "Memcpy HtoD (Pinned -> Device)": keep the direction
            kind = "memcpy " + (name.split(" ")[1] if " " in name else name)
        kinds.setdefault(stream, {})
        kinds[stream][kind] = kinds[stream].get(kind, 0.0) + dur / 1e3
        if cat == "kernel":
            kernel_us[stream] = kernel_us.get(stream, 0.0) + dur
    host = summarise_host_steps(trace)
    if not by_stream:
        return {"span_ms": 0.0, "streams": {}, **({"host_steps": host} if host["count"] else {})}
    everything = [iv for ivs in by_stream.values() for iv in ivs]
    t0 = min(s for s, _ in everything)
    t1 = max(e for _, e in everything)
    compute = max(kernel_us, key=lambda k: kernel_us[k]) if kernel_us else next(iter(by_stream))
    out: dict[str, Any] = {
        "span_ms": (t1 - t0) / 1e3,
        "compute_stream": compute,
        "streams": {
            s: {
                "busy_ms": union_us(ivs) / 1e3,
                "kinds": {k: round(v, 3) for k, v in kinds[s].items()},
            }
            for s, ivs in by_stream.items()
        },
        "copy_overlap_ms": {
            s: _intersect_us(ivs, by_stream[compute]) / 1e3
            for s, ivs in by_stream.items()
            if s != compute
        },
        "compute_idle_ms": (t1 - t0 - union_us(by_stream[compute])) / 1e3,
    }
    if host["count"]:
        out["host_steps"] = host
    return out


def all_threads_config() -> Any:
    """torch.profiler's setting that records every thread's ranges, not only the
    profiling thread's (``_ExperimentalConfig(profile_all_threads=True)``), for
    ``profile(experimental_config=...)``. The host worker's ``record_function`` ranges are
    on its own thread, and a trace taken without it has none of them. None where this
    torch lacks it (then only the profiling thread)."""
    import torch

    try:
        return torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except (AttributeError, TypeError):
        return None


def count_worker_ranges(config: Any) -> int:
    """How many of three "host step N" ``record_function`` ranges, run on a thread started
    before the profiler (as the runtime's host worker is), a CPU profile with
    ``experimental_config=config`` records."""
    import queue
    import tempfile
    import threading

    import torch
    from torch.profiler import ProfilerActivity, profile

    work: queue.Queue[int | None] = queue.Queue()

    def worker() -> None:
        while (r := work.get()) is not None:
            with torch.profiler.record_function(f"host step {r}"):
                torch.ones(1 << 16).mul_(2).sum()
            work.task_done()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        with profile(activities=[ProfilerActivity.CPU], experimental_config=config) as prof:
            for r in range(3):
                work.put(r)
            work.join()
    finally:
        work.put(None)
        thread.join()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        return int(summarise_host_steps(load_trace(path))["count"])


HOST_STEP_NAMES = ("host step ", "speculative step ")
"""How ``offload_optim`` names its host region steps (``record_function``)."""


def summarise_host_steps(trace: dict[str, Any]) -> dict[str, Any]:
    """The host worker's region steps in a Chrome trace (the ranges ``offload_optim`` names
    "host step N ..." and "speculative step N"; recorded only when the profile covered
    every thread): ``{"count", "busy_ms", "first_ms", "last_end_ms"}``, times from the
    trace's first event."""
    events = [ev for ev in trace.get("traceEvents", []) if ev.get("ph") == "X" and "ts" in ev]
    steps = [ev for ev in events if str(ev.get("name", "")).startswith(HOST_STEP_NAMES)]
    if not steps:
        return {"count": 0}
    t0 = min(float(ev["ts"]) for ev in events)
    spans = [(float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0))) for ev in steps]
    return {
        "count": len(steps),
        "busy_ms": union_us(spans) / 1e3,
        "first_ms": (min(a for a, _ in spans) - t0) / 1e3,
        "last_end_ms": (max(b for _, b in spans) - t0) / 1e3,
    }


def summarise_backward(
    trace: dict[str, Any], compute: str, gap_us: float = 300.0, hook_us: float = 500.0
) -> dict[str, Any]:
    """Where backward idles the compute stream, from a torch.profiler Chrome trace.

    From the first compute-stream kernel whose name says backward (``bwd``/``backward``)
    to the stream's last event: its busy time, the idle gaps of at least ``gap_us``
    between its events (count and total), and the CPU ``AccumulateGrad`` events longer
    than ``hook_us`` (count and total: those that ran a region's gradient hooks, on the
    thread that drives backward). Times in ms; empty when no backward kernel is found.
    """
    events = [ev for ev in trace.get("traceEvents", []) if ev.get("ph") == "X"]
    device = sorted(
        (float(ev["ts"]), float(ev["ts"]) + float(ev.get("dur", 0.0)), str(ev.get("name", "")))
        for ev in events
        if ev.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        and str(ev.get("args", {}).get("stream", "?")) == compute
    )
    first = next(
        (s for s, _, name in device if "bwd" in name.lower() or "backward" in name.lower()),
        None,
    )
    if first is None:
        return {}
    tail = [(s, e) for s, e, _ in device if s >= first]
    gaps = []
    reach = tail[0][1]
    for s, e in tail[1:]:
        if s - reach >= gap_us:
            gaps.append(s - reach)
        reach = max(reach, e)
    hooks = [
        float(ev.get("dur", 0.0))
        for ev in events
        if ev.get("name") == "torch::autograd::AccumulateGrad"
        and float(ev.get("dur", 0.0)) > hook_us
    ]
    return {
        "span_ms": (reach - first) / 1e3,
        "compute_busy_ms": union_us(tail) / 1e3,
        "gaps": len(gaps),
        "gaps_ms": sum(gaps) / 1e3,
        "long_accumulate_grad": len(hooks),
        "long_accumulate_grad_ms": sum(hooks) / 1e3,
    }


def summarise_memory(snapshot: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """What was allocated at the peak of a ``torch.cuda.memory._snapshot()`` trace.

    Replays the allocator's event trace (alloc / free_completed) of device 0, finds the
    moment the allocated total peaked (counted from the trace's start, so blocks allocated
    before recording began are not in it), and groups the blocks live at that moment by
    the innermost stack frame outside torch. Returns ``{"peak_mib", "by_site": [(site,
    MiB, count)]}``.
    """
    traces = snapshot.get("device_traces") or [[]]
    live: dict[int, tuple[int, str]] = {}
    total = peak = 0
    at_peak: dict[int, tuple[int, str]] = {}
    for ev in traces[0]:
        action = ev.get("action")
        addr = int(ev.get("addr", 0))
        size = int(ev.get("size", 0))
        if action == "alloc":
            site = "?"
            for fr in ev.get("frames", []):
                name = str(fr.get("filename", ""))
                if name.endswith(".py") and "/torch/" not in name:
                    site = f"{name.rsplit('/', 1)[-1]}:{fr.get('line')} {fr.get('name')}"
                    break
            live[addr] = (size, site)
            total += size
            if total > peak:
                peak = total
                at_peak = dict(live)
        elif action == "free_completed" and addr in live:
            total -= live.pop(addr)[0]
    by_site: dict[str, list[int]] = {}
    for size, site in at_peak.values():
        entry = by_site.setdefault(site, [0, 0])
        entry[0] += size
        entry[1] += 1
    ranked = sorted(by_site.items(), key=lambda kv: -kv[1][0])[:top]
    return {
        "peak_mib": peak / 2**20,
        "by_site": [(site, round(b / 2**20, 1), n) for site, (b, n) in ranked],
    }


def load_trace(path: Path) -> dict[str, Any]:
    """A Chrome trace as torch.profiler writes it, gzipped (``.gz``) or not."""
    if path.suffix == ".gz":
        with gzip.open(path, "rt") as f:
            data: dict[str, Any] = json.load(f)
    else:
        data = json.loads(path.read_text())
    return data


def _median_ms(values: list[float]) -> float:
    return statistics.median(values) * 1e3


def _measure(solver: str, model: Any, data: dict[str, Any], args: argparse.Namespace) -> Any:
    """Phase times, counters and a profiled step of one solver's plan."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from offload_gpt_example.models import lm_loss
    from offload_optim import AMPOptimizer, HybridAdam
    from offload_runtime import memory_optimize

    module = memory_optimize(model, data, int(args.budget_gib * GiB), solver, progress=False)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-5), module)
    phases: dict[str, list[float]] = {"forward": [], "backward": [], "host": [], "step": []}
    torch.cuda.reset_peak_memory_stats()

    def one_step(record: bool) -> None:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = lm_loss(module(**data), data["input_ids"])
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        amp.backward(loss)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        module.controller.wait_host()
        t3 = time.perf_counter()
        amp.step()
        amp.zero_grad()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        if record:
            for key, value in zip(phases, (t1 - t0, t2 - t1, t3 - t2, t4 - t3), strict=True):
                phases[key].append(value)

    for i in range(args.warmup + args.steps):
        one_step(record=i >= args.warmup)
    stats_before = dict(module.controller.stats)
    one_step(record=False)
    per_step = {k: v - stats_before[k] for k, v in module.controller.stats.items()}
    memory: dict[str, Any] = {}
    if args.memory_snapshot:
        torch.cuda.synchronize()
        base_mib = torch.cuda.memory_allocated() / 2**20
        # Python frames only: C++ unwinding is slow and names no line of ours.
        torch.cuda.memory._record_memory_history(max_entries=400_000, stacks="python")
        one_step(record=False)
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        memory = summarise_memory(snapshot)
        memory["allocated_before_step_mib"] = base_mib
    with profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        experimental_config=all_threads_config(),
    ) as prof:
        one_step(record=False)
    out_dir = Path(args.out)
    trace_path = out_dir / f"{solver}.trace.json.gz"
    prof.export_chrome_trace(str(trace_path))  # a ".gz" path: torch writes it gzipped
    trace = load_trace(trace_path)
    plan = module.plan
    streams = summarise_trace(trace)
    result = {
        "phases_ms": {k: round(_median_ms(v), 2) for k, v in phases.items()},
        "total_ms": round(sum(_median_ms(v) for v in phases.values()), 2),
        "controller_per_step": per_step,
        "peak_alloc_gib": torch.cuda.max_memory_allocated() / GiB,
        "pred_step_ms": plan.predicted_step_time_s * 1e3,
        "pred_peak_gib": plan.predicted_peak_bytes / GiB,
        "placements": "".join(rp.placement.value[0] for rp in plan.regions),
        "states": "".join(rp.state.value[0] for rp in plan.regions),
        "streams": streams,
        "backward": summarise_backward(trace, str(streams.get("compute_stream"))),
        "memory_at_peak": memory,
    }
    module.close()
    return result


def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from offload_gpt_example.models import build_model, get_spec, random_batch

    Path(args.out).mkdir(parents=True, exist_ok=True)
    model = build_model(
        args.model, device="cpu", dtype=torch.float16, seq_len=args.seq, init_device="cuda"
    )
    vocab = get_spec(args.model).vocab_size
    data = random_batch(args.batch, args.seq, device="cuda", vocab_size=vocab)
    results: dict[str, Any] = {}
    for solver in args.solvers.split(","):
        results[solver] = _measure(solver, model, data, args)
        print(json.dumps({solver: results[solver]}, indent=1), flush=True)
        torch.cuda.empty_cache()
    (Path(args.out) / "step_trace.json").write_text(json.dumps(results, indent=1))
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt2_xl")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=8)
    parser.add_argument("--budget-gib", type=float, default=3.0)
    parser.add_argument("--solvers", default="syn,asyn")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default="step_trace_out")
    parser.add_argument(
        "--memory-snapshot",
        action="store_true",
        help="record the allocator during one step and report what is live at its peak",
    )
    parser.add_argument("--summarise", default="", help="summarise this Chrome trace and exit")
    parser.add_argument(
        "--check-threads",
        action="store_true",
        help="CPU only: profile a worker thread's three record_function ranges with and "
        "without all_threads_config(), print how many each trace holds, and exit",
    )
    args = parser.parse_args(argv)
    if args.check_threads:
        for name, config in (("default", None), ("all_threads", all_threads_config())):
            print(f"{name}: {count_worker_ranges(config)} of 3 worker ranges recorded")
        return 0
    if args.summarise:
        trace = load_trace(Path(args.summarise))
        streams = summarise_trace(trace)
        streams["backward"] = summarise_backward(trace, str(streams.get("compute_stream")))
        print(json.dumps(streams, indent=1))
        return 0
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
