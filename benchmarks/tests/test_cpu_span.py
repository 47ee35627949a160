"""offload_bench.cpu_span_summary: the medians of a row's forward, backward and step calls."""

from __future__ import annotations

import pytest
from offload_bench import cpu_span_summary


def test_medians_in_ms_and_the_count() -> None:
    spans = {
        "forward": [0.010, 0.030, 0.020],
        "backward": [0.200, 0.100, 0.150],
        "step": [0.001, 0.003, 0.002],
    }
    got = cpu_span_summary(spans)
    assert got is not None
    assert got["forward"] == pytest.approx(20.0)
    assert got["backward"] == pytest.approx(150.0)
    assert got["step"] == pytest.approx(2.0)
    assert got["calls"] == 3


def test_nothing_timed_gives_none() -> None:
    assert cpu_span_summary(None) is None
    assert cpu_span_summary({"forward": [], "backward": [], "step": []}) is None
