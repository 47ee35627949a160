"""Would choosing how many host-state parameters speculate beat all-or-what-fits?

For a speculating row of ``offload_bench.py --json`` output, this re-plans the workload
with the row's recorded profile (as ``replay_bench.py`` does) with no speculation, with
every host-state parameter speculating, and with ``speculative_params`` limited to each
fraction in ``--fractions`` of them (the regions whose gradients land first speculate,
the others step after backward), and prints the predicted step of each. CPU only: the
workload is traced on the meta device.

    python benchmarks/spec_limit_sweep.py benchmarks/results/s19c3_W3_io23.json W3 ours_io_spec1
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from offload_bench import WORKLOADS
from replay_bench import GiB, row_hardware, workload_profile


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=Path, help="offload_bench.py --json output")
    parser.add_argument("workload", choices=sorted(WORKLOADS))
    parser.add_argument("kind", help="a speculating row, e.g. ours_io_spec1")
    parser.add_argument("--fractions", default="0.05,0.1,0.2,0.3,0.5,0.8")
    args = parser.parse_args(argv)
    try:
        row: dict[str, Any] = json.loads(args.json.read_text())["results"][args.workload][args.kind]
    except (KeyError, TypeError) as exc:
        parser.error(f"{args.json} has no {args.workload} {args.kind} row ({exc})")
    if "profile" not in row:
        parser.error(f"the {args.kind} row records no profile: it cannot be re-planned")
    fractions = [float(x) for x in args.fractions.split(",") if x]
    if any(not 0 < f < 1 for f in fractions):
        parser.error("--fractions must lie between 0 and 1")

    from offload_solver import StatePlacement, solve

    _, _, _, budget_gib = WORKLOADS[args.workload]
    profile = workload_profile(args.workload)
    hw = row_hardware(row, row["profile"]["host_adam_gparam"])

    def predicted_ms(limit: int | None, after_backward: bool) -> tuple[float, Any]:
        plan = solve(
            profile,
            hw,
            budget_gib * GiB,
            solver="asyn",
            host_step_after_backward=after_backward,
            speculative_step_cost=row.get("speculative_step_cost", 1.0),
            speculative_params=limit,
            device_bytes_in_use=int(row.get("device_bytes_in_use", 0)),
        )
        return plan.predicted_step_time_s * 1e3, plan

    none_ms, _ = predicted_ms(None, True)
    full_ms, full = predicted_ms(None, False)
    host = sum(rp.region.numel for rp in full.regions if rp.state is StatePlacement.HOST)
    print(f"{args.workload} {args.kind} (measured {row['step_ms']:.0f} ms, 5 fastest)")
    print(f"no speculation: {none_ms:.0f} ms")
    print(f"every host-state parameter ({host / 1e9:.2f} G) may speculate: {full_ms:.0f} ms")
    for fraction in fractions:
        ms, _ = predicted_ms(int(fraction * host), False)
        print(f"up to {fraction:.0%} may speculate: {ms:.0f} ms ({(ms - full_ms) / full_ms:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
