"""benchmarks/thread_stalls.py: cheap operators that took long on the issuing threads."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
from thread_stalls import issuing_threads, main, stalls


def _span(name: str, tid: int, ts: float, dur: float) -> dict[str, Any]:
    return {"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur}


# Times in us. Thread 1 steps the optimizer: a stack whose unsqueeze took 8 ms; thread 2
# drives backward: one view at 20 us; thread 3 (a host worker) has a slow view that is
# not an issuing thread's, and the main thread's slow copy is not a cheap operator.
EVENTS = [
    _span("Optimizer.step#AMPOptimizer.step", 1, 1000.0, 15000.0),
    _span("aten::stack", 1, 2000.0, 9000.0),
    _span("aten::unsqueeze", 1, 2100.0, 8000.0),
    _span("aten::as_strided", 1, 2100.0, 7990.0),
    _span("aten::view", 1, 12000.0, 5.0),
    _span("cudaMemcpyAsync", 1, 12500.0, 3000.0),
    _span("autograd::engine::evaluate_function: AddmmBackward0", 2, 0.0, 500.0),
    _span("aten::view", 2, 100.0, 20.0),
    _span("aten::view", 3, 100.0, 5000.0),
]


def test_the_issuing_threads_are_found_by_what_they_ran() -> None:
    assert issuing_threads(EVENTS) == {"main": {1}, "backward": {2}}


def test_stalls_are_cheap_operators_over_the_limit_with_their_outermost_operator() -> None:
    found = stalls(EVENTS, over_ms=1.0)
    count, long = found["main"]
    assert count == 3  # unsqueeze, as_strided, view; the copy is not cheap
    # The as_strided inside the unsqueeze is the same wait.
    assert [(s.name, s.inside) for s in long] == [
        ("aten::unsqueeze", "Optimizer.step#AMPOptimizer.step")
    ]
    assert long[0].at_ms == pytest.approx(2.1) and long[0].ms == pytest.approx(8.0)
    assert found["backward"] == (1, [])


def test_the_command_prints_each_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": EVENTS}, f)
    assert main([str(path), "--over-ms", "5"]) == 0
    out = capsys.readouterr().out
    assert "main: 3 cheap operators, 1 over 5 ms (8.0 ms)" in out
    assert "backward: 1 cheap operators, 0 over 5 ms (0.0 ms)" in out
    with pytest.raises(SystemExit):
        main([str(path), "--over-ms", "0"])
