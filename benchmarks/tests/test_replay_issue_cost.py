"""replay_bench.py's per-operation issue cost (a number, or each row's own reads) and which
rows it replans with streamed host steps."""

from __future__ import annotations

import argparse

import pytest
import replay_bench
from replay_bench import _issue_cost_arg, replays_streamed, row_issue_cost_us


def test_reads_replay_a_row_at_the_mean_of_its_own_two_reads() -> None:
    row = {"issue_cost_us_reads": [20.0, 30.0], "profile": {"op_overhead_us": 21.6}}
    assert row_issue_cost_us(row, "reads") == 25.0
    # A row from before the reads were recorded keeps its profile's (None).
    assert row_issue_cost_us({"profile": {"op_overhead_us": 21.6}}, "reads") is None
    # A number replays every row at it; None leaves each row's profile alone.
    assert row_issue_cost_us(row, 18.0) == 18.0
    assert row_issue_cost_us(row, None) is None


def test_before_replays_a_row_at_the_read_taken_before_its_timed_steps() -> None:
    row = {"issue_cost_us_reads": [20.0, 30.0], "profile": {"op_overhead_us": 21.6}}
    assert row_issue_cost_us(row, "before") == 20.0
    assert row_issue_cost_us({"profile": {"op_overhead_us": 21.6}}, "before") is None


def test_the_option_takes_microseconds_or_reads_and_refuses_the_rest() -> None:
    assert _issue_cost_arg("reads") == "reads"
    assert _issue_cost_arg("before") == "before"
    assert _issue_cost_arg("19.5") == 19.5
    for bad in ("-1", "nan", "fast"):
        with pytest.raises(argparse.ArgumentTypeError):
            _issue_cost_arg(bad)


def test_the_bench_reads_the_issue_cost_in_microseconds() -> None:
    from offload_bench import issue_cost_us

    # On the CPU a tiny GPT-2-like graph's operation costs microseconds to tens of them.
    assert 0.1 < issue_cost_us("cpu") < 1000.0


def test_streamed_and_unstreamed_override_the_kind_and_exclude_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    stream, plain = "ours_io_spec1_stream", "ours_io_spec1"
    assert replays_streamed(stream, streamed=False, unstreamed=False)
    assert not replays_streamed(plain, streamed=False, unstreamed=False)
    assert replays_streamed(plain, streamed=True, unstreamed=False)
    assert not replays_streamed(stream, streamed=False, unstreamed=True)
    with pytest.raises(SystemExit):
        replay_bench.main(["--streamed", "--unstreamed", "x.json"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_lane_window_merges_back_to_back_passes_and_lane_busy_sums_each_kind() -> None:
    from types import SimpleNamespace

    from replay_bench import lane_busy, lane_window

    # compute: fwd r0 0-1 ms, fwd r1 1-2 ms (back to back: one span), then, after a wait
    # for a copy up on h2d (1-4 ms), fwd r2 4-5 ms; a host step; a task after the window.
    run = SimpleNamespace(
        lane=[0, 0, 1, 0, 3, 0],
        kind=[0, 0, 10, 0, 5, 1],
        region=[0, 1, 2, 2, 0, 2],
        start=[0.0, 0.001, 0.001, 0.004, 0.0, 0.009],
        end=[0.001, 0.002, 0.004, 0.005, 0.003, 0.010],
    )
    steady = SimpleNamespace(last=run, period_s=0.010)
    assert lane_window(steady, 0.008) == [
        ("compute", "fwd", 1, 0.0, 0.002),
        ("h2d", "stream_up", 2, 0.001, 0.004),
        ("compute", "fwd", 2, 0.004, 0.005),
    ]
    busy = lane_busy(steady)
    assert busy[("compute", "fwd")] == (3, pytest.approx(0.003))
    assert busy[("host", "host_step")] == (1, pytest.approx(0.003))
    assert busy[("compute", "bwd")] == (1, pytest.approx(0.001))


def test_pass_spans_run_from_the_first_task_of_a_pass_to_its_last_end() -> None:
    from types import SimpleNamespace

    from replay_bench import simulated_pass_spans

    # fwd r0 0-1 ms, a wait, fwd r1 3-4 ms; bwd r1 5-7 ms, bwd r0 7-8 ms; a host step.
    run = SimpleNamespace(
        lane=[0, 0, 0, 0, 3],
        kind=[0, 0, 1, 1, 5],
        region=[0, 1, 1, 0, 0],
        start=[0.0, 0.003, 0.005, 0.007, 0.0],
        end=[0.001, 0.004, 0.007, 0.008, 0.006],
    )
    spans = simulated_pass_spans(SimpleNamespace(last=run, period_s=0.010))
    assert spans == {"fwd": pytest.approx(0.004), "bwd": pytest.approx(0.003)}
    # A step without a backward task has no backward span.
    run.kind = [0, 0, 0, 0, 5]
    assert set(simulated_pass_spans(SimpleNamespace(last=run, period_s=0.010))) == {"fwd"}


def test_restate_parses_regions_and_states_and_refuses_the_rest() -> None:
    from replay_bench import _restate_arg

    assert _restate_arg("1=host,2=streamed") == {1: "host", 2: "streamed"}
    for bad in ("1:host", "x=host", "1=gpu", "1=host,"):
        with pytest.raises(argparse.ArgumentTypeError):
            _restate_arg(bad)


def test_restated_w3_plan_is_slower_with_region_1_on_the_host(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from pathlib import Path

    row = Path(__file__).resolve().parent.parent / "results" / "s40c2_W3_mast.json"
    replay_bench.main([str(row), "--restate", "1=host", "--restate", "1=host,11=host"])
    out = capsys.readouterr().out
    lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("restated")]
    assert len(lines) == 2
    replayed = float(out.split("| ours_io_spec1_stream | 255 ms | 228 (-10.7%) | ")[1].split()[0])
    first, both = (float(ln.split("repeating step ")[1].split()[0]) for ln in lines)
    # Session 40's replay: the plan 229, region 1 on the host 237.2, neither streamed 247.3.
    assert replayed < first < both
    assert first == pytest.approx(237.2, abs=1.0) and both == pytest.approx(247.3, abs=1.0)


def test_state_ahead_takes_the_leading_streamed_state_off_the_step(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Session 43's W3 row replays at 230 ms; with regions 1 and 2's streamed state sent
    ahead for free (an upper bound on staging it in backward) the replanned step is
    219 ms. The simulator is itself again afterwards."""
    from pathlib import Path

    from offload_solver.simulators import SimulationContext

    init = SimulationContext.__init__
    row = Path(__file__).resolve().parent.parent / "results" / "s43c3_W3_pub_on2.json"
    steps = []
    for regions in ("0", "3"):
        replay_bench.main([str(row), "--state-ahead", regions])
        out = capsys.readouterr().out
        cell = out.split("| ours_io_spec1_stream | 252 ms | 230 (-9.0%) | ")[1]
        steps.append(float(cell.split()[0]))
    assert steps == [pytest.approx(230.0, abs=1.0), pytest.approx(219.0, abs=1.0)]
    assert SimulationContext.__init__ is init
    with pytest.raises(SystemExit):
        replay_bench.main([str(row), "--state-ahead", "-1"])


def test_late_host_work_is_replayed_as_the_row_recorded_it_unless_told(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Session 51's row planned with host work moved late: regions 0-7 keep their state on
    # the device and region 2 stays resident; without the pass, the greedy phases
    # offload region 2 (prefetched at region 3) with its state on the host.
    from pathlib import Path

    row = Path(__file__).resolve().parent.parent / "results" / "s51c3_W3_late_on1.json"
    found: dict[str, str] = {}
    for how in ("recorded", "no"):
        replay_bench.main([str(row), "--placements", "--late-host-work", how])
        out = capsys.readouterr().out
        lines = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("placements:")]
        assert len(lines) == 1
        found[how] = lines[0]
    late = found["recorded"].split()[1:]
    assert len(late) == 30
    assert all(p == f"r{i}:resident/device" for i, p in enumerate(late[:8]))
    assert "r8:async/host@9" in late and "r29:resident/host" in late
    assert "r2:async/host@3" in found["no"].split()


def test_hold_plan_simulates_the_recorded_plan_under_a_slower_ring(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Session 54's W2 row (predicted 312 ms, 9 streamed regions) replans to 8 streamed
    regions at 318 ms. Held, that plan steps the same under the row's own model, and at
    324 ms with the ring's copies up at 0.67 of the H2D rate."""
    from pathlib import Path

    row = Path(__file__).resolve().parent.parent / "results" / "s54c2_W2_probe.json"
    steps = []
    for args in ([], ["--hold-plan"], ["--hold-plan", "--stream-up-fraction", "0.67"]):
        replay_bench.main([str(row), *args])
        out = capsys.readouterr().out
        cell = out.split("| ours_io_spec1_stream | 383 ms | 312 (-18.5%) | ")[1]
        assert "26 / 28; 26 / 28 (8 streamed)" in cell
        steps.append(float(cell.split()[0]))
    assert steps[0] == steps[1] == pytest.approx(318.0, abs=1.0)
    assert steps[2] == pytest.approx(324.0, abs=1.0)


def test_the_run_mean_summary_counts_rows_within_15_percent() -> None:
    from replay_bench import run_error_line

    line = run_error_line("3 W2 rows", [-0.2, -0.1, 0.15])
    assert line == (
        "replayed against the run mean over 3 W2 rows: mean -5.0%, mean absolute 15.0%, "
        "2 within 15%"
    )
