"""check_stream_rate: the rate the ring's copies up ran at in the loop, against the plan's
cost model's stream_up_fraction ([Note: timing the ring's copies up] in streamed/ring.py), on
CPU plans with made-up timings (the CPU times no copy), and the ring's timing helpers."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
from optim_helpers import batch, offload_module, plan_at_least_budget, tiny_gpt2, train_offload

from offload_optim import (
    AMPOptimizer,
    HybridAdam,
    RegionStepTiming,
    StepReport,
    StreamRateCheck,
    check_stream_rate,
)
from offload_optim.streamed import StreamRing, UpCopy, up_copy_time
from offload_runtime import OffloadModule, default_cpu_profile


def _module() -> OffloadModule:
    return plan_at_least_budget(
        tiny_gpt2(),
        batch(0),
        hardware=default_cpu_profile(),
        device="cpu",
        block_search_range_bytes=0,
        dtype=torch.float32,
        state_on_device=False,
    )


def _trained(keep: int) -> tuple[AMPOptimizer, OffloadModule]:
    module = _module()
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=keep)
    train_offload(amp, module, range(3))
    return amp, module


def _with_ups(report: StepReport, ups: list[tuple[int, float]]) -> StepReport:
    """``report`` with a streamed region's timing per (bytes, seconds) of ``ups``."""
    timings = tuple(
        RegionStepTiming(100 + i, 0.0, 1.0, True, True, up_bytes=n, up_s=s)
        for i, (n, s) in enumerate(ups)
    )
    return dataclasses.replace(report, region_steps=report.region_steps + timings)


def test_a_loop_without_timed_copies_has_no_check() -> None:
    # On the CPU nothing is streamed through a timed ring: no step has a copy up timed.
    amp, _ = _trained(keep=3)
    assert check_stream_rate(amp) is None


def test_the_check_takes_the_medians_of_the_steps_read() -> None:
    amp, module = _trained(keep=3)
    hardware = module.hardware
    assert hardware is not None
    reports = amp.recent_steps()
    made = [
        _with_ups(reports[0], [(4 << 30, 0.05), (2 << 30, 0.1)]),  # 6 GiB in 0.15 s
        _with_ups(reports[1], [(5 << 30, 0.12)]),
        _with_ups(reports[2], [(6 << 30, 0.2), (0, 0.0)]),
    ]
    amp.recent_steps = lambda: made  # type: ignore[method-assign]
    check = check_stream_rate(amp)
    assert check is not None
    assert check.steps == 3
    assert check.up_bytes == 6 << 30 and check.measured_s == pytest.approx(0.15)
    assert check.profile_s == hardware.h2d_time_s(6 << 30)
    assert check.planned_fraction == module.plan.cost_model.stream_up_fraction == 0.78
    assert check.loop_fraction == pytest.approx(min(1.0, check.profile_s / 0.15))
    last = check_stream_rate(amp, last=1)
    assert last is not None and last.steps == 1 and last.measured_s == pytest.approx(0.2)


def test_the_loop_fraction_is_the_profile_time_over_the_measured_at_most_1() -> None:
    check = StreamRateCheck(
        planned_fraction=0.78, up_bytes=10**9, measured_s=0.025, profile_s=0.0175, steps=2
    )
    assert check.loop_fraction == pytest.approx(0.7)
    faster = dataclasses.replace(check, measured_s=0.01)
    assert faster.loop_fraction == 1.0


def test_no_reports_kept_a_bad_count_or_no_profile() -> None:
    amp, _ = _trained(keep=0)
    with pytest.raises(ValueError, match="keep_reports"):
        check_stream_rate(amp)
    amp, _ = _trained(keep=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="last"):
            check_stream_rate(amp, last=bad)  # type: ignore[arg-type]
    module = offload_module(tiny_gpt2(), batch(0))  # hand-made plan: no hardware
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=2)
    train_offload(amp, module, range(2))
    assert check_stream_rate(amp) is None


def test_up_copy_time_sums_the_finished_copies() -> None:
    def event(done: bool, at_ms: float) -> SimpleNamespace:
        return SimpleNamespace(
            query=lambda: done, elapsed_time=lambda end: end.at_ms - at_ms, at_ms=at_ms
        )

    copies = [
        UpCopy(event(True, 0.0), event(True, 2.0), 100),  # type: ignore[arg-type]
        UpCopy(event(True, 5.0), event(True, 8.0), 50),  # type: ignore[arg-type]
        UpCopy(event(True, 9.0), event(False, 9.5), 70),  # type: ignore[arg-type]
    ]
    assert up_copy_time(copies) == (150, pytest.approx(0.005))
    assert up_copy_time([]) == (0, 0.0)


def test_a_ring_on_the_cpu_times_nothing() -> None:
    ring = StreamRing(torch.device("cpu"), torch.float32, False, chunk_numel=8, timed=True)
    assert not ring.timed
    assert ring.take_up_copies() == []
