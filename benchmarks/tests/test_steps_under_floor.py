"""``offload_bench.steps_under_floor`` on recorded rows: the host part of the plan's own
floor is taken at the plan's host rate where that is faster than the profile's fused one."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from offload_bench import steps_under_floor

RESULTS = Path(__file__).resolve().parent.parent / "results"


def _row(name: str, workload: str, kind: str) -> dict[str, Any]:
    row: dict[str, Any] = json.loads((RESULTS / name).read_text())["results"][workload][kind]
    return row


def _plan_rate_ratio(row: dict[str, Any]) -> float:
    ratio: float = row["profile"]["host_adam_gparam"] / row["profile_host_adam_gparam"]
    return ratio


def test_calibrated_bf16_moments_row_has_no_step_under_its_plan_floor() -> None:
    # Session 34, W4 with bf16 moments planned again at the loop's 5.71 Gparam/s; the
    # profile's fused fp32 rate is 3.74. At the fused rate the host part is 1028 ms and 5
    # of the row's 10 steps (982-1085 ms) fall under it; at the plan's rate it is 673 ms,
    # under the H2D part (703 ms), and no step does.
    row = _row("s34c2_W4_calib1.json", "W4", "ours_io_bf16m_spec1_stream")
    assert steps_under_floor(row["steps_ms"], row["floor_parts_ms"]) == 5
    ratio = _plan_rate_ratio(row)
    assert ratio > 1.5
    assert steps_under_floor(row["steps_ms"], row["floor_parts_ms"], ratio) == 0


def test_a_plan_rate_slower_than_the_fused_one_keeps_the_fused_floor() -> None:
    steps = [90.0, 110.0, 120.0]
    parts = {"h2d": 50.0, "d2h": 40.0, "host_adam": 100.0}
    assert steps_under_floor(steps, parts) == 1
    assert steps_under_floor(steps, parts, 0.5) == 1  # never raises the floor
    assert steps_under_floor(steps, parts, 2.0) == 0  # host part 50 ms, as the H2D part


def test_rows_without_parts_count_nothing() -> None:
    assert steps_under_floor([1.0, 2.0], {}) == 0
    assert steps_under_floor([1.0, 2.0], {"host_adam_all_host_state": 10.0}) == 0


def test_a_row_whose_floor_parts_are_all_zero_has_no_floor_and_tabulates() -> None:
    """Session 55's W1 row of ours alone: nothing crosses PCIe or steps on the host, so
    every part is 0; the table once divided by it."""
    from offload_bench import issue_floor, markdown

    path = Path(__file__).resolve().parent.parent / "results" / "s55c6_W1_span.json"
    doc = json.loads(path.read_text())
    row = doc["results"]["W1"]["ours"]
    assert row["floor_parts_ms"] and not any(row["floor_parts_ms"].values())
    assert issue_floor(row, None) is None
    table = markdown(doc["results"], doc["meta"])
    assert "| W1 gpt2_medium 64x8 @ 16 GiB |" in table
