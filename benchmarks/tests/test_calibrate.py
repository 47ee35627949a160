"""offload_bench.calibrated_host_rate: the host rate BENCH_CALIBRATE plans again with (the
scaling replay_bench.py's ``--host-rate loop`` applies), on made-up inputs and on a recorded
row of session 33."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from offload_bench import calibrated_host_rate

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_a_host_busier_than_planned_plans_with_a_slower_rate() -> None:
    assert calibrated_host_rate(5e9, 1000.0, 1250.0) == pytest.approx(4e9)
    assert calibrated_host_rate(4e9, 300.0, 240.0) == pytest.approx(5e9)
    assert calibrated_host_rate(4e9, 300.0, 300.0) == pytest.approx(4e9)


@pytest.mark.parametrize(
    ("rate", "planned", "measured"), [(0.0, 1.0, 1.0), (1e9, 0.0, 1.0), (1e9, 1.0, -2.0)]
)
def test_non_positive_inputs_are_refused(rate: float, planned: float, measured: float) -> None:
    with pytest.raises(ValueError, match="positive"):
        calibrated_host_rate(rate, planned, measured)


def test_recorded_w4_row_calibrates_to_its_loop_rate() -> None:
    # W4 with bf16 moments, session 33 call 3: planned at 5.27 Gparam/s with the host busy
    # 985 ms a step; in the loop it was busy 1134 ms, so the loop ran at about 4.58.
    path = RESULTS / "s33c3_W4_m.json"
    row = json.loads(path.read_text())["results"]["W4"]["ours_io_bf16m_spec1_stream"]
    rate = calibrated_host_rate(
        row["profile"]["host_adam_gparam"] * 1e9,
        row["pred_host_busy_ms"],
        row["host_cycle"]["busy_ms"],
    )
    assert rate / 1e9 == pytest.approx(4.58, abs=0.01)
