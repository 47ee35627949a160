"""Each row's step beside the GPU clock and power it ran at (CPU only).

    python benchmarks/clock_rows.py benchmarks/results/s39c5_W3_*.json

For every successful row of ``offload_bench.py`` JSON files: its kind, step time (5
fastest, run mean), forward and backward alone (full-GPU kinds), whether its loss was
scaled (``grad_scaler``), its budget where it recorded one, and ``gpu_clocks``: median and
least SM clock (MHz), median power (W), and NVML's clock event reasons (their union over
the samples; 4 is the software power cap). Rows from before session 38 recorded no clocks.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any


def describe(name: str, workload: str, kind: str, r: dict[str, Any]) -> str:
    """One line for a row."""
    parts = [f"{name} {workload} {kind}: {r['step_ms']:.1f} ms"]
    if "step_mean_ms" in r:
        parts[0] += f" (run {r['step_mean_ms']:.1f})"
    if r.get("fwd_bwd_ms"):
        parts.append(f"forward+backward {r['fwd_bwd_ms']:.1f} ms")
    if "grad_scaler" in r:
        parts.append(f"loss scaled {bool(r['grad_scaler'])}")
    if "recipe" in r:
        parts.append(f"recipe {r['recipe']}")
    if "loss_before" in r:
        parts.append(f"loss {r['loss_before']:.3f} -> {r['loss_after']:.3f}")
    if r.get("loss_scale_after") is not None:
        parts.append(f"scale after {r['loss_scale_after']:g}")
    if "budget_gib" in r:
        parts.append(f"budget {r['budget_gib']:g} GiB")
    c = r.get("gpu_clocks") or {}
    if "sm_mhz_median" in c:
        parts.append(
            f"SM {c['sm_mhz_median']:.0f} MHz (least {c['sm_mhz_min']:.0f}), "
            f"{c['power_w_median']:.0f} W, reasons {c.get('event_reasons', '-')}"
        )
    else:
        parts.append(f"no clocks ({c.get('error', 'not recorded')})")
    return ", ".join(parts)


def lines(paths: list[Path]) -> list[str]:
    out = []
    for path in paths:
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        for workload, by_kind in data.get("results", {}).items():
            for kind, r in by_kind.items():
                if r.get("ok") and "step_ms" in r:
                    out.append(describe(path.name, workload, kind, r))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("files", type=Path, nargs="+")
    args = parser.parse_args(argv)
    found = lines(args.files)
    if not found:
        print("no successful rows")
        return 1
    print("\n".join(found))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
