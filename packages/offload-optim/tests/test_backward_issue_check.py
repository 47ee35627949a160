"""check_backward_issue: the host's time in the loop's backward against issuing the plan's
operations at the profile's cost, on CPU plans with made-up backward times."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from optim_helpers import batch, offload_module, plan_at_least_budget, tiny_gpt2, train_offload

from offload_optim import (
    AMPOptimizer,
    BackwardIssueCheck,
    HybridAdam,
    StepReport,
    check_backward_issue,
)
from offload_runtime import OffloadModule, default_cpu_profile
from offload_solver import CostModel, StatePlacement

ISSUE_S = 20e-6
"""The made-up profile's cost of issuing one operation."""


def _trained(*, state_on_device: bool, issue_s: float = ISSUE_S) -> AMPOptimizer:
    """Three steps of a plan at the least budget (host state), or at 100 times it with
    every region's state on the device."""
    module: OffloadModule = plan_at_least_budget(
        tiny_gpt2(),
        batch(0),
        scale=100 if state_on_device else 1,
        hardware=dataclasses.replace(default_cpu_profile(), op_overhead_s=issue_s),
        device="cpu",
        block_search_range_bytes=0,
        dtype=torch.float32,
        state_on_device=state_on_device,
    )
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=3)
    train_offload(amp, module, range(3))
    return amp


def _spans(amp: AMPOptimizer, seconds: list[float]) -> list[StepReport]:
    """The kept reports with backward spans of ``seconds``, one a report."""
    return [
        dataclasses.replace(r, backward_start_s=10.0, backward_end_s=10.0 + s)
        for r, s in zip(amp.recent_steps(), seconds, strict=True)
    ]


def test_the_factor_issues_the_plans_operations_in_the_measured_backward() -> None:
    amp = _trained(state_on_device=False)
    plan = amp.module.plan
    assert any(rp.state is not StatePlacement.DEVICE for rp in plan.regions)
    ops = max(rp.region.op_end for rp in plan.regions)
    made = _spans(amp, [ops * ISSUE_S * 3, ops * ISSUE_S * 5, ops * ISSUE_S * 4])
    amp.recent_steps = lambda: made  # type: ignore[method-assign]
    check = check_backward_issue(amp)
    assert check is not None
    assert (check.operations, check.op_overhead_s, check.steps) == (ops, ISSUE_S, 3)
    assert check.planned_factor == CostModel().backward_issue_factor  # memory_optimize's
    assert check.measured_s == pytest.approx(ops * ISSUE_S * 4)  # the median
    assert check.loop_factor == pytest.approx(4.0)
    last = check_backward_issue(amp, last=1)
    assert last is not None and last.loop_factor == pytest.approx(4.0)
    first = check_backward_issue(amp, last=3)
    assert first is not None and first.steps == 3


def test_the_factor_is_at_least_1() -> None:
    check = BackwardIssueCheck(
        planned_factor=2.0, operations=1000, op_overhead_s=ISSUE_S, measured_s=0.01, steps=2
    )
    assert check.loop_factor == 1.0  # 10 ms for 1000 operations at 20 us: faster than 1x
    assert dataclasses.replace(check, measured_s=0.05).loop_factor == pytest.approx(2.5)


def test_no_check_without_host_state_an_issue_cost_or_a_timed_backward() -> None:
    # Every region's state on the device: the factor prices nothing there.
    amp = _trained(state_on_device=True)
    assert all(rp.state is StatePlacement.DEVICE for rp in amp.module.plan.regions)
    assert check_backward_issue(amp) is None
    # A profile without an issue cost (the CPU's default).
    assert check_backward_issue(_trained(state_on_device=False, issue_s=0.0)) is None
    # A hand-made plan has no profile.
    module = offload_module(tiny_gpt2(), batch(0))
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=2)
    train_offload(amp, module, range(2))
    assert check_backward_issue(amp) is None
    # Reports without backward times.
    amp = _trained(state_on_device=False)
    made = [dataclasses.replace(r, backward_start_s=None) for r in amp.recent_steps()]
    amp.recent_steps = lambda: made  # type: ignore[method-assign]
    assert check_backward_issue(amp) is None
    with pytest.raises(ValueError, match="last"):
        check_backward_issue(amp, last=0)
