"""streamed_count.py: rows grouped by how many regions their plans streamed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import streamed_count


def _row(step: float, streamed: list[int], **extra: Any) -> dict[str, Any]:
    return {
        "ok": True,
        "step_ms": step,
        "step_mean_ms": step + 5,
        "pred_step_ms": step - 20,
        "streamed_region_indices": streamed,
        **extra,
    }


def test_rows_are_grouped_by_regions_streamed_under_the_workloads_own_budget(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kind = "ours_io_spec1_stream"
    files = {
        "s48c2_W3.json": {"W3": {kind: _row(270.0, [1, 2, 8, 14])}},
        "s50c2_W3.json": {"W3": {kind: _row(246.0, [1, 11]), "full_gpu_master": {"ok": True}}},
        "s50c3_W3.json": {"W3": {kind: _row(250.0, [1, 11])}},
        # Another budget (a diagnostic), another workload, a failed row: left out.
        "s50c4_W3.json": {"W3": {kind: _row(200.0, [1], budget_gib=120)}},
        "s50c5_W2.json": {"W2": {kind: _row(330.0, [1, 2, 3])}},
        "s50c6_W3.json": {"W3": {kind: {"ok": False}}},
    }
    paths = []
    for name, results in files.items():
        path = tmp_path / name
        path.write_text(json.dumps({"meta": {}, "results": results}))
        paths.append(path)
    found = streamed_count.groups(paths, "W3", kind)
    assert sorted(found) == [2, 4]
    assert sorted(found[2].steps_ms) == [246.0, 250.0]
    assert sorted(found[2].predicted_ms) == [226.0, 230.0]
    assert found[2].sessions == {"s50"} and found[4].sessions == {"s48"}
    assert streamed_count.main([str(p) for p in paths]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2:] == [
        "| 2 | 2 (s50) | 246.0-250.0 | 226.0-230.0 |",
        "| 4 | 1 (s48) | 270.0-270.0 | 250.0-250.0 |",
    ]
