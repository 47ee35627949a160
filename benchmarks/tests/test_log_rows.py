"""benchmarks/log_rows.py: a cut-off run's finished rows, from its log."""

from __future__ import annotations

import json
from pathlib import Path

import log_rows

RESULTS = Path(__file__).resolve().parent.parent / "results"


def test_finished_rows_are_kept_and_cut_off_lines_are_not(tmp_path: Path) -> None:
    row = {"ok": True, "step_ms": 12.5}
    log = tmp_path / "W4_fsp.log"
    log.write_text(
        "[bench] W4 ours_io_spec1_stream ...\n"
        f"[bench] W4 ours_io_spec1_stream: {json.dumps(row)}\n"
        "| W4 | table lines are not rows |\n"
        "[bench] W4 fsdp2 ...\n"
        '[bench] W4 fsdp2: {"ok": true, "step_ms"\n'  # killed mid-write
    )
    out = tmp_path / "W4_fsp.json"
    assert (
        log_rows.main(
            [
                str(log),
                "--commit",
                "abc",
                "--date",
                "2026-12-01",
                "--torch",
                "2.11",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    data = json.loads(out.read_text())
    assert data["results"] == {"W4": {"ours_io_spec1_stream": row}}
    assert data["meta"]["commit"] == "abc" and "W4_fsp.log" in data["meta"]["command"]
    empty = tmp_path / "empty.log"
    empty.write_text("[bench] W4 fsdp2 ...\n")
    assert (
        log_rows.main(
            [
                str(empty),
                "--commit",
                "abc",
                "--date",
                "d",
                "--torch",
                "t",
                "--json",
                str(tmp_path / "none.json"),
            ]
        )
        == 1
    )
    assert not (tmp_path / "none.json").exists()


def test_the_recorded_session_37_logs_give_the_recorded_rows() -> None:
    for call in ("s37c3", "s37c4"):
        got = log_rows.rows_from_log((RESULTS / f"{call}_W4_fsp.log").read_text())
        kept = json.loads((RESULTS / f"{call}_W4_fsp.json").read_text())["results"]
        assert got == kept and list(got["W4"]) == ["ours_io_spec1_stream"]
