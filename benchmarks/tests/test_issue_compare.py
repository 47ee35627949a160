"""benchmarks/issue_compare.py --kernels: kernels counted by when they were launched."""

from __future__ import annotations

from typing import Any

import pytest
from issue_compare import compare_kernels, second_step


def _span(cat: str, name: str, ts: float, dur: float, tid: int = 1, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _trace(gemm_us: float) -> dict[str, Any]:
    # Two Optimizer.step spans end at 1000 and 5000 us: the window is [1000, 5000). A GEMM
    # launched at 900 (before it) runs at 1200; one launched at 4900 runs at 5100, after
    # the window's end, and still counts; one launched at 5100 does not.
    return {
        "traceEvents": [
            _span("user_annotation", "Optimizer.step#AdamW.step", 500.0, 500.0),
            _span("user_annotation", "Optimizer.step#AdamW.step", 4500.0, 500.0),
            _span("cpu_op", "aten::mm", 890.0, 20.0),
            _span("cuda_runtime", "cudaLaunchKernel", 900.0, 5.0, correlation=1),
            _span("cpu_op", "aten::mm", 4890.0, 20.0),
            _span("cuda_runtime", "cudaLaunchKernel", 4900.0, 5.0, correlation=2),
            _span("cuda_runtime", "cudaLaunchKernel", 5100.0, 5.0, correlation=3),
            _span("kernel", "gemm", 1200.0, gemm_us, tid=7, correlation=1),
            _span("kernel", "gemm", 5100.0, gemm_us, tid=7, correlation=2),
            _span("kernel", "gemm", 5200.0, gemm_us, tid=7, correlation=3),
        ]
    }


def test_kernels_are_those_launched_in_the_window() -> None:
    step = second_step(_trace(300.0))
    assert step.kernel_count == {"gemm": 1}
    assert step.kernel_ms["gemm"] == pytest.approx(0.3)


def test_kernel_differences_name_both_sides() -> None:
    lines = compare_kernels(second_step(_trace(330.0)), second_step(_trace(300.0)), ("a", "b"), 5)
    assert lines[0].startswith("kernels: a 0.3 ms")
    assert "+   0.03 ms" not in lines[1] and "+0.03 ms (  0.33 /   0.30)" in lines[1]
    assert lines[1].rstrip().endswith("gemm")
