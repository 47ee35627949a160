"""benchmarks/host_memory_bound.py: the bytes a step moves through host memory, on recorded
H200 rows (BENCHMARKS.md, session 33) and on made-up rows whose counts are known."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import host_memory_bound as hmb
import pytest

RESULTS = Path(__file__).resolve().parent.parent / "results"
RATES = RESULTS / "s33c1_host_memory.json"


def _row(path: Path, workload: str, kind: str) -> dict[str, Any]:
    row: dict[str, Any] = json.loads(path.read_text())["results"][workload][kind]
    return row


def test_rates_file_gives_the_largest_or_the_named_condition() -> None:
    gbps, condition = hmb.host_memory_gbps(RATES)
    assert condition == "duplex"
    assert gbps == pytest.approx(146.2, abs=0.05)
    copies, _ = hmb.host_memory_gbps(RATES, "copies")
    assert copies == pytest.approx(136.2, abs=0.05)
    with pytest.raises(ValueError, match="alone"):
        hmb.host_memory_gbps(RATES, "alone")  # Adam alone: no copies, no host_memory_gbps


def test_w2_moves_about_34_bytes_per_host_state_parameter_whatever_the_plan() -> None:
    kind = "ours_io_spec1_stream"
    first = hmb.step_bytes(_row(RESULTS / "s33c1_W2_s.json", "W2", kind), kind)
    other = hmb.step_bytes(_row(RESULTS / "s33c2_W2_s.json", "W2", kind), kind)
    assert first is not None and other is not None
    assert first.total == pytest.approx(50.0e9, rel=0.01)
    assert first.total / first.host_state_params == pytest.approx(33.8, abs=0.1)
    # The two plans stream different regions (10 and 9): the copies and the host step
    # trade bytes, and the total stays within 0.5%.
    assert first.up != pytest.approx(other.up, rel=0.05)
    assert first.host_adam != pytest.approx(other.host_adam, rel=0.05)
    assert first.total == pytest.approx(other.total, rel=0.005)


def _made_up(kind_moments: str = "fp32", recorded: bool = True) -> dict[str, Any]:
    h2d, d2h, host_params, all_host = 8e9, 6e9, 1e9, 1.25e9
    row: dict[str, Any] = {
        "ok": True,
        "step_ms": 400.0,
        "step_mean_ms": 420.0,
        "profile_host_adam_gparam": 4.0,
        "profile": {"h2d_gbps": 50.0, "d2h_gbps": 40.0},
        "floor_parts_ms": {
            "h2d": h2d / 50e9 * 1e3,
            "d2h": d2h / 40e9 * 1e3,
            "host_adam": host_params / 4e9 * 1e3,
            "host_adam_all_host_state": all_host / 4e9 * 1e3,
        },
    }
    if recorded:
        row["floor_bytes"] = {"h2d": h2d, "d2h": d2h, "host_params": host_params}
    return row


@pytest.mark.parametrize("recorded", [True, False])
def test_made_up_row_bytes(recorded: bool) -> None:
    b = hmb.step_bytes(_made_up(recorded=recorded), "ours_io_spec1_stream")
    assert b is not None
    assert b.up == pytest.approx(8e9)
    assert b.down == pytest.approx(6e9)
    assert b.host_adam == pytest.approx(28e9)  # 1e9 parameters at 28 bytes
    assert b.host_state_params == pytest.approx(1.25e9)
    assert b.total == pytest.approx(42e9)
    bf16 = hmb.step_bytes(_made_up(recorded=recorded), "ours_io_bf16m_spec1_stream")
    assert bf16 is not None and bf16.host_adam == pytest.approx(20e9)


def test_rows_without_fp16_io_or_offloading_are_left_out() -> None:
    assert hmb.step_bytes(_made_up(), "ours_spec1") is None
    assert hmb.step_bytes({"ok": True, "step_ms": 40.0}, "ours_io") is None


def test_main_prints_each_row_against_its_host_memory_time(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bench = tmp_path / "made_up.json"
    bench.write_text(json.dumps({"results": {"W2": {"ours_io_spec1_stream": _made_up()}}}))
    rates = tmp_path / "rates.json"
    rates.write_text(json.dumps({"rows": [{"condition": "duplex", "host_memory_gbps": 140.0}]}))
    assert hmb.main(["--rates", str(rates), str(bench), str(rates)]) == 0
    out = capsys.readouterr().out
    # 42 GB at 140 GB/s: 300 ms; the step's 400 ms is 1.33x, its run mean 1.40x.
    assert "| made_up.json | W2 | ours_io_spec1_stream | 8.0 / 6.0 / 28.0 | 42.0; 33.6 |" in out
    assert "| 300 ms | 400 ms (420) | 1.33x (1.40x) |" in out
    assert "1 rows; step / host-memory time 1.33x to 1.33x" in out
