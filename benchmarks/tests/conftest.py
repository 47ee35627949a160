"""The benchmark scripts import each other from benchmarks/: put it on the path. Rows of ours
measured on the CPU at tiny workloads, for the tests of the scripts that read rows."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CPU_HOST_MEMORY_GBPS = 56.0
"""The host memory bandwidth (GB/s) the CPU rows' floors read (:func:`cpu_rows`)."""


@pytest.fixture(scope="session")
def tiny() -> Iterator[tuple[str, str]]:
    """Two tiny workloads of the zoo's gpt2_tiny (2 x 16 tokens): "T", whose 7 MiB budget
    puts optimizer state on the host, and "T1", whose 1 GiB keeps all of it on the device;
    the host Adam probes made small."""
    import offload_bench

    patch = pytest.MonkeyPatch()
    patch.setitem(offload_bench.WORKLOADS, "T", ("gpt2_tiny", 2, 16, 0.007))
    patch.setitem(offload_bench.WORKLOADS, "T1", ("gpt2_tiny", 2, 16, 1))
    patch.setattr(offload_bench, "HOST_PROBE_NUMEL", 1 << 16)
    yield "T", "T1"
    patch.undo()


@pytest.fixture(scope="session")
def cpu_rows(tiny: tuple[str, str]) -> dict[str, dict[str, Any]]:
    """Rows of ours measured on the CPU by ``offload_bench._ours`` (1 warm-up and 5 timed
    steps): the fastest configuration with bf16 moments at "T" (host state: probes,
    speculation, fp16 I/O, streamed costs), the defaults at "T1" stepped in turn with
    full-GPU training's recipe, the stochastic-rounding rung at "T", and the ablation at
    "T". The CPU profile leaves the host's memory bandwidth unknown (0); the rows' floors
    read it at :data:`CPU_HOST_MEMORY_GBPS`, so that they have their host memory part."""
    import offload_bench
    import torch

    from offload_runtime import hardware

    host, device = tiny
    threads = torch.get_num_threads()
    patch = pytest.MonkeyPatch()
    # The issue cost probe times a small graph 10 times: not what these rows test.
    patch.setattr(offload_bench, "issue_cost_us", lambda device="cuda": 12.0)
    # offload_bench reads the profile through the package's attribute (the planner holds
    # its own reference, so plans are made with the CPU profile as it is).
    cpu_profile = hardware.profile_hardware

    def with_host_memory(device: Any = None, **kwargs: Any) -> Any:
        known = CPU_HOST_MEMORY_GBPS * 1e9
        return dataclasses.replace(cpu_profile(device, **kwargs), host_memory_bytes_per_s=known)

    patch.setattr(hardware, "profile_hardware", with_host_memory)
    torch.set_num_threads(1)  # the host worker steps beside the main thread, on 2 cores
    try:
        return {
            "ours_bf16m": offload_bench._ours(host, "ours_bf16m", 1, 5, device="cpu"),
            "ours_bf16_sr": offload_bench._ours(host, "ours_bf16_sr", 1, 5, device="cpu"),
            "ours": offload_bench._ours(device, "ours", 1, 5, pair_full_gpu=True, device="cpu"),
            "ablation": offload_bench._ours(host, "ablation", 0, 5, device="cpu"),
        }
    finally:
        torch.set_num_threads(threads)
        patch.undo()
