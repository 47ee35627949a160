"""How close a row's step came to what host memory can carry, from recorded files.

    python benchmarks/host_memory_bound.py --rates benchmarks/results/s33c1_host_memory.json \\
        benchmarks/results/s33c*.json

Every byte a step moves between host memory and the device, and every byte the host
optimizer reads or writes, goes through host memory. Per step that is:

- the copies up (H2D: offloaded parameters for forward and backward, the host-stepped
  parameters' fp16 copies, the streamed regions' state and gradients) and down (D2H:
  host-state gradients, the streamed regions' state), each byte read or written once;
- the host Adam step over the host-stepped parameters: 28 bytes per parameter with fp32
  moments and fp16 gradient and parameter I/O (the fp32 parameter and both moments read
  and written, 24; the fp16 gradient read and the fp16 parameter written, 4), or 20 with
  bf16 moments.

Those bytes over the host memory rate that ``host_step_contention.py`` measured for the
host Adam and pinned copies running at once (its ``host_memory_gbps``, the largest over
its conditions unless ``--condition`` names one) estimate the least step time host memory
allows. Plans of the same regions differ little in it: a plan only moves parameters
between the host step and the streamed copies, and both cost about the same bytes per
parameter (28 through the host Adam; 24 of state up and down, and the gradient's way
back, through the copies). It is an estimate, not a strict bound: the rate was measured
for one mix of Adam and copies, on the machine of the rates file. A step near it is
bounded by host memory, whatever the plan; a step well above it is bounded elsewhere.

The byte counts come from the row itself: ``floor_bytes`` where ``offload_bench.py``
recorded it, else its ``floor_parts_ms`` times the rates they were divided by (the
profile's copy rates and ``profile_host_adam_gparam``). Rows of kinds without fp16 I/O
(``_io``) or without offloading are left out. GB = 1e9 bytes. Nothing is allocated; no
GPU is needed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from targets import load_rows

ADAM_IO_BYTES_PER_PARAM = {"fp32": 28, "bf16": 20}
"""Host memory one host Adam step with fp16 gradient and parameter I/O moves per
parameter, by moment dtype: fp32 parameter read and written (8), both moments read and
written (16 in fp32, 8 in bf16), fp16 gradient read and fp16 parameter written (4)."""


@dataclass(frozen=True)
class StepBytes:
    """What one training step moves through host memory, in bytes."""

    up: float
    """Copies to the device (each byte read from host memory)."""
    down: float
    """Copies from the device (each byte written to host memory)."""
    host_adam: float
    """Read and written by the host Adam step."""
    host_state_params: float
    """Parameters whose optimizer state lives in host memory (host-stepped and streamed)."""

    @property
    def total(self) -> float:
        return self.up + self.down + self.host_adam


def step_bytes(row: dict[str, Any], kind: str) -> StepBytes | None:
    """The bytes ``row`` (one of ``offload_bench.py``'s results, of ``kind``) moved
    through host memory per step; None for kinds without fp16 I/O or rows without
    offloading."""
    if "_io" not in kind or "floor_parts_ms" not in row:
        return None
    moments = "bf16" if "bf16m" in kind else "fp32"
    parts = row["floor_parts_ms"]
    rate = row["profile_host_adam_gparam"] * 1e9  # what the floor's host parts divide by
    recorded = row.get("floor_bytes")
    if recorded is not None:
        up, down, host_params = recorded["h2d"], recorded["d2h"], recorded["host_params"]
    else:
        profile = row["profile"]
        up = parts["h2d"] / 1e3 * profile["h2d_gbps"] * 1e9
        down = parts["d2h"] / 1e3 * profile["d2h_gbps"] * 1e9
        host_params = parts["host_adam"] / 1e3 * rate
    # Streamed regions' parameters are host-state too; without any, the two counts agree.
    all_host_ms = parts.get("host_adam_all_host_state", parts["host_adam"])
    return StepBytes(
        up=up,
        down=down,
        host_adam=host_params * ADAM_IO_BYTES_PER_PARAM[moments],
        host_state_params=all_host_ms / 1e3 * rate,
    )


def host_memory_gbps(rates_file: Path, condition: str | None = None) -> tuple[float, str]:
    """The host memory rate (GB/s) and the condition it was measured under, from a
    ``host_step_contention.py --json`` file: the named ``condition``'s, else the largest.
    Raises ValueError when the file has no such rate."""
    data = json.loads(rates_file.read_text())
    rows = data.get("rows", data) if isinstance(data, dict) else data
    found = [
        (float(r["host_memory_gbps"]), str(r["condition"]))
        for r in rows
        if isinstance(r, dict)
        and "host_memory_gbps" in r
        and (condition is None or r.get("condition") == condition)
    ]
    if not found:
        want = f"condition {condition!r}" if condition else "any condition"
        raise ValueError(f"{rates_file}: no host_memory_gbps for {want}")
    return max(found)


def table(paths: list[Path], gbps: float) -> list[str]:
    """Markdown rows: each of our rows in ``paths`` (``targets.load_rows``, which skips
    files that are not ``offload_bench.py`` output, such as the rates file) with its bytes
    per step and its step against the time they take at ``gbps``."""
    lines = [
        "| file | workload | kind | up / down / host Adam (GB) | total (GB; bytes per"
        " host-state param) | host-memory time at "
        f"{gbps:.0f} GB/s | step (run mean) | step / host-memory time (run) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    ratios: list[float] = []
    for r in load_rows(paths):
        b = step_bytes(r.result, r.kind)
        if b is None:
            continue
        memory_ms = b.total / (gbps * 1e9) * 1e3
        step, mean = r.result["step_ms"], r.result.get("step_mean_ms", float("nan"))
        ratios.append(step / memory_ms)
        lines.append(
            f"| {r.file} | {r.workload} | {r.kind} | {b.up / 1e9:.1f} / "
            f"{b.down / 1e9:.1f} / {b.host_adam / 1e9:.1f} | {b.total / 1e9:.1f}; "
            f"{b.total / b.host_state_params:.1f} | {memory_ms:.0f} ms | "
            f"{step:.0f} ms ({mean:.0f}) | {step / memory_ms:.2f}x ({mean / memory_ms:.2f}x) |"
        )
    if ratios:
        lines.append(
            f"\n{len(ratios)} rows; step / host-memory time {min(ratios):.2f}x to "
            f"{max(ratios):.2f}x, "
            f"median {statistics.median(ratios):.2f}x"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--rates", type=Path, required=True, help="host_step_contention.py --json output"
    )
    parser.add_argument(
        "--condition",
        default=None,
        help="the rates file's condition to take host_memory_gbps from (default: the"
        " largest; e.g. duplex, copies, both)",
    )
    parser.add_argument("json", nargs="+", type=Path, help="offload_bench.py --json files")
    args = parser.parse_args(argv)
    try:
        gbps, condition = host_memory_gbps(args.rates, args.condition)
    except (OSError, ValueError, KeyError) as e:
        parser.error(str(e))
    print(f"host memory: {gbps:.1f} GB/s ({condition}, {args.rates.name})\n")
    print("\n".join(table(args.json, gbps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
