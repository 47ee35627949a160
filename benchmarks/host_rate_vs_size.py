"""Does the host Adam rate measured over a small buffer hold over a whole model's state?

Plans charge host steps at the hardware profile's fused fp32 rate (measured over 64 M
parameters) divided by a kernel's cost (``measure_host_step_cost``, also over 64 M). In
session 19 W4's fp16-I/O host steps with fp32 moments ran at 2.9-3.1 Gparam/s in the
training loop (6.04 G host-state parameters), where the kernel read 4.3-4.7 alone.
This script times one host step over ``--total`` parameters held as regions of
``--region`` parameters each (one allocation per region, stepped one after another, as
the runtime's host worker does), for three kinds:

- ``torch_fused``: torch's fused fp32 AdamW (fp32 parameter, gradient and moments);
- ``io_fp32``: ``single_pass.adam_fp16_io_`` with fp32 moments (fp16 gradient in, fp16
  copy out: ``HybridAdam(fp16_io=True)``);
- ``io_bf16``: the same with bf16 moments.

Each kind is timed at every size in ``--totals`` on pageable buffers, and with
``--pinned`` on page-locked ones too (allocated as the runtime's region storage does;
needs CUDA). Rates are
medians of ``--repeats`` steps after one untimed step, in Gparam/s, with each kind's
ratio to ``torch_fused`` at the same size. A size whose buffers do not fit in the host
memory available (less 8 GiB) is skipped and says so.

    python benchmarks/host_rate_vs_size.py --totals 256e6,3e9 --region 66e6 --pinned
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from offload_runtime.hardware import available_host_memory_bytes

KINDS = ("torch_fused", "io_fp32", "io_bf16")
BYTES_PER_PARAM = {"torch_fused": 16, "io_fp32": 16, "io_bf16": 12}  # held, not moved
MARGIN_BYTES = 8 << 30


def _regions(total: int, region: int) -> list[int]:
    sizes = [region] * (total // region)
    if total % region:
        sizes.append(total % region)
    return sizes


def _stepper(kind: str, sizes: list[int], pinned: bool) -> Callable[[int], None]:
    """Buffers for one host step of ``kind`` over regions of ``sizes`` parameters, and a
    function that steps every region once (step number ``k``)."""
    from offload_optim.kernels import AdamHyper, fused_adam_

    def empty(n: int, dtype: torch.dtype) -> torch.Tensor:
        if pinned:
            # The runtime's own allocation: registered in place at the exact size (torch's
            # pinned allocator rounds up to a power of two).
            from offload_runtime.storage import alloc_host

            t = alloc_host(n, dtype, True)
        else:
            t = torch.empty(n, dtype=dtype)
        t.zero_()  # touch every page now, not in the first timed step
        return t

    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, adamw=True)
    bufs: list[tuple[torch.Tensor, ...]] = []
    for n in sizes:
        param = empty(n, torch.float32)
        if kind == "torch_fused":
            grad = empty(n, torch.float32).fill_(1e-3)
            bufs.append((param, grad, empty(n, torch.float32), empty(n, torch.float32)))
        else:
            moments = torch.float32 if kind == "io_fp32" else torch.bfloat16
            grad16 = empty(n, torch.float16).fill_(1e-3)
            bufs.append(
                (param, grad16, empty(n, moments), empty(n, moments), empty(n, torch.float16))
            )
    if kind == "torch_fused":

        def step(k: int) -> None:
            t = torch.tensor(float(k))
            for p, g, m, v in bufs:
                fused_adam_([p], [g], [m], [v], [t], hyper)

        return step
    from offload_optim import single_pass

    single_pass.require()
    single_pass.require_fp16_io()

    def step_io(k: int) -> None:
        t = torch.tensor(float(k))
        for p, g, m, v, p16 in bufs:
            single_pass.adam_fp16_io_(p, g, m, v, p16, t, hyper)

    return step_io


def _time(kind: str, total: int, region: int, pinned: bool, repeats: int) -> dict[str, Any]:
    started = time.perf_counter()
    step = _stepper(kind, _regions(total, region), pinned)
    alloc_s = time.perf_counter() - started
    step(1)  # untimed: compiles on first use, warms the pages
    samples = []
    for k in range(repeats):
        t0 = time.perf_counter()
        step(k + 2)
        samples.append(time.perf_counter() - t0)
    median = statistics.median(samples)
    del step
    gc.collect()
    return {
        "kind": kind,
        "total": total,
        "region": region,
        "pinned": pinned,
        "median_ms": median * 1e3,
        "gparam_per_s": total / median / 1e9,
        "samples_ms": [s * 1e3 for s in samples],
        "alloc_s": alloc_s,
        "threads": torch.get_num_threads(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--totals", default="256e6,3e9", help="parameters, comma-separated")
    parser.add_argument("--region", type=float, default=66e6, help="parameters per region")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pinned", action="store_true", help="also time page-locked buffers")
    parser.add_argument("--json", default="", help="write every row to this file")
    args = parser.parse_args(argv)
    totals = [int(float(x)) for x in args.totals.split(",") if x]
    region = int(args.region)
    if region < 1 or args.repeats < 1 or any(t < 1 for t in totals):
        parser.error("--totals, --region and --repeats must be positive")
    if args.pinned and not torch.cuda.is_available():
        parser.error("--pinned needs CUDA (page-locked host memory)")
    rows: list[dict[str, Any]] = []
    for pinned in (False, True) if args.pinned else (False,):
        for total in totals:
            fused_ms = None
            for kind in KINDS:
                need = BYTES_PER_PARAM[kind] * total
                available = available_host_memory_bytes()
                if need + MARGIN_BYTES > available:
                    row: dict[str, Any] = {
                        "kind": kind,
                        "total": total,
                        "pinned": pinned,
                        "skipped": f"needs {need / 2**30:.1f} GiB, "
                        f"{available / 2**30:.1f} GiB available",
                    }
                else:
                    row = _time(kind, total, region, pinned, args.repeats)
                    if kind == "torch_fused":
                        fused_ms = row["median_ms"]
                    if fused_ms is not None:
                        row["x_torch_fused"] = row["median_ms"] / fused_ms
                rows.append(row)
                print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
