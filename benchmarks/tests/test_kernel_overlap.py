"""benchmarks/kernel_overlap.py: launches beside copies against launches alone."""

from __future__ import annotations

from typing import Any

import pytest
from kernel_overlap import kernel_overlaps, medians_by_kernel


def _span(cat: str, name: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args}


def _events() -> list[dict[str, Any]]:
    # The compute stream (7) runs a GEMM every 100 us: 6 launches of 20 us while a copy
    # runs on stream 57 (0-600 us), then 6 of 10 us alone; one short copy (30 us, under
    # min_copy_us) overlaps a lone launch and does not count. Stream 9 has one kernel.
    events = [_span("gpu_memcpy", "Memcpy HtoD", 57, 0.0, 600.0)]
    events.append(_span("gpu_memcpy", "Memcpy HtoD", 61, 700.0, 30.0))
    for i in range(12):
        dur = 20.0 if i < 6 else 10.0
        events.append(_span("kernel", "gemm", 7, 100.0 * i, dur, grid=[2, 66, 1]))
    events.append(_span("kernel", "other", 9, 50.0, 5.0, grid=[1, 1, 1]))
    return events


def test_launches_beside_copies_and_alone_are_told_apart() -> None:
    (k,) = kernel_overlaps(_events(), min_count=10)
    assert (k.name, k.grid) == ("gemm", "[2, 66, 1]")
    assert (k.beside, k.alone) == (6, 6)
    assert k.beside_median_us == 20.0 and k.alone_median_us == 10.0
    assert k.ratio == pytest.approx(2.0)
    assert k.total_us == pytest.approx(180.0)
    assert kernel_overlaps(_events(), min_count=13) == []


def test_medians_by_kernel_cover_every_stream() -> None:
    got = medians_by_kernel(_events())
    assert got[("gemm", "[2, 66, 1]")] == pytest.approx(15.0)
    assert got[("other", "[1, 1, 1]")] == pytest.approx(5.0)
