# mypy: disable-error-code="no-untyped-call"
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

``--kernel io_bf16`` measures the same with the host step W4's bf16-moment rows take
(``HybridAdam(moments_dtype=torch.bfloat16, host_kernel="single_pass", fp16_io=True)``:
fp16 gradient in, fp32 master and bf16 moments stepped, fp16 parameter out; 20 bytes per
parameter of host memory). Its streamed chunks carry the fp32 master and bf16 moments
up (8 bytes per parameter, with the fp16 gradient 10), step on the device with the
moments widened to fp32, and bring master, moments and the fp16 parameter down (10
bytes)::

    python benchmarks/split_step_bench.py --kernel io_bf16 --params 1.4e9 --chunk 66e6 \
        --fractions 0,0.2,0.3,0.4,0.5 --repeats 3

Needs CUDA (and numba for ``io_bf16``). Times are medians of ``--repeats`` runs; rates in
Gparam/s (1e9 params/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class _Ring:
    """Streams chunks through ``slots`` sets of device buffers on two copy streams: for
    slot ``k``, upload on H2D once the slot's last download is done, step on the current
    (compute) stream after the upload, download on D2H after the step."""

    def __init__(self, slots: int) -> None:
        import torch

        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.comp = torch.cuda.current_stream()
        # free[k]: the event after which slot k's buffers may be overwritten (its D2H done).
        self.free = [torch.cuda.Event() for _ in range(slots)]
        for e in self.free:
            e.record(self.d2h)

    def stream(
        self,
        k: int,
        ups: list[tuple[Any, Any]],
        step: Callable[[], None],
        downs: list[tuple[Any, Any]],
    ) -> None:
        """Copy each ``(device, host)`` of ``ups`` up, run ``step``, copy each ``(host,
        device)`` of ``downs`` down, in slot ``k % slots``."""
        import torch

        k %= len(self.free)
        self.h2d.wait_event(self.free[k])
        with torch.cuda.stream(self.h2d):
            for dst, src in ups:
                dst.copy_(src, non_blocking=True)
            up = torch.cuda.Event()
            up.record(self.h2d)
        self.comp.wait_event(up)
        step()
        done = torch.cuda.Event()
        done.record(self.comp)
        self.d2h.wait_event(done)
        with torch.cuda.stream(self.d2h):
            for dst, src in downs:
                dst.copy_(src, non_blocking=True)
            freed = torch.cuda.Event()
            freed.record(self.d2h)
        self.free[k] = freed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=400e6, help="parameters in all")
    parser.add_argument("--chunk", type=float, default=16e6, help="parameters per chunk")
    parser.add_argument("--fractions", default="0,0.2,0.3,0.4,0.5,0.6,1")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--slots", type=int, default=3, help="device buffer sets in the ring")
    parser.add_argument("--json", default="")
    parser.add_argument(
        "--kernel",
        choices=("fused", "io_bf16"),
        default="fused",
        help="the host step: torch's fused fp32 Adam (fused), or the single-pass kernel "
        "with bf16 moments and fp16 I/O (io_bf16)",
    )
    args = parser.parse_args(argv)
    if args.kernel == "io_bf16":
        return split_io_bf16(args)

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
    ring = _Ring(len(slots))

    def stream_chunk(i: int, k: int, grad_up: bool) -> None:
        sp, sg, sm, sv = slots[k % len(slots)]
        ups = [(sp, p[i]), (sm, m[i]), (sv, v[i])] + ([(sg, g[i])] if grad_up else [])
        ring.stream(
            k,
            ups,
            lambda: fused_adam_([sp], [sg], [sm], [sv], [step_d]),
            [(p[i], sp), (m[i], sm), (v[i], sv)],
        )

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

    results: dict[str, Any] = {"params": n_chunks * chunk, "chunk": chunk}
    return _sweep(run, (True, False), args, results)


def _sweep(
    run: Callable[[float, bool], float],
    grad_modes: tuple[bool, ...],
    args: argparse.Namespace,
    results: dict[str, Any],
) -> int:
    """Time ``run(fraction, grad_up)`` (seconds) for every ``--fractions`` entry under each
    gradient mode, after one untimed run all on the host and one all on the device; print
    each row and write ``results`` with them to ``--json``."""
    run(0.0, True)
    run(1.0, True)
    results["rows"] = []
    for grad_up in grad_modes:
        for frac in [float(x) for x in args.fractions.split(",")]:
            med = statistics.median(run(frac, grad_up) for _ in range(args.repeats))
            row = {
                "fraction_on_device": frac,
                "grad_uploaded": grad_up,
                "median_ms": med * 1e3,
                "gparam_per_s": results["params"] / med / 1e9,
            }
            results["rows"].append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def split_io_bf16(args: argparse.Namespace) -> int:
    """``--kernel io_bf16``: the split measured with W4's bf16-moment, fp16-I/O host step
    (see the module's docstring)."""
    import torch
    from _adam import fused_adam_

    from offload_optim import single_pass
    from offload_optim.kernels import AdamHyper

    if not torch.cuda.is_available():
        print("split_step_bench: needs CUDA", file=sys.stderr)
        return 2
    single_pass.require_fp16_io()
    chunk = int(args.chunk)
    n_chunks = max(1, int(args.params) // chunk)
    dev = torch.device("cuda")
    bf16, fp16 = torch.bfloat16, torch.float16
    hyper = AdamHyper(lr=1e-4, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)

    def pinned(dtype: torch.dtype, fill: float = 0.0) -> torch.Tensor:
        return torch.full((chunk,), fill, dtype=dtype, pin_memory=True)

    print(f"allocating {n_chunks} chunks x {chunk / 1e6:.0f} M params, pinned", file=sys.stderr)
    p = [pinned(torch.float32, 0.5) for _ in range(n_chunks)]
    g = [pinned(fp16, 1e-3) for _ in range(n_chunks)]
    m = [pinned(bf16) for _ in range(n_chunks)]
    v = [pinned(bf16) for _ in range(n_chunks)]
    p16 = [pinned(fp16) for _ in range(n_chunks)]  # the fp16 copy the next forward uploads
    step = torch.ones(())
    step_d = torch.ones((), device=dev)
    # Per slot: master, fp16 gradient, bf16 moments, fp16 parameter, and fp32 work space
    # for the widened gradient and moments.
    slots = [
        [
            torch.empty(chunk, device=dev),
            torch.full((chunk,), 1e-3, dtype=fp16, device=dev),
            torch.empty(chunk, dtype=bf16, device=dev),
            torch.empty(chunk, dtype=bf16, device=dev),
            torch.empty(chunk, dtype=fp16, device=dev),
        ]
        for _ in range(args.slots)
    ]
    work = [torch.empty(chunk, device=dev) for _ in range(3)]  # on the compute stream only
    ring = _Ring(len(slots))

    def stream_chunk(i: int, grad_up: bool) -> None:
        sp, sg, sm, sv, s16 = slots[i % len(slots)]

        def step_on_device() -> None:
            g32, m32, v32 = work
            g32.copy_(sg)
            m32.copy_(sm)
            v32.copy_(sv)
            fused_adam_([sp], [g32], [m32], [v32], [step_d])
            sm.copy_(m32)
            sv.copy_(v32)
            s16.copy_(sp)

        ups = [(sp, p[i]), (sm, m[i]), (sv, v[i])] + ([(sg, g[i])] if grad_up else [])
        ring.stream(i, ups, step_on_device, [(p[i], sp), (m[i], sm), (v[i], sv), (p16[i], s16)])

    def run(frac: float, grad_up: bool) -> float:
        k_dev = round(frac * n_chunks)
        torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(k_dev):
            stream_chunk(i, grad_up)
        for i in range(k_dev, n_chunks):  # one region at a time, as the optimizer steps them
            single_pass.adam_fp16_io_(p[i], g[i], m[i], v[i], p16[i], step, hyper)
        torch.cuda.synchronize()
        return time.perf_counter() - started

    results: dict[str, Any] = {
        "kernel": "io_bf16",
        "params": n_chunks * chunk,
        "chunk": chunk,
        "host_threads": torch.get_num_threads(),
    }
    # The gradient is on the device where it is computed: not uploading it comes first.
    return _sweep(run, (False, True), args, results)


if __name__ == "__main__":
    raise SystemExit(main())
