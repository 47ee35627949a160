"""How far a measured row's plan is from better ones the planner could have made (CPU only).

    python benchmarks/plan_neighbours.py benchmarks/results/s23c1_W4_stream.json \\
        ours_io_bf16m_spec1_stream --stream-up-bytes 8

For one ``offload_bench.py --json`` row this prints the CUDA streams' busy time per
profiled step that the row recorded (``profile_streams``), solves the workload again with
the profile, rates and choices the row recorded (as ``replay_bench.py --host-rate
recorded`` does), and prints:

- the plan: its predicted step and peak, its static device bytes (resident parameters,
  device optimizer state, pool), and the parameters per placement and state;
- the plan after the solver's local search over one-region changes, which is off by
  default ([Note: local search] in ``offload_solver.solvers._polish``: on the GPU its
  plans measured slower than simulated): how far the simulator's own optimum is;
- with ``--stream-up-bytes N``, the plan solved again with streamed regions moving ``N``
  bytes per parameter up instead of the recorded amount (e.g. 8 for a gradient that
  stays on the device), device memory unchanged: an upper bound on that lead's gain;
- the host memory the plan's storage takes (``offload_runtime.storage.required_host_bytes``,
  fp32 moments) against the machine's, and how many parameters' undo buffers for
  speculation fit in the rest of ``SPECULATION_HOST_SHARE`` of the machine (12 bytes per
  parameter with fp32 moments, 8 with bf16). An upper bound:
  ``HybridAdam.prepare_speculation`` takes that share of the memory available then,
  which the process's other allocations lower.

Nothing is allocated; it uses the solver's public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import WORKLOADS
from replay_bench import SPECULATING, row_hardware, row_simulation, workload_profile

GiB = 2**30


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("json", type=Path, help="an offload_bench.py --json file")
    parser.add_argument("kind", help="the row's kind, e.g. ours_io_bf16m_spec1_stream")
    parser.add_argument("--workload", default=None, help="default: the file's only one")
    parser.add_argument(
        "--stream-up-bytes",
        type=int,
        default=None,
        help="solve again with streamed regions moving this many bytes per parameter up",
    )
    args = parser.parse_args(argv)

    import torch

    from offload_optim.hybrid_adam import SPECULATION_HOST_SHARE
    from offload_runtime.api import device_conversion_profile
    from offload_runtime.storage import required_host_bytes
    from offload_solver import (
        RegionAssignment,
        SimulationContext,
        StreamedStepCosts,
        get_simulator,
        solve,
    )
    from offload_solver.solve import POLISH_SUGGESTED_ROUNDS

    results: dict[str, dict[str, dict[str, Any]]] = json.loads(args.json.read_text())["results"]
    workload = args.workload or next(iter(results))
    row = results[workload].get(args.kind)
    if row is None or not row.get("ok") or "profile" not in row:
        parser.error(f"{args.json.name} has no measured {workload} {args.kind} row with a profile")
    base_kind = args.kind.removesuffix("_stream")
    base = workload_profile(workload)
    profile = device_conversion_profile(base) if row["convert_on_device"] else base
    hardware = row_hardware(row, row["profile"]["host_adam_gparam"])
    speculate = base_kind in SPECULATING
    planning = row_simulation(row, speculate)
    if args.kind.endswith("_stream"):
        planning["streamed"] = StreamedStepCosts(**row["plan_streamed"])
    budget = WORKLOADS[workload][3] * GiB
    in_use = int(row.get("device_bytes_in_use", 0))
    plan = solve(profile, hardware, budget, solver="asyn", device_bytes_in_use=in_use, **planning)
    ctx = SimulationContext.build(profile, hardware, **planning)
    chosen = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    period = plan.predicted_step_time_s
    static = get_simulator("async").simulate(ctx, chosen).static_bytes
    print(f"{args.json.name} {workload} {args.kind}: measured {row['step_ms']:.0f} ms")
    streams = row.get("profile_streams")
    if streams:  # the profiled steps' CUDA streams, per step
        n = max(1, int(row.get("profile_steps", 1)))
        h2d = d2h = 0.0
        for sid, st in sorted(streams["streams"].items()):
            kinds = ", ".join(f"{k} {v / n:.0f}" for k, v in st["kinds"].items())
            print(f"  measured stream {sid}: busy {st['busy_ms'] / n:.0f} ms per step ({kinds})")
            h2d += st["kinds"].get("memcpy HtoD", 0.0) / n
            d2h += st["kinds"].get("memcpy DtoH", 0.0) / n
        print(f"  measured copies per step: H2D {h2d:.0f} ms, D2H {d2h:.0f} ms")
    print(
        f"plan: {plan.predicted_step_time_s * 1e3:.0f} ms, peak "
        f"{plan.predicted_peak_bytes / GiB:.2f} GiB, static {static / GiB:.2f} GiB"
    )
    groups: dict[tuple[str, str], list[int]] = {}
    for r, a in enumerate(chosen):
        groups.setdefault((a.placement.value, a.state.value), []).append(ctx.numel[r])
    for (placement, state), numels in sorted(groups.items()):
        print(f"  {placement:>8} / {state:<8} {len(numels):3d} regions {sum(numels) / 1e9:.3f} G")

    polished = solve(
        profile,
        hardware,
        budget,
        solver="asyn",
        device_bytes_in_use=in_use,
        polish_rounds=POLISH_SUGGESTED_ROUNDS,
        **planning,
    )
    print(
        f"the solver's local search (polish_rounds={POLISH_SUGGESTED_ROUNDS}, off by default) "
        f"would make it {polished.predicted_step_time_s * 1e3:.0f} ms "
        f"({(period - polished.predicted_step_time_s) / period:.1%} shorter as simulated; "
        f"{polished.num_simulations} simulations in {polished.solve_time_s:.1f} s)"
    )

    if args.stream_up_bytes is not None:
        if "streamed" not in planning:
            parser.error("--stream-up-bytes needs a _stream row")
        costs = dataclasses.replace(planning["streamed"], up_bytes_per_param=args.stream_up_bytes)
        other = solve(
            profile,
            hardware,
            budget,
            solver="asyn",
            device_bytes_in_use=in_use,
            **{**planning, "streamed": costs},
        )
        print(
            f"streamed up {planning['streamed'].up_bytes_per_param} -> "
            f"{args.stream_up_bytes} bytes per parameter: "
            f"{plan.predicted_step_time_s * 1e3:.0f} -> "
            f"{other.predicted_step_time_s * 1e3:.0f} ms"
        )

    needed = required_host_bytes(plan, torch.float16, convert_on_device=row["convert_on_device"])
    total = int(row["hardware"]["host_memory_bytes"])
    per_param = 4 + 2 * (2 if "bf16m" in base_kind else 4)
    room = max(0.0, total * SPECULATION_HOST_SHARE - needed) / per_param
    print(
        f"host memory: the plan's storage {needed / 1e9:.1f} GB of {total / 1e9:.1f} GB; "
        f"undo buffers ({per_param} B/param) for {room / 1e9:.2f} G parameters fit in "
        f"{SPECULATION_HOST_SHARE:.0%} of the machine"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
