"""Can the GPU take part of the host optimizer step? A measurement, not a feature.

The host Adam over fp32 master weights and moments is bound by host memory bandwidth
(~28 bytes per parameter per step). A region whose state lives on the host could instead
be stepped on the device: copy master, moments (and gradient) up, run fused CUDA Adam,
copy master and moments back down. That costs 12-16 bytes up and 12 down per parameter
over PCIe, and it competes with the host Adam for host memory bandwidth (the copies read
and write pinned host memory). This script measures, on one machine, the step time of N
parameters when a fraction ``f`` of them is streamed through the device while the host
steps the rest at the same time, against ``f = 0`` (all on the host)::

    python benchmarks/split_step_bench.py --params 400e6 --chunk 16e6 --json out.json

Needs CUDA. Times are medians of ``--repeats`` runs; rates in Gparam/s (1e9 params/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=400e6, help="parameters in all")
    parser.add_argument("--chunk", type=float, default=16e6, help="parameters per chunk")
    parser.add_argument("--fractions", default="0,0.2,0.3,0.4,0.5,0.6,1")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slots", type=int, default=3, help="device buffer sets in the ring")
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)

    import torch
    from _adam import fused_adam_

    if not torch.cuda.is_available():
        print("split_step_bench: needs CUDA", file=sys.stderr)
        return 2
    chunk = int(args.chunk)
    n_chunks = max(1, int(args.params) // chunk)
    dev = torch.device("cuda")

    def pinned() -> torch.Tensor:
        t = torch.empty(chunk, dtype=torch.float32, pin_memory=True)
        t.normal_()
        return t

    print(f"allocating {n_chunks} chunks x {chunk / 1e6:.0f} M params, pinned", file=sys.stderr)
    p = [pinned() for _ in range(n_chunks)]
    g = [pinned().mul_(1e-3) for _ in range(n_chunks)]
    m = [torch.zeros(chunk, pin_memory=True) for _ in range(n_chunks)]
    v = [torch.zeros(chunk, pin_memory=True) for _ in range(n_chunks)]
    step_h = [torch.zeros((), dtype=torch.float32) for _ in range(n_chunks)]
    step_d = torch.zeros((), dtype=torch.float32, device=dev)
    slots = [
        [torch.empty(chunk, device=dev) for _ in range(4)]  # p, g, m, v
        for _ in range(args.slots)
    ]
    h2d = torch.cuda.Stream()
    d2h = torch.cuda.Stream()
    comp = torch.cuda.current_stream()
    # free[k]: the event after which slot k's buffers may be overwritten (its D2H done).
    free = [torch.cuda.Event() for _ in slots]
    for e in free:
        e.record(d2h)

    def stream_chunk(i: int, k: int, grad_up: bool) -> torch.cuda.Event:
        sp, sg, sm, sv = slots[k % len(slots)]
        h2d.wait_event(free[k % len(slots)])
        with torch.cuda.stream(h2d):
            sp.copy_(p[i], non_blocking=True)
            sm.copy_(m[i], non_blocking=True)
            sv.copy_(v[i], non_blocking=True)
            if grad_up:
                sg.copy_(g[i], non_blocking=True)
            up = torch.cuda.Event()
            up.record(h2d)
        comp.wait_event(up)
        fused_adam_([sp], [sg], [sm], [sv], [step_d])
        done = torch.cuda.Event()
        done.record(comp)
        d2h.wait_event(done)
        with torch.cuda.stream(d2h):
            p[i].copy_(sp, non_blocking=True)
            m[i].copy_(sm, non_blocking=True)
            v[i].copy_(sv, non_blocking=True)
            fr = torch.cuda.Event()
            fr.record(d2h)
        free[k % len(slots)] = fr
        return fr

    def run(frac: float, grad_up: bool) -> float:
        k_dev = round(frac * n_chunks)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for k in range(k_dev):
            stream_chunk(k, k, grad_up)
        host = list(range(k_dev, n_chunks))
        for i in host:  # one region at a time, as the optimizer steps them
            fused_adam_([p[i]], [g[i]], [m[i]], [v[i]], [step_h[i]])
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    results: dict[str, Any] = {"params": n_chunks * chunk, "chunk": chunk, "rows": []}
    run(0.0, True)
    run(1.0, True)
    for grad_up in (True, False):
        for frac in [float(x) for x in args.fractions.split(",")]:
            times = [run(frac, grad_up) for _ in range(args.repeats)]
            med = statistics.median(times)
            row = {
                "fraction_on_device": frac,
                "grad_uploaded": grad_up,
                "median_ms": med * 1e3,
                "gparam_per_s": n_chunks * chunk / med / 1e9,
            }
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
