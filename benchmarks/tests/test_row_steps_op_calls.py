"""row_steps.py and op_calls.py on small made-up inputs whose answers are known."""

from __future__ import annotations

import json
from pathlib import Path

import op_calls
import row_steps


def test_row_steps_lists_each_successful_row_and_counts_the_slow_ones(
    tmp_path: Path, capsys: object
) -> None:
    def write(name: str, row: dict[str, object]) -> Path:
        path = tmp_path / name
        path.write_text(json.dumps({"results": {"W2": {"fsdp2": row}}}))
        return path

    a = write("a.json", {"ok": True, "step_ms": 600.0, "step_mean_ms": 650.0})
    b = write("b.json", {"ok": True, "step_ms": 700.0, "step_mean_ms": 720.0})
    c = write("c.json", {"ok": False, "error": "host out of memory"})
    assert row_steps.row_steps([a, b, c], "W2", "fsdp2") == [
        ("a.json", 600.0, 650.0),
        ("b.json", 700.0, 720.0),
    ]
    assert row_steps.main(["W2", "fsdp2", str(a), str(b), str(c), "--at-least", "627"]) == 0
    out = capsys.readouterr().out.splitlines()  # type: ignore[attr-defined]
    assert out[-2:] == ["2 rows: 600-700 ms", "1 of 2 at 627 ms or more"]


def test_op_calls_times_each_call_and_names_its_longest_child() -> None:
    def ev(
        name: str, ts: float, dur: float, tid: int = 1, cat: str = "cpu_op"
    ) -> dict[str, object]:
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}

    trace = {
        "traceEvents": [
            ev("aten::embedding", 1000, 2500),
            ev("aten::index_select", 1010, 2400),
            ev("cudaLaunchKernel", 3300, 70, cat="cuda_runtime"),
            ev("aten::embedding", 5000, 100),
            ev("aten::index_select", 5000, 60, tid=2),  # another thread's: not inside
            ev("kernel", 1000, 5, cat="kernel"),  # the device's: not a host event
            # The profiler's own work, on its own thread: overlaps the first call only.
            ev("Activity Buffer Request", 1200, 2000, tid=0, cat="overhead"),
        ]
    }
    calls = op_calls.op_calls(trace, "aten::embedding")
    assert [(c.start_ms, c.duration_us) for c in calls] == [(0.0, 2500.0), (4.0, 100.0)]
    assert (calls[0].longest_child, calls[0].longest_child_us) == ("aten::index_select", 2400.0)
    assert calls[1].longest_child == "-"
    assert calls[0].profiler_overhead == (("Activity Buffer Request", 2000.0),)
    assert calls[1].profiler_overhead == ()
    assert op_calls.op_calls({"traceEvents": []}, "aten::embedding") == []
