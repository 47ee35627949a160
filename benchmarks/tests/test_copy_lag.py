"""benchmarks/copy_lag.py's window: what each stream ran in a span, and each copy's lag."""

from __future__ import annotations

import argparse
import math
from typing import Any

import pytest
from copy_lag import _window, publish_lags, window_activity, window_copies


def _span(cat: str, tid: int, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "tid": tid, "ts": ts, "dur": dur, "args": args}


# Times in us from 0: a copy up issued at 1 ms waits behind another stream's copies and
# runs at 5-7 ms while the compute stream idles; a kernel straddles the window's start.
EVENTS = [
    _span("cuda_runtime", 1, 0.0, 10.0, correlation=1),
    _span("cuda_runtime", 1, 1000.0, 10.0, correlation=2),
    _span("gpu_memcpy", 65, 500.0, 4500.0, correlation=1, bytes=2_000_000),
    _span("gpu_memcpy", 57, 5000.0, 2000.0, correlation=2, bytes=1_000_000),
    _span("gpu_memcpy", 57, 9000.0, 500.0, correlation=99, bytes=10),  # its call not traced
    _span("kernel", 7, 0.0, 2000.0),
    _span("kernel", 7, 7500.0, 1000.0),
]


def test_each_stream_is_counted_inside_the_window_only() -> None:
    got = window_activity(EVENTS, 0.0, 1.0, 8.0)
    assert got[("65", "gpu_memcpy")] == pytest.approx((1, 4.0, 0.5, 5.0))
    assert got[("57", "gpu_memcpy")] == pytest.approx((1, 2.0, 5.0, 7.0))
    # The first kernel runs 0-2 ms and the second 7.5-8.5: 1 and 0.5 ms inside 1-8.
    assert got[("7", "kernel")] == pytest.approx((2, 1.5, 0.0, 8.5))
    assert ("57", "kernel") not in got


def test_copies_that_start_in_the_window_carry_their_issue_time() -> None:
    (copy,) = window_copies(EVENTS, 0.0, 1.0, 8.0)
    assert copy == ("57", 1.0, 5.0, 2.0, 1_000_000)  # issued at 1 ms, ran 4 ms later
    (untraced,) = window_copies(EVENTS, 0.0, 8.0, 10.0)
    assert untraced[0] == "57" and math.isnan(untraced[1])


def test_the_window_option_takes_start_and_end_in_order() -> None:
    assert _window("236:275") == (236.0, 275.0)
    for bad in ("275:236", "236", "a:b", "nan:5", "5:5"):
        with pytest.raises(argparse.ArgumentTypeError):
            _window(bad)


def _mark(name: str, tid: int, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "user_annotation", "name": name, "tid": tid, "ts": ts, "dur": dur}


def test_a_streamed_region_lands_with_its_last_copy_down_and_waits_for_its_publish() -> None:
    # Region 5 is issued by thread 3 at 1-2 ms: two copies down, of which the one issued
    # last lands at 6 ms; it is published at 9 ms. A copy down of another thread inside
    # the span, a copy up and a later issue of region 5 change nothing; region 7's issue
    # has no publish after it and is left out.
    events = [
        _mark("streamed step 5 (issue)", 3, 1000.0, 1000.0),
        _span("cuda_runtime", 3, 1100.0, 5.0, correlation=1),
        _span("cuda_runtime", 3, 1900.0, 5.0, correlation=2),
        _span("cuda_runtime", 4, 1500.0, 5.0, correlation=3),
        _span("cuda_runtime", 3, 1950.0, 5.0, correlation=4),
        {**_span("gpu_memcpy", 29, 3000.0, 1000.0, correlation=1), "name": "Memcpy DtoH"},
        {**_span("gpu_memcpy", 29, 5000.0, 1000.0, correlation=2), "name": "Memcpy DtoH"},
        {**_span("gpu_memcpy", 17, 5000.0, 4000.0, correlation=3), "name": "Memcpy DtoH"},
        {**_span("gpu_memcpy", 21, 5000.0, 6000.0, correlation=4), "name": "Memcpy HtoD"},
        _mark("streamed step 5 (publish)", 9, 9000.0, 100.0),
        _mark("streamed step 5 (publish)", 9, 20000.0, 100.0),
        _mark("streamed step 7 (issue)", 3, 2000.0, 500.0),
    ]
    assert publish_lags(events, 0.0) == [(5, 1.0, 2.0, 6.0, 9.0)]
