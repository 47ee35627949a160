"""One line per row of runs that shared a plan (``gpu_session.sh pinab`` / ``specthr``).

    python benchmarks/pin_rows.py W2 ours_io_spec1_stream OUT/W2_pin_*.json

For each ``offload_bench.py --json`` file: the row's run mean and mean of the 5 fastest
steps (ms), what it ran with (``speculation_thread``, and what it was planned for;
``issue_thread``, ``paced_ring``, ``stage_ahead`` and the chunks it staged), and whether
its plan was the source row's (``plan_matches_source``; ``source`` for the row the others
planned from); under it, where the row ran with ``OFFLOAD_HOST_ADAM_CPU_PROBE=1``, its long
host Adam kernels and the rest (``host_kernel_cpu``). Then the median run mean of each
group of rows named alike (the file name without its trailing round number), for
comparing ways of running one plan; with ``--all``, of every row, planned alike or not
(``gpu_session.sh upfrac`` / ``chargeab``: ways of planning).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any


def kernel_cpu_cell(cpu: dict[str, Any]) -> str:
    """One part of a row's ``host_kernel_cpu`` (offload_bench.kernel_cpu_summary) in words."""

    def num(key: str, fmt: str = ".1f") -> str:
        value = cpu.get(key)
        return "-" if value is None else format(value, fmt)

    return (
        f"{cpu.get('count', 0)} kernels, {num('wall_ms')} ms on {num('threads', '.0f')} "
        f"threads; cores of the process {num('process_cores')}, of the machine "
        f"{num('machine_cores')}, of other processes {num('other_cores')} (medians)"
    )


def ring_up_cell(ring: dict[str, Any]) -> str:
    """A row's ``ring_up`` (the ring's copies up timed in its loop) in words."""
    return (
        f"ring's copies up at {ring['gbps']:.1f} GB/s, {ring['loop_fraction']:.2f} of the "
        f"profile's H2D rate (planned {ring['planned_fraction']:.2f}), "
        f"{ring['ms_per_step']:.0f} ms a step"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("workload")
    parser.add_argument("kind")
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument(
        "--all",
        action="store_true",
        help="group every row, not only those that ran the source row's plan",
    )
    args = parser.parse_args(argv)
    groups: dict[str, list[float]] = {}
    for path in args.files:
        rows = json.loads(path.read_text())["results"][args.workload]
        # A peer run in the same call (chargeab runs one beside its first row).
        for peer in ("full_gpu", "full_gpu_master", "full_gpu_amp", "fsdp2", "torchao"):
            other = rows.get(peer)
            if other and other.get("ok"):
                print(
                    f"{path.name}: {peer} run mean {other['step_mean_ms']:.0f} ms, "
                    f"5 fastest {other['step_ms']:.0f} ms"
                )
        row = rows[args.kind]
        if not row.get("ok"):
            print(f"{path.name}: {row.get('error')}")
            continue
        matches = row.get("plan_matches_source", "source")
        print(
            f"{path.name}: run mean {row['step_mean_ms']:.0f} ms, 5 fastest "
            f"{row['step_ms']:.0f} ms, predicted {row.get('pred_step_ms', float('nan')):.0f} ms, "
            f"{row.get('streamed_regions', 0)} streamed, "
            f"stream_up_fraction {row.get('profile', {}).get('stream_up_fraction', 1.0)}, "
            f"stream_host_charge {row.get('profile', {}).get('stream_host_charge', 1.0)}, "
            f"backward_issue_factor {row.get('backward_issue_factor', 1.0)}, "
            f"speculation_thread {row.get('speculation_thread')} "
            f"(planned for {row.get('plan_speculation_thread', False)}), "
            f"issue_thread {row.get('issue_thread')}, paced_ring {row.get('paced_ring')}, "
            f"stage_ahead {row.get('stage_ahead', False)} "
            f"({row.get('staged_chunks', 0)} chunks staged"
            f"{', from backward' if row.get('stage_in_backward') else ''}), "
            f"late_host_work {row.get('late_host_work', False)}, host Adam claims "
            f"{row.get('host_adam_claim_blocks', 0)} block(s) (0: equal shares), "
            f"host-state regions "
            f"{row.get('host_state_regions', '-')}, forward waited for the host "
            f"{row.get('forward_waited_for_host_ms_per_step', float('nan')):.1f} ms a step, "
            f"plan matches the source: {matches}"
        )
        steps = row.get("steps_ms") or []
        if steps:
            print(f"    timed steps {min(steps):.1f}-{max(steps):.1f} ms ({len(steps)} steps)")
        if "profile_host_adam_gparam" in row:
            samples = ", ".join(f"{r:.2f}" for r in row.get("host_rate_samples_gparam", []))
            print(
                f"    host Adam: the profile read {row['profile_host_adam_gparam']:.2f} "
                f"Gparam/s, the kind's samples [{samples}], planned from "
                f"{row.get('host_rate_planned_from')}"
            )
        for part, cpu in sorted(row.get("host_kernel_cpu", {}).items()):
            print(f"    host Adam kernels, {part}: {kernel_cpu_cell(cpu)}")
        if "ring_up" in row:
            print(f"    {ring_up_cell(row['ring_up'])}")
        span = row.get("cpu_span_ms")
        if span:
            print(
                f"    host span of forward {span['forward']:.1f} ms, backward(loss) "
                f"{span['backward']:.1f} ms, step() {span['step']:.1f} ms (medians)"
            )
        if matches is True or args.all:
            group = re.sub(r"\d+$", "", path.stem)
            groups.setdefault(group, []).append(row["step_mean_ms"])
    for group, means in groups.items():
        print(f"{group}: median run mean {statistics.median(means):.0f} ms over {len(means)} rows")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
