"""backward_ops.py on a hand-built trace (no GPU)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import backward_ops
from step_trace import load_trace

NODE = backward_ops.NODE


def _x(name: str, ts: float, dur: float, tid: int = 1) -> dict[str, Any]:
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "tid": tid}


EVENTS = [
    _x("speculative step 5", 100, 100, tid=2),
    # Two matrix products' backward beside the host step, one before it.
    _x(NODE + "AddmmBackward0", 110, 300),
    _x(NODE + "AddmmBackward0", 150, 200),
    _x(NODE + "AddmmBackward0", 0, 50),
    # A region's hook: 1000 us, with a copy and its runtime call inside, and a short one.
    _x(NODE + "torch::autograd::AccumulateGrad", 400, 1000),
    _x("torch::autograd::AccumulateGrad", 401, 998),
    _x("aten::copy_", 500, 300),
    _x("cudaMemcpyAsync", 550, 100),
    _x(NODE + "torch::autograd::AccumulateGrad", 2000, 10),
    # Not inside the hook: another thread's copy, and one after it.
    _x("aten::copy_", 500, 300, tid=3),
    _x("aten::copy_", 1500, 300),
]


def test_operators_split_by_the_speculative_steps_and_the_hooks_broken_down() -> None:
    during, outside = backward_ops.op_split(EVENTS, "AddmmBackward0")
    assert sorted(during) == [200.0, 300.0] and outside == [50.0]
    n, total, time_us, count = backward_ops.hook_children(EVENTS, 200)
    assert (n, total) == (1, 1000.0)
    assert time_us == {"aten::copy_": 300, "cudaMemcpyAsync": 100}
    assert count == {"aten::copy_": 1, "cudaMemcpyAsync": 1}


def test_the_report_names_both_traces(tmp_path: Path) -> None:
    ours, full = tmp_path / "ours.json.gz", tmp_path / "full.json"
    with gzip.open(ours, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    full.write_text(json.dumps({"traceEvents": [_x(NODE + "AddmmBackward0", 0, 120)]}))
    lines = backward_ops.report(
        load_trace(ours)["traceEvents"],
        ["AddmmBackward0"],
        200,
        load_trace(full)["traceEvents"],
    )
    assert lines[0] == (
        "AddmmBackward0: 2 during speculative steps, median 250 us; 1 outside, median 50 us;"
        " total 0.6 ms; against: 1, median 120 us, total 0.1 ms"
    )
    assert lines[1] == "gradient hooks over 200 us: 1, 1.0 ms in all; inside them:"
    assert lines[2].split() == ["0.3", "ms", "1", "aten::copy_"]
    assert backward_ops.main([str(ours), "--against", str(full)]) == 0
