"""Why the hardware profile's host Adam rate reads under the benchmark's own timing of it.

    python benchmarks/profile_reads.py --json out.json [--rounds 5] [--profiles 2]

Two readings of torch's fused fp32 host Adam feed every plan of ``offload_bench.py``: the
hardware profile's (``offload_runtime.hardware.measure_host_adam_params_per_s``: 32 M
parameters held as 8 M-element tensors, ``torch.optim.Adam(fused=True)``, the median of 5
steps after a 0.25 s sleep, read three times through the profile) and the bench's
(``offload_optim.measure_host_step_params_per_s``: 64 M parameters in one tensor through
``fused_adam_``, the median of 3 steps). On the H200 machines of sessions 44, 47 and 48 the
profile read 1.40-3.30 Gparam/s where the bench's processes read 3.5-5.2 (BENCHMARKS.md,
session 48), and in session 48 the profile's first read was 1.38 and its midway read,
right after the copy-contention measure, the lower of the other two.

This times both ways, each at both sizes, in alternating order for ``--rounds`` rounds (is
the gap the method or the size?), then, on a CUDA machine, measures the whole profile
``--profiles`` times in this process (nothing is cached) and records each of its host Adam
reads with when it came (is it where a read falls in the profile?). Prints a summary and
writes every reading (parameters/s) to ``--json``. Needs about 1.5 GB of host memory at
the default sizes; about a minute on the H200 machine.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import offload_runtime.hardware as hardware
from offload_optim import measure_host_step_params_per_s

PROFILE_NUMEL = 32 * 2**20
"""The profile's host Adam size (``offload_runtime.hardware._HOST_ADAM_NUMEL``)."""

BENCH_NUMEL = 64 * 2**20
"""The bench's rate samples' size (``measure_host_step_params_per_s``'s default)."""


def ways(profile_numel: int, bench_numel: int) -> dict[str, Callable[[], float]]:
    """Each way of reading the fused host Adam rate (parameters/s), by name: the profile's
    and the bench's method, each at both sizes."""
    return {
        "profile_way_profile_size": lambda: hardware.measure_host_adam_params_per_s(profile_numel),
        "profile_way_bench_size": lambda: hardware.measure_host_adam_params_per_s(bench_numel),
        "bench_way_bench_size": lambda: measure_host_step_params_per_s(torch.float32, bench_numel),
        "bench_way_profile_size": lambda: measure_host_step_params_per_s(
            torch.float32, profile_numel
        ),
    }


def read_rounds(reads: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each way read once a round, the order reversed every other round."""
    out: dict[str, list[float]] = {name: [] for name in reads}
    names = list(reads)
    for i in range(rounds):
        for name in names if i % 2 == 0 else names[::-1]:
            out[name].append(reads[name]())
    return out


def _one_profile(device: torch.device) -> list[dict[str, float]]:
    """One ``measure_hardware`` of ``device``, its host Adam reads recorded: the rate
    (parameters/s), when the read started (seconds from the profile's start) and its size."""
    original = hardware.measure_host_adam_params_per_s
    reads: list[dict[str, float]] = []
    started = time.perf_counter()

    def recording(numel: int = PROFILE_NUMEL, **kwargs: Any) -> float:
        at = time.perf_counter() - started
        rate = original(numel, **kwargs)
        reads.append({"params_per_s": rate, "at_s": at, "numel": float(numel)})
        return rate

    hardware.measure_host_adam_params_per_s = recording  # measure_hardware looks it up
    try:
        hardware.measure_hardware(device)
    finally:
        hardware.measure_host_adam_params_per_s = original
    return reads


def profile_reads(device: torch.device, profiles: int) -> list[list[dict[str, float]]]:
    """Measure the CUDA profile ``profiles`` times (``measure_hardware``: no cache) and
    return each one's host Adam reads (:func:`_one_profile`)."""
    return [_one_profile(device) for _ in range(profiles)]


def summary(result: dict[str, Any]) -> list[str]:
    """Lines for the terminal: each way's median and range, then each profile's reads."""
    lines = []
    for name, values in result["rounds"].items():
        g = [v / 1e9 for v in values]
        lines.append(
            f"{name}: median {statistics.median(g):.2f} Gparam/s "
            f"({min(g):.2f}-{max(g):.2f}, {len(g)} reads)"
        )
    for i, reads in enumerate(result["profiles"]):
        parts = ", ".join(f"{r['params_per_s'] / 1e9:.2f} at {r['at_s']:.1f} s" for r in reads)
        lines.append(f"profile {i + 1}: host Adam reads {parts}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--profiles", type=int, default=2)
    parser.add_argument("--profile-numel", type=float, default=PROFILE_NUMEL)
    parser.add_argument("--bench-numel", type=float, default=BENCH_NUMEL)
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.profiles < 0:
        parser.error("--rounds must be >= 1 and --profiles >= 0")
    profile_numel, bench_numel = int(args.profile_numel), int(args.bench_numel)
    if profile_numel < 1 or bench_numel < 1:
        parser.error("--profile-numel and --bench-numel must be >= 1")
    result: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "profile_numel": profile_numel,
        "bench_numel": bench_numel,
        "rounds": read_rounds(ways(profile_numel, bench_numel), args.rounds),
        "profiles": (
            profile_reads(torch.device("cuda"), args.profiles)
            if args.profiles and torch.cuda.is_available()
            else []
        ),
    }
    args.json.write_text(json.dumps(result, indent=1))
    print("\n".join(summary(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
