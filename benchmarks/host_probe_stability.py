"""How steady the host-step cost probe is: ``offload_optim.measure_host_step_cost`` read
again and again in one process, with back-to-back halves (the probe before session 21)
and with a sleep before each half (``gap_s``), plus the absolute rates of the two kernels
it compares, each timed alone and right after the other.

    python benchmarks/host_probe_stability.py --json out.json [--numel 64e6] [--repeats 5]

The planner takes the probe's ratio (``memory_optimize(host_step_cost=)``); a ratio that
moves by a third between two readings moves the predicted W4 step by as much
(BENCHMARKS.md, session 21). Also prints what sets the host's parallelism: the CPU count,
the CPUs this process may run on, torch's thread count and numba's threading layer.
Needs numba with the fp16-I/O kernels (``offload-optim[single-pass]``) and about 2 GB of
host memory at the default size.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from offload_optim import measure_host_step_cost, measure_host_step_params_per_s


def _spread(values: list[float]) -> dict[str, float]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "max_over_min": max(values) / max(min(values), 1e-12),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", required=True, help="where to write the readings")
    ap.add_argument("--numel", type=float, default=64e6, help="parameters per probe")
    ap.add_argument("--repeats", type=int, default=5, help="readings per setting")
    args = ap.parse_args()
    numel = int(args.numel)
    if numel < 1 or args.repeats < 1:
        raise SystemExit("--numel and --repeats must be >= 1")
    import numba

    bf16 = torch.bfloat16
    # The kernel the W4 bf16-moment rows step with: single-pass, bf16 moments, fp16 I/O.
    kind: dict[str, Any] = {"host_kernel": "single_pass", "fp16_io": True}
    out: dict[str, Any] = {
        "numel": numel,
        "cpu_count": os.cpu_count(),
        "affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "numba_threads": int(getattr(numba.config, "NUMBA_NUM_THREADS", 0)),
    }
    settings: dict[str, tuple[int, float]] = {  # pairs, gap_s
        "back_to_back_3_pairs": (3, 0.0),
        "gap_50ms_5_pairs": (5, 0.05),
        "gap_300ms_5_pairs": (5, 0.3),
    }
    costs: dict[str, list[float]] = {name: [] for name in settings}
    started = time.perf_counter()
    for r in range(args.repeats):
        for name, (pairs, gap_s) in settings.items():
            costs[name].append(
                measure_host_step_cost(bf16, numel, **kind, pairs=pairs, gap_s=gap_s)
            )
        print(f"[probe] repeat {r + 1}/{args.repeats}: " + ", ".join(
            f"{n} {c[-1]:.3f}" for n, c in costs.items()), flush=True)  # fmt: skip
    out["numba_threading_layer"] = getattr(numba, "threading_layer")()  # noqa: B009  (not in its stubs)
    out["cost"] = {name: {"readings": c, **_spread(c)} for name, c in costs.items()}
    rates: dict[str, list[float]] = {"kind_alone": [], "fused_alone": [], "fused_after_kind": []}
    for _ in range(args.repeats):
        rates["kind_alone"].append(measure_host_step_params_per_s(bf16, numel, **kind) / 1e9)
        time.sleep(0.3)
        rates["fused_alone"].append(measure_host_step_params_per_s(numel=numel) / 1e9)
        measure_host_step_params_per_s(bf16, numel, **kind)
        rates["fused_after_kind"].append(measure_host_step_params_per_s(numel=numel) / 1e9)
        time.sleep(0.3)
    out["rate_gparam_per_s"] = {name: {"readings": v, **_spread(v)} for name, v in rates.items()}
    out["wall_s"] = time.perf_counter() - started
    for name, c in out["cost"].items():
        print(f"[probe] cost {name}: median {c['median']:.3f}, {c['min']:.3f}-{c['max']:.3f}")
    for name, v in out["rate_gparam_per_s"].items():
        print(f"[probe] {name}: median {v['median']:.2f} Gparam/s, {v['min']:.2f}-{v['max']:.2f}")
    print(
        f"[probe] cpu_count {out['cpu_count']}, affinity {out['affinity']}, torch threads "
        f"{out['torch_threads']}, numba {out['numba_threading_layer']} x {out['numba_threads']}"
    )
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
