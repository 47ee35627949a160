# mypy: disable-error-code="no-untyped-call"
"""How fast the optimizer's ring moves streamed state, alone and beside a host Adam step.

    python benchmarks/ring_rate.py --numel 400e6 --json out.json

In session 28's profiled GPU steps the ring's copies up (``offload_optim.streamed``,
``StreamRing``) ran at 0.69-0.74 of the profiled pinned H2D rate while the runtime's
prefetches beside them ran at 0.78-0.83 (``benchmarks/copy_lag.py``), and the planner
now takes that fraction as ``HardwareProfile.stream_up_fraction`` (1 unless set). This
script asks whether a short measurement reproduces it, which a profile could then take:

1. ``plain``: pinned copies up of the ring's chunk size, as the hardware profile
   measures them (``offload_runtime.hardware.measure_copy_bandwidth``);
2. ``ring``: ``--numel`` parameters of host state (fp32 master, moments as
   ``--moments``, the gradient fp16 with ``--fp16-io`` else fp32) streamed through a
   ``StreamRing`` (paced, as the issuing thread runs it), alone;
3. ``ring_beside_host``: the same while a thread steps torch's fused CPU Adam over
   ``--host-numel`` fp32 parameters in a loop (the host Adam the ring runs beside).

Each ring run is profiled with ``torch.profiler`` and its copies' rates read from the
trace (``copy_lag.copy_rates``): bytes over the time the copies ran, up and down. It
prints each rate and its fraction of ``plain``'s, as medians over ``--repeats`` runs.
Needs CUDA; on a machine without it, it says so and exits 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from copy_lag import copy_rates, load


def _ring_rates(ring_run: Any) -> tuple[float, float]:
    """(bytes/s up, bytes/s down) of the copies ``ring_run()`` makes, from a profile."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ring_run()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "ring.json"
        prof.export_chrome_trace(str(path))
        events = load(path)
    for e in events:  # group the copies by direction, whatever stream ran them
        if e.get("cat") == "gpu_memcpy":
            e["tid"] = "up" if "HtoD" in e["name"] else "down"
    rates = copy_rates(events)

    def rate(direction: str) -> float:
        moved, took = rates.get(direction, (0, 0.0))
        return moved / took if took else 0.0

    return rate("up"), rate("down")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--numel", type=float, default=400e6, help="streamed parameters")
    parser.add_argument("--moments", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--fp16-io", action="store_true", help="fp16 gradients and copy")
    parser.add_argument("--host-numel", type=float, default=200e6, help="host Adam parameters")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.numel < 1 or args.host_numel < 1 or args.repeats < 1:
        parser.error("--numel, --host-numel and --repeats must be >= 1")

    import torch

    if not torch.cuda.is_available():
        print("ring_rate.py needs CUDA", file=sys.stderr)
        return 2

    from offload_optim.kernels import AdamHyper
    from offload_optim.streamed import STREAM_CHUNK_NUMEL, StreamPiece, StreamRing, ring_streams
    from offload_runtime.hardware import measure_copy_bandwidth

    n = int(args.numel)
    moments = torch.bfloat16 if args.moments == "bf16" else torch.float32
    grad_dtype = torch.float16 if args.fp16_io else torch.float32

    def pinned(dtype: torch.dtype) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype, pin_memory=True)

    piece = StreamPiece(
        pinned(torch.float32),
        pinned(moments),
        pinned(moments),
        pinned(grad_dtype),
        1.0,
        AdamHyper(1e-4, 0.9, 0.999, 1e-8, 0.0, True),
        pinned(torch.float16) if args.fp16_io else None,
    )
    device = torch.device("cuda")
    streams = ring_streams(device)

    def ring_run() -> None:
        ring = StreamRing(device, moments, args.fp16_io, streams=streams)
        ring.issue([piece], None, paced=True)
        ring.close()

    ring_run()  # warm up: allocator, kernels
    up_points, _ = measure_copy_bandwidth(device, [STREAM_CHUNK_NUMEL * 4])
    plain = up_points[0].bytes_per_s

    host_params = [torch.zeros(int(args.host_numel))]
    host_params[0].grad = torch.zeros_like(host_params[0])
    host_opt = torch.optim.Adam(host_params, lr=1e-3, fused=True)
    host_opt.step()  # allocates the moments
    stop = threading.Event()
    host_steps = [0]

    def host_loop() -> None:
        while not stop.is_set():
            host_opt.step()
            host_steps[0] += 1

    alone: list[tuple[float, float]] = []
    beside: list[tuple[float, float]] = []
    for _ in range(args.repeats):
        alone.append(_ring_rates(ring_run))
        thread = threading.Thread(target=host_loop, daemon=True)
        thread.start()
        time.sleep(0.05)  # the host step is running
        beside.append(_ring_rates(ring_run))
        stop.set()
        thread.join()
        stop.clear()

    def median(rows: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rows)

    out = {
        "numel": n,
        "moments": args.moments,
        "fp16_io": args.fp16_io,
        "plain_h2d_gbps": plain / 1e9,
        "ring_up_gbps": median(alone, 0) / 1e9,
        "ring_down_gbps": median(alone, 1) / 1e9,
        "ring_up_beside_host_gbps": median(beside, 0) / 1e9,
        "ring_down_beside_host_gbps": median(beside, 1) / 1e9,
        "host_steps_beside": host_steps[0],
    }
    out["ring_up_fraction"] = out["ring_up_gbps"] / out["plain_h2d_gbps"]
    out["ring_up_beside_host_fraction"] = out["ring_up_beside_host_gbps"] / out["plain_h2d_gbps"]
    for key, value in out.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
