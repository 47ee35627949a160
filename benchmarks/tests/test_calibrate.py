"""BENCH_CALIBRATE's host rate (``offload_optim.HostRateCheck.loop_params_per_s``) on a row of
session 33 whose host ran slower in the loop than planned."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from offload_optim import HostRateCheck

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_recorded_w4_row_calibrates_to_its_loop_rate() -> None:
    # W4 with bf16 moments, session 33 call 3: planned at 5.27 Gparam/s with the host busy
    # 985 ms a step; in the loop it was busy 1134 ms, so the loop ran at about 4.58.
    path = RESULTS / "s33c3_W4_m.json"
    row = json.loads(path.read_text())["results"]["W4"]["ours_io_bf16m_spec1_stream"]
    check = HostRateCheck(
        planned_params_per_s=row["profile"]["host_adam_gparam"] * 1e9,
        planned_busy_s=row["pred_host_busy_ms"] / 1e3,
        measured_busy_s=row["host_cycle"]["busy_ms"] / 1e3,
        steps=row["host_cycle"]["pairs"],
    )
    assert check.busy_ratio == pytest.approx(1.151, abs=0.001)
    assert check.loop_params_per_s / 1e9 == pytest.approx(4.58, abs=0.01)
