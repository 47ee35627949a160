"""replay_bench.py: which rows it replays and with what, and a replay of rows measured on
the CPU (nothing allocated on a GPU)."""

from __future__ import annotations

import argparse
import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import replay_bench
from offload_bench import OURS, OursConfig
from replay_bench import (
    _issue_cost_arg,
    backward_issue_factor,
    host_rate,
    iter_rows,
    loop_busy_ms,
    row_config,
    row_cost_model,
    row_hardware,
    row_issue_cost_us,
)


def test_a_rows_configuration_is_its_record_else_its_kinds_name() -> None:
    recorded = {"fp16_io": True, "bf16_moments": False, "speculate": True, "streamed": False}
    assert row_config("anything", {"config": recorded}) == OursConfig(fp16_io=True, speculate=True)
    assert row_config("ours_io_spec1_stream", {}) == OURS["ours_io_spec1_stream"]
    # Kinds of rows written before the kinds were a table, read from their names.
    assert row_config("ours_io_bf16m_spec1", {}) == OursConfig(
        fp16_io=True, host_state="bf16_moments", speculate=True
    )
    assert row_config("ours_spec", {}) == OursConfig(speculate=True)
    assert row_config("ours_bf16m1", {}) == OursConfig(host_state="bf16_moments")
    # A row recorded before the ladder had rungs names bf16 moments by a flag.
    assert row_config("x", {"config": {"bf16_moments": True}}) == OursConfig(
        host_state="bf16_moments"
    )
    assert row_config("ours_hostconv", {}) == OursConfig()
    for not_replayed in ("ours_bf16", "fsdp2", "torchao", "full_gpu_master"):
        assert row_config(not_replayed, {}) is None


def test_the_issue_cost_is_a_number_or_the_rows_own_reads() -> None:
    row = {"issue_cost_us_reads": [20.0, 30.0]}
    assert row_issue_cost_us(row, "reads") == 25.0
    assert row_issue_cost_us(row, "before") == 20.0
    assert row_issue_cost_us(row, 18.0) == 18.0
    assert row_issue_cost_us(row, None) is None
    assert row_issue_cost_us({}, "reads") is None  # no reads: the profile's own
    assert _issue_cost_arg("reads") == "reads" and _issue_cost_arg("19.5") == 19.5
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            _issue_cost_arg(bad)


def test_the_host_rate_is_the_recorded_or_the_samples_median() -> None:
    row = {"host_rate_samples_gparam": [4.0, 6.0, 5.0]}
    assert host_rate(row, "recorded") is None
    assert host_rate(row, "samples") == 5.0e9
    assert host_rate({}, "samples") is None
    with pytest.raises(ValueError, match="recorded or samples"):
        host_rate(row, "blend")
    assert loop_busy_ms({"host_busy_ms": 120.0, "host_step_ms_in_loop": 90.0}) == 120.0
    assert loop_busy_ms({"host_cycle": {"busy_ms": 80.0}}) == 80.0
    assert loop_busy_ms({"host_step_ms_in_loop": 90.0}) == 90.0
    assert loop_busy_ms({}) is None


def test_the_loops_backward_issue_factor_is_its_backward_over_issuing_the_plan() -> None:
    # 1600 operations at 25 us take 40 ms to issue: a backward of 140 ms is 3.5 of that.
    assert backward_issue_factor(0.140, 1600, 25e-6) == pytest.approx(3.5)
    assert backward_issue_factor(0.020, 1600, 25e-6) == 1.0  # never below issuing alone


def test_the_profile_is_the_rows_with_each_figure_given_in_its_place() -> None:
    from offload_solver.hardware import default_hardware

    row = {"hardware": json.loads(default_hardware().to_json())}
    hw = row_hardware(row, 3e9, op_overhead_us=20.0)
    assert hw.host_adam_params_per_s == 3e9 and hw.op_overhead_s == pytest.approx(20e-6)
    assert row_hardware(row) == default_hardware()


def test_the_cost_model_is_the_rows_with_each_factor_given_in_its_place() -> None:
    from offload_solver import CostModel
    from offload_solver.hardware import default_hardware

    # A row that records its cost model; the factors its hardware carries are ignored.
    recorded = {"backward_issue_factor": 3.0, "stream_up_fraction": 0.6, "stream_host_charge": 0.4}
    older = {**json.loads(default_hardware().to_json()), "backward_issue_factor": 4.0}
    row = {"hardware": older, "cost_model": recorded}
    assert row_cost_model(row) == CostModel(**recorded)
    told = row_cost_model(row, backward_issue=2.5, stream_up=0.7, stream_charge=0.25)
    assert told == CostModel(
        backward_issue_factor=2.5, stream_up_fraction=0.7, stream_host_charge=0.25
    )
    # A row written before rows recorded one: the factors its profile carried (1 for any
    # it lacks), and its profile without them, read without a warning.
    row = {"hardware": older}
    assert row_cost_model(row) == CostModel(4.0, 1.0, 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert row_hardware(row) == default_hardware()


def test_rows_are_read_from_row_files_folders_and_older_files(tmp_path: Path) -> None:
    (tmp_path / "W1_ours.json").write_text(
        json.dumps({"meta": {}, "workload": "W1", "kind": "ours", "result": {"ok": True}})
    )
    (tmp_path / "summary.json").write_text(json.dumps({"rows": []}))
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"meta": {}, "results": {"W2": {"ours_io": {}, "fsdp2": {}}}}))
    assert [r[:3] for r in iter_rows(tmp_path)] == [
        ("W1_ours.json", "W1", "ours"),
        ("old.json", "W2", "ours_io"),
        ("old.json", "W2", "fsdp2"),
    ]
    assert [r[:3] for r in iter_rows(old)] == [
        ("old.json", "W2", "ours_io"),
        ("old.json", "W2", "fsdp2"),
    ]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--backward-issue-factor", "0.5", "x"], "--backward-issue-factor must be a finite"),
        (["--stream-up-fraction", "1.5", "x"], "--stream-up-fraction must be in (0, 1]"),
        (["--stream-host-charge", "-1", "x"], "--stream-host-charge must be in [0, 1]"),
        (["/no/such/rows"], "no such file or folder: /no/such/rows"),
    ],
)
def test_bad_arguments_are_refused(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        replay_bench.main(argv)
    assert message in capsys.readouterr().err


def test_rows_measured_on_the_cpu_replay_to_their_own_prediction(
    cpu_rows: dict[str, dict[str, Any]],
    tiny: tuple[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    host, device = tiny
    for kind, result in cpu_rows.items():
        workload = device if kind == "ours" else host
        record = {"meta": {}, "workload": workload, "kind": kind, "result": {**result, "ok": True}}
        (tmp_path / f"{workload}_{kind}.json").write_text(json.dumps(record))
    assert replay_bench.main([str(tmp_path), "--placements"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    rows = [ln for ln in lines if ln.startswith("| T")]
    assert len(rows) == len(cpu_rows)
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        # Planned again with the row's own profile and inputs, the tree predicts what
        # the row's plan predicted.
        then, now = cells[4].split(" (")[0], cells[5].split(" (")[0]
        assert then == now, line
    assert "host span of backward(loss)" in out and "placements: r0:" in out
    summary = [ln for ln in lines if ln.startswith("replayed against the run mean over ")]
    assert [
        ln.split(":")[0].removeprefix("replayed against the run mean over ") for ln in summary
    ] == [
        f"{len(cpu_rows)} rows",
        f"{len(cpu_rows) - 1} T rows",
        "1 T1 rows",
    ]
    # At another backward issue factor, simulated on the plans made with their own.
    assert replay_bench.main([str(tmp_path), "--backward-issue-factor", "3", "--hold-plan"]) == 0
    assert f"replayed against the run mean over {len(cpu_rows)} rows" in capsys.readouterr().out
