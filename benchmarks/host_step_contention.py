"""The host Adam step's rate alone and beside what runs with it in training: a probe.

While the host steps optimizer state in training, two other things use the same machine:
the main thread issues the next forward's kernels (one core busy in Python and the CUDA
driver), and pinned copies (the next forward's uploads, the last gradients, the streamed
regions' state) read and write host memory. This script steps ``--params`` fp32
parameters region by region (``--region`` parameters each) on a worker thread with
torch's fused Adam, as the optimizer does, under each condition and thread count:

- ``alone``: nothing else runs;
- ``issue``: the main thread launches small CUDA kernels in a loop meanwhile;
- ``copies``: a side stream copies pinned host buffers to and from the device meanwhile;
- ``both``;
- ``duplex``: two side streams copy at once, one up and one down, as the training step's
  prefetches and gradient copies can (both copy engines busy).

    python benchmarks/host_step_contention.py --params 1.4e9 --region 48e6 --json out.json

Without CUDA only ``alone`` and ``issue`` (a Python loop) run. Times are medians of
``--repeats`` steps; rates in Gparam/s (1e9 parameters per second).

Each row also gives the host memory the step moved per second, ``adam_gbps`` (28 bytes
per parameter: the fp32 parameter, gradient and moments read, the parameter and moments
written; GB = 1e9 bytes), and under ``copies``, ``both`` and ``duplex`` the pinned copies' rate
over the same time, ``copy_gbps`` (every byte copied is read from or written to host
memory), and their sum, ``host_memory_gbps``: what host memory carried for the two at
once, against ``adam_gbps`` alone.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

ADAM_BYTES_PER_PARAM = 28
"""Host memory one fp32 Adam step moves per parameter: parameter, gradient and both moments
read (16 bytes), parameter and moments written (12)."""


def memory_rates(params_per_s: float, copy_rates: list[float]) -> dict[str, float]:
    """The host memory rates of one row, in GB/s (1e9 bytes/s): the Adam step's (at
    ``params_per_s``) and, where ``copy_rates`` (GB/s of pinned copies measured beside
    each repeat) has any above 0, the copies' median and the sum of the two."""
    adam = params_per_s * ADAM_BYTES_PER_PARAM / 1e9
    rates = {"adam_gbps": adam}
    if any(r > 0 for r in copy_rates):
        copies = statistics.median(copy_rates)
        rates |= {"copy_gbps": copies, "host_memory_gbps": adam + copies}
    return rates


def fused_adam_(
    params: list[Any],
    grads: list[Any],
    exp_avgs: list[Any],
    exp_avg_sqs: list[Any],
    steps: list[Any],
) -> None:
    """One in-place fused Adam step over same-device fp32 tensors (torch's kernel, what
    ``HybridAdam(host_kernel="torch")`` runs; lr 1e-4, betas 0.9/0.999, eps 1e-8)."""
    import torch

    torch._fused_adam_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-4, beta1=0.9, beta2=0.999,
        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False, grad_scale=None,
        found_inf=None,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--params", type=float, default=400e6, help="parameters in all")
    parser.add_argument("--region", type=float, default=48e6, help="parameters per region")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--threads", default="", help="intra-op thread counts to try (default: cores, cores-1)"
    )
    parser.add_argument("--json", default="")
    args = parser.parse_args(argv)
    if args.params < args.region or args.region < 1 or args.repeats < 1:
        parser.error("need --params >= --region >= 1 and --repeats >= 1")

    import torch

    cuda = torch.cuda.is_available()
    region = int(args.region)
    n_regions = int(args.params) // region
    cores = os.cpu_count() or 1
    counts = [int(x) for x in args.threads.split(",") if x] or sorted({cores, max(1, cores - 1)})
    pin = cuda
    print(f"{n_regions} regions x {region / 1e6:.0f} M params, pinned={pin}", file=sys.stderr)

    def buf() -> torch.Tensor:
        return torch.zeros(region, dtype=torch.float32, pin_memory=pin)

    params = [buf() for _ in range(n_regions)]
    grads = [buf().add_(1e-3) for _ in range(n_regions)]
    ms = [buf() for _ in range(n_regions)]
    vs = [buf() for _ in range(n_regions)]
    steps = [torch.zeros((), dtype=torch.float32) for _ in range(n_regions)]

    def host_step() -> float:
        t0 = time.perf_counter()
        for i in range(n_regions):
            fused_adam_([params[i]], [grads[i]], [ms[i]], [vs[i]], [steps[i]])
        return time.perf_counter() - t0

    def timed_step(result: list[float], stop: threading.Event) -> None:
        result.append(host_step())
        stop.set()

    copy_src = torch.zeros(64 * 2**20, dtype=torch.float32, pin_memory=pin)  # 256 MiB
    copy_dev = torch.empty(copy_src.shape, device="cuda") if cuda else None
    small = torch.zeros(1024, device="cuda") if cuda else None
    side = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]
    # duplex: its own buffers, so that the copy down does not wait for the copy up.
    down_src = torch.empty(copy_src.shape, device="cuda") if cuda else None
    down_dst = torch.zeros(copy_src.shape, dtype=torch.float32, pin_memory=pin) if cuda else None
    side_down = torch.cuda.Stream() if cuda else None  # type: ignore[no-untyped-call]
    round_trip_bytes = 2 * copy_src.numel() * copy_src.element_size()  # one copy each way

    def load(condition: str, stop: threading.Event) -> float:
        """Runs on the main thread until ``stop`` is set; returns the pinned copies' rate
        over that time in GB/s (0 without copies)."""
        copied = 0
        t0 = time.perf_counter()
        while not stop.is_set():
            if condition in ("copies", "both") and side is not None and copy_dev is not None:
                with torch.cuda.stream(side):
                    copy_dev.copy_(copy_src, non_blocking=True)
                    copy_src.copy_(copy_dev, non_blocking=True)
                copied += round_trip_bytes
                if condition == "copies":
                    side.synchronize()
            if condition == "duplex" and side is not None and side_down is not None:
                assert copy_dev is not None and down_src is not None and down_dst is not None
                with torch.cuda.stream(side):
                    copy_dev.copy_(copy_src, non_blocking=True)
                with torch.cuda.stream(side_down):
                    down_dst.copy_(down_src, non_blocking=True)
                copied += round_trip_bytes
                side.synchronize()
                side_down.synchronize()
            if condition in ("issue", "both"):
                for _ in range(200):
                    if small is not None:
                        small.mul_(1.0)
                if small is not None:
                    torch.cuda.current_stream().synchronize()
        if cuda:
            torch.cuda.synchronize()
        return copied / (time.perf_counter() - t0) / 1e9

    conditions = ["alone", "issue"] + (["copies", "both", "duplex"] if cuda else [])
    rows: list[dict[str, Any]] = []
    host_step()  # first touch
    for threads in counts:
        torch.set_num_threads(threads)
        for condition in conditions:
            samples: list[float] = []
            copy_rates: list[float] = []
            for _ in range(args.repeats):
                stop = threading.Event()
                result: list[float] = []
                worker = threading.Thread(target=timed_step, args=(result, stop))
                worker.start()
                if condition != "alone":
                    copy_rates.append(load(condition, stop))
                worker.join()
                samples.append(result[0])
            med = statistics.median(samples)
            row = {
                "threads": threads,
                "condition": condition,
                "median_ms": med * 1e3,
                "gparam_per_s": n_regions * region / med / 1e9,
                **memory_rates(n_regions * region / med, copy_rates),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.json:
        out = {"params": n_regions * region, "region": region, "cores": cores, "rows": rows}
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
