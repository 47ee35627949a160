"""offload_bench.kernel_cpu_summary: the CPU probe's kernels split into long ones and the
rest (gpu_session.sh cpuprobe)."""

from __future__ import annotations

import pytest
from offload_bench import LONG_KERNEL, kernel_cpu_summary

from offload_optim.single_pass import KernelCpu


def test_long_kernels_are_told_by_their_time_per_parameter() -> None:
    # Three kernels at 1 ms per million parameters on 16 cores, one of twice the size at
    # the same rate (not long), and one 4x slower per parameter that had 5 cores of the
    # process and 12 of the machine (7 taken by other processes).
    fast = [KernelCpu(0.010, 0.160, 0.160, 16, 10_000_000) for _ in range(3)]
    big = KernelCpu(0.020, 0.320, 0.330, 16, 20_000_000)
    slow = KernelCpu(0.040, 0.200, 0.480, 16, 10_000_000)
    out = kernel_cpu_summary([*fast, big, slow])
    assert out["long"] == {
        "count": 1,
        "wall_ms": pytest.approx(40.0),
        "threads": 16.0,
        "process_cores": pytest.approx(5.0),
        "machine_cores": pytest.approx(12.0),
        "other_cores": pytest.approx(7.0),
    }
    rest = out["rest"]
    assert rest["count"] == 4 and rest["wall_ms"] == pytest.approx(10.0)
    assert rest["process_cores"] == pytest.approx(16.0)
    assert rest["other_cores"] == pytest.approx(0.0)
    assert LONG_KERNEL == 2.0


def test_an_unread_machine_and_no_kernels() -> None:
    assert kernel_cpu_summary([]) == {}
    out = kernel_cpu_summary([KernelCpu(0.01, 0.08, None, 8, 1000)])
    assert out["rest"]["machine_cores"] is None and out["rest"]["other_cores"] is None
    assert out["rest"]["process_cores"] == pytest.approx(8.0)
    assert out["long"]["count"] == 0 and out["long"]["wall_ms"] is None


def test_pin_rows_says_a_part_in_words() -> None:
    from pin_rows import kernel_cpu_cell

    slow = KernelCpu(0.040, 0.200, 0.480, 16, 10_000_000)
    cell = kernel_cpu_cell(kernel_cpu_summary([slow])["rest"])
    assert cell == (
        "1 kernels, 40.0 ms on 16 threads; cores of the process 5.0, of the machine 12.0, "
        "of other processes 7.0 (medians)"
    )
    assert "of the machine -," in kernel_cpu_cell({"count": 0, "machine_cores": None})


def test_pin_rows_says_the_rings_rate_in_the_loop() -> None:
    from pin_rows import ring_up_cell

    cell = ring_up_cell(
        {
            "loop_fraction": 0.68,
            "planned_fraction": 0.78,
            "gbps": 37.6,
            "bytes_per_step": 6 << 30,
            "ms_per_step": 171.4,
            "steps": 20,
        }
    )
    assert cell == (
        "ring's copies up at 37.6 GB/s, 0.68 of the profile's H2D rate (planned 0.78), "
        "171 ms a step"
    )
