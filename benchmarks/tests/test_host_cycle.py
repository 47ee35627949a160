"""``offload_bench._host_cycle`` on hand-made step reports: where the host worker's time
goes between two steps, in milliseconds."""

from __future__ import annotations

import pytest
from offload_bench import _host_cycle

from offload_optim import OverlapMode, RegionStepTiming, StepReport


def _report(t0: float, skipped: bool = False) -> StepReport:
    # Backward called at t0; host regions 0 and 1 stepped at t0 + 0.10-0.15 and
    # t0 + 0.17-0.20 (0.02 s apart), a streamed region 2 at t0 + 0.12-0.40 (on the
    # device, not the host's time); step() returned at t0 + 0.16.
    steps = (
        RegionStepTiming(region=0, start_s=t0 + 0.10, end_s=t0 + 0.15, host=True),
        RegionStepTiming(region=2, start_s=t0 + 0.12, end_s=t0 + 0.40, host=True, streamed=True),
        RegionStepTiming(region=1, start_s=t0 + 0.17, end_s=t0 + 0.20, host=True),
    )
    return StepReport(
        step=1,
        skipped=skipped,
        loss_scale=1.0,
        grad_norm=None,
        clip_coef=1.0,
        overlap=OverlapMode.SPECULATIVE,
        region_steps=steps,
        backward_start_s=t0,
        backward_end_s=t0 + 0.09,
        step_end_s=t0 + 0.16,
    )


def test_busy_is_the_reports_host_step_time_and_the_gaps_add_up() -> None:
    reports = [_report(0.0), _report(1.0), _report(2.0)]
    cycle = _host_cycle(reports)
    assert cycle["pairs"] == 2
    assert cycle["busy_ms"] == pytest.approx(reports[0].host_step_s * 1e3)
    assert cycle["busy_ms"] == pytest.approx(80.0)  # 50 + 30 ms; the streamed span is not
    assert cycle["period_ms"] == pytest.approx(1000.0)
    # The 20 ms gap began at 0.15, before step() returned at 0.16.
    assert cycle["idle_inside_until_step_ms"] == pytest.approx(20.0)
    assert cycle["idle_inside_after_step_ms"] == pytest.approx(0.0)
    assert cycle["idle_after_last_ms"] == pytest.approx(800.0)  # 0.20 to the next backward
    assert cycle["idle_before_first_ms"] == pytest.approx(100.0)  # backward to its first step
    assert cycle["last_regions"] == [1, 1]
    # busy, idle inside and idle around the steps make up the period.
    parts = ("busy_ms", "idle_inside_ms", "idle_after_last_ms", "idle_before_first_ms")
    assert sum(cycle[k] for k in parts) == pytest.approx(cycle["period_ms"])


def test_skipped_steps_and_single_reports_give_nothing() -> None:
    assert _host_cycle([_report(0.0)]) == {}
    assert _host_cycle([_report(0.0), _report(1.0, skipped=True)]) == {}
