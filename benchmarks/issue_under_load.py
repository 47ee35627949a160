"""The op-overhead probe read alone and beside a host Adam step running on another thread.

    python benchmarks/issue_under_load.py [--device cuda] [--numel 64e6] [--rounds 5]
        [--kernel torch|single_pass|both] [--json out.json]

``offload_runtime.hardware.measure_op_overhead_s`` times the forward and backward of a
tiny GPT-2-like graph: what issuing one operation costs the host (seconds per operation,
the simulator's ``op_overhead_s``). The hardware profile reads it with the host otherwise
idle. In a host-bound offloaded step (W2: GPT-2 XL, 64 x 8 tokens, a 3 GB budget) the
backward and forward are issued while the host's Adam steps run on every core; in
session 55's W2 trace the backward's autograd nodes took 122-141 us each and the forward's
operations 116 us beside the host steps, against 50 us for a forward without them and
43-51 us per node in W1's backward (no host steps; all under the profiler).

This reads the probe in alternating pairs: alone, then with a background thread stepping
Adam over ``numel`` fp32 host parameters back to back (torch's fused CPU Adam on torch's
threads, or the single-pass numba kernel the ``ours_io`` rows use), and prints each
kind's medians and their ratio: the issue cost's stretch under host load. Needs about
``16 * numel`` bytes of host memory per kernel kind.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path


def _torch_adam_step(numel: int) -> Callable[[], None]:
    import torch
    from _adam import fused_adam_

    param, grad, m, v = (torch.zeros(numel, dtype=torch.float32) for _ in range(4))
    grad.fill_(1e-3)
    count = torch.zeros((), dtype=torch.float32)

    def step() -> None:
        count.add_(1)
        fused_adam_([param], [grad], [m], [v], [count])

    return step


def _single_pass_step(numel: int) -> Callable[[], None]:
    import torch

    from offload_optim import single_pass
    from offload_optim.kernels import AdamHyper

    single_pass.require()
    param, grad, m, v = (torch.zeros(numel, dtype=torch.float32) for _ in range(4))
    grad.fill_(1e-3)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=False)
    count = torch.zeros((), dtype=torch.float32)

    def step() -> None:
        count.add_(1)
        single_pass.adam_(param, grad, m, v, count, hyper)

    step()  # compiles the kernel
    return step


class _Load:
    """Steps ``step`` back to back on a thread between ``start`` and ``stop``."""

    def __init__(self, step: Callable[[], None]) -> None:
        self._step = step
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.steps = 0
        self.busy_s = 0.0

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="host-adam-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            started = time.perf_counter()
            self._step()
            self.busy_s += time.perf_counter() - started
            self.steps += 1

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--numel", type=float, default=64e6, help="host Adam parameters")
    parser.add_argument("--rounds", type=int, default=5, help="pairs of reads per kernel")
    parser.add_argument("--kernel", choices=("torch", "single_pass", "both"), default="both")
    parser.add_argument("--json", type=Path, help="write the reads here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.numel < 1:
        parser.error("--rounds and --numel must be >= 1")

    import torch

    from offload_runtime.hardware import measure_op_overhead_s

    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: CUDA is not available")
    kinds = ["torch", "single_pass"] if args.kernel == "both" else [args.kernel]
    makers = {"torch": _torch_adam_step, "single_pass": _single_pass_step}
    out: dict[str, object] = {
        "device": args.device,
        "torch_version": torch.__version__,
        "threads": torch.get_num_threads(),
        "numel": int(args.numel),
    }
    measure_op_overhead_s(args.device)  # warm up: kernels picked, allocator filled
    for kind in kinds:
        try:
            step = makers[kind](int(args.numel))
        except (ImportError, RuntimeError) as exc:
            print(f"{kind}: not available ({exc})", file=sys.stderr)
            continue
        load = _Load(step)
        alone: list[float] = []
        loaded: list[float] = []
        for i in range(args.rounds):
            alone.append(measure_op_overhead_s(args.device))
            load.start()
            time.sleep(0.05)  # the load's threads are running
            loaded.append(measure_op_overhead_s(args.device))
            load.stop()
            print(
                f"{kind} round {i + 1}: alone {alone[-1] * 1e6:.1f} us/op, beside host Adam "
                f"{loaded[-1] * 1e6:.1f} us/op",
                flush=True,
            )
        a, b = statistics.median(alone), statistics.median(loaded)
        rate = int(args.numel) * load.steps / load.busy_s / 1e9 if load.busy_s else 0.0
        print(
            f"{kind}: median alone {a * 1e6:.1f} us/op, beside host Adam {b * 1e6:.1f} us/op: "
            f"{b / a:.2f}x (the load stepped at {rate:.2f} Gparam/s)"
        )
        out[kind] = {
            "alone_us": [x * 1e6 for x in alone],
            "loaded_us": [x * 1e6 for x in loaded],
            "ratio": b / a,
            "load_gparam": rate,
        }
    if args.json is not None:
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
