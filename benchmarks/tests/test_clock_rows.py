"""benchmarks/clock_rows.py on session 39's recorded rows and on made-up ones."""

from __future__ import annotations

import json
from pathlib import Path

import clock_rows

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_session_39s_w3_rows_show_ours_clocked_below_full_gpu() -> None:
    out = clock_rows.lines([RESULTS / "s39c1_W3_res.json"])
    assert len(out) == 2
    ours, full = out
    assert "ours_io_spec1_stream: 231.8 ms (run 232.6)" in ours
    assert "budget 120 GiB" in ours and "SM 1830 MHz (least 1740), 690 W" in ours
    assert "full_gpu: 205.6 ms" in full and "forward+backward 193.8 ms" in full
    assert "SM 1980 MHz" in full and "495 W" in full


def test_rows_without_clocks_and_failed_rows(tmp_path: Path) -> None:
    path = tmp_path / "a.json"
    rows = {
        "ours": {"ok": True, "step_ms": 10.0},
        "fsdp2": {"ok": False, "error": "host out of memory"},
        "full_gpu": {"ok": True, "step_ms": 9.0, "gpu_clocks": {"error": "no pynvml"}},
        "full_gpu_amp": {
            "ok": True,
            "step_ms": 11.0,
            "loss_before": 6.93,
            "loss_after": 6.5,
            "loss_scale_after": 65536.0,
            "recipe": "amp",
        },
    }
    path.write_text(json.dumps({"meta": {}, "results": {"W1": rows}}))
    assert clock_rows.lines([path]) == [
        "a.json W1 ours: 10.0 ms, no clocks (not recorded)",
        "a.json W1 full_gpu: 9.0 ms, no clocks (no pynvml)",
        "a.json W1 full_gpu_amp: 11.0 ms, recipe amp, loss 6.930 -> 6.500, scale after 65536, "
        "no clocks (not recorded)",
    ]
    assert clock_rows.main([str(path)]) == 0
    empty = tmp_path / "b.json"
    empty.write_text(json.dumps({"results": {}}))
    assert clock_rows.main([str(empty)]) == 1
