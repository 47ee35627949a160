"""The host Adam kernels' rates, side by side: what a host-state region's step costs.

    python benchmarks/host_adam_bench.py --numel 64e6
    python benchmarks/host_adam_bench.py --numel 256e6 --repeats 5 --json host_adam.json

Each configuration steps ``--numel`` fp32 master parameters on the CPU with the kernel the
optimizer would run, built and timed as the hardware profile's probes do
(``offload_runtime.hardware.kernel_steps`` and ``measure_host_step``: one untimed step
that touches every page, then the median of ``--repeats`` timed steps), and prints its
rate in G parameters/s (1e9 per second) and its time against torch's fused fp32 step:

- ``torch``: torch's fused Adam over fp32 moments (what the hardware profile measures);
- ``torch_bf16m``: bf16 moments by torch's chunked route;
- ``single``, ``single_bf16m``: the single-pass kernel (numba), fp32 / bf16 moments;
- ``single_fp16_io``, ``single_fp16_io_bf16m``: the same, reading fp16 gradients and
  writing the fp16 parameters in the pass;
- ``single_speculative``: the single-pass step that also writes its undo data.

The single-pass rows need numba (``pip install numba``) and are left out, with a note,
where it cannot load. Host Adam is bound by host memory bandwidth
on a many-core host: compare the rows within one run, on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

from offload_runtime.hardware import kernel_steps, measure_host_step
from offload_runtime.host_kernels import single_pass

# name: (host kernel, moments dtype, fp16 I/O, speculative)
CONFIGS: dict[str, tuple[str, torch.dtype, bool, bool]] = {
    "torch": ("torch", torch.float32, False, False),
    "torch_bf16m": ("torch", torch.bfloat16, False, False),
    "single": ("single_pass", torch.float32, False, False),
    "single_bf16m": ("single_pass", torch.bfloat16, False, False),
    "single_fp16_io": ("single_pass", torch.float32, True, False),
    "single_fp16_io_bf16m": ("single_pass", torch.bfloat16, True, False),
    "single_speculative": ("single_pass", torch.float32, False, True),
}


def measure(numel: int, repeats: int, names: list[str]) -> list[dict[str, Any]]:
    """One row per configuration in ``names`` that can run here, in order."""
    rows: list[dict[str, Any]] = []
    base: float | None = None
    for name in names:
        kernel, moments, fp16_io, speculative = CONFIGS[name]
        if kernel == "single_pass" and not single_pass.available():
            print(f"{name}: skipped, numba cannot load here", file=sys.stderr)
            continue
        built = kernel_steps(moments, numel, kernel, fp16_io)
        step = built.speculative if speculative else built.plain
        rate = measure_host_step(step, numel, steps=repeats).params_per_s
        if name == "torch":
            base = rate
        rows.append(
            {
                "config": name,
                "params_per_s": rate,
                "time_vs_torch": None if base is None else base / rate,
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--numel", type=float, default=64e6, help="fp32 parameters stepped")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps (median)")
    parser.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma-separated, from {', '.join(CONFIGS)} (default all)",
    )
    parser.add_argument("--json", default="", help="also write the rows to this file")
    args = parser.parse_args(argv)
    names = [n for n in args.configs.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown configs {unknown}; choose from {', '.join(CONFIGS)}")
    if not (args.numel >= 1 and args.repeats >= 1):
        parser.error("--numel and --repeats must be at least 1")
    rows = measure(int(args.numel), args.repeats, names)
    print(f"{'config':<22} {'Gparam/s':>9} {'x torch':>8}  ({torch.get_num_threads()} threads)")
    for r in rows:
        ratio = "" if r["time_vs_torch"] is None else f"{r['time_vs_torch']:.2f}"
        print(f"{r['config']:<22} {r['params_per_s'] / 1e9:>9.3f} {ratio:>8}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
