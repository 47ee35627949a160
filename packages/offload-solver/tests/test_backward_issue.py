"""``CostModel.backward_issue_factor`` ([Note: the backward beside the host] in
``simulators._context``): in a step with host-state regions each backward operation costs
the host that many times ``op_overhead_s`` to issue, issued ahead of the device ([Note:
issuing ahead]) where that takes longer than the pass priced alone; a step whose regions
all keep their state on the device keeps ``op_overhead_s``."""

from __future__ import annotations

import dataclasses
import math

import pytest
from solver_helpers import UNFITTED, flat_hardware, viewed_chain

from offload_solver import (
    CostModel,
    HardwareProfile,
    ModelProfile,
    ParamPlacement,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    get_simulator,
    solve,
)
from offload_solver.simulators._context import issued_starts
from offload_solver.simulators._timeline import KINDS


def test_views_cost_nothing_behind_a_busy_device() -> None:
    # Device seconds 0, 10, 0, 0, 10 (views between two kernels), issued 1 s apart: the
    # views are issued while the first kernel runs; the second kernel starts when it ends.
    starts, end = issued_starts([0.0, 10.0, 0.0, 0.0, 10.0], 1.0)
    assert starts == [1.0, 2.0, 12.0, 12.0, 12.0]
    assert end == 22.0  # each priced at max(device, issue): 1 + 10 + 1 + 1 + 10 = 23


def test_small_kernels_take_their_issue_costs() -> None:
    starts, end = issued_starts([0.1] * 5, 1.0)
    assert starts == [1.0, 2.0, 3.0, 4.0, 5.0]
    assert end == pytest.approx(5.1)
    # Trailing views still have to be issued.
    assert issued_starts([5.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], 1.0)[1] == 7.0


def test_without_issue_costs_operations_run_back_to_back() -> None:
    assert issued_starts([1.0, 2.0, 3.0], 0.0) == ([0.0, 1.0, 3.0], 6.0)


def _small_kernels(regions: int, views: int) -> ModelProfile:
    """Per region one small kernel on its parameter and ``views`` views: at 1e9 FLOP/s
    every operation is far cheaper on the device than the 0.2 s it costs to issue."""
    return viewed_chain(
        regions, views, size_bytes=20, saved_bytes=10, flop=10, bwd_flop=20, name="small"
    )


def _backward_s(
    profile: ModelProfile, hw: HardwareProfile, state: StatePlacement, factor: float = 1.0
) -> float:
    cost_model = dataclasses.replace(UNFITTED, backward_issue_factor=factor)
    ctx = SimulationContext.build(profile, hw, cost_model=cost_model)
    asg = [RegionAssignment(ParamPlacement.RESIDENT, state)] * len(ctx.regions)
    run = get_simulator("sync").run(ctx, asg)
    bwd = [i for i, kind in enumerate(run.kind) if KINDS[kind] == "bwd"]
    return max(run.end[i] for i in bwd) - min(run.start[i] for i in bwd)


def test_host_state_steps_issue_their_backward_at_the_factor() -> None:
    profile = _small_kernels(3, 3)  # 12 operations, each backward one issue-bound
    hw = dataclasses.replace(flat_hardware(flop_per_s=1e9), op_overhead_s=0.2)
    for state in (StatePlacement.DEVICE, StatePlacement.HOST):
        assert _backward_s(profile, hw, state) == pytest.approx(12 * 0.2, rel=1e-3)
    # All on the device: 0.2 s each whatever the factor. Host state: each issued at 0.6 s.
    assert _backward_s(profile, hw, StatePlacement.DEVICE, 3.0) == pytest.approx(12 * 0.2, rel=1e-3)
    assert _backward_s(profile, hw, StatePlacement.HOST, 3.0) == pytest.approx(12 * 0.6, rel=1e-3)


def test_the_factor_issues_ahead_of_a_busy_device() -> None:
    # 10 s of device work per backward kernel: views issued at 3 x 0.2 s hide under it,
    # where priced one by one each would add its issue cost.
    profile = viewed_chain(
        2, 3, size_bytes=20, saved_bytes=10, flop=1000, bwd_flop=10_000, name="busy"
    )
    hw = dataclasses.replace(flat_hardware(), op_overhead_s=0.2)
    priced = _backward_s(profile, hw, StatePlacement.HOST)  # 2 x 10 + 6 x 0.2
    assert priced == pytest.approx(21.2, rel=1e-3)
    # Issued ahead at 0.6 s: the first kernel's issue, its 10 s (the views issued under
    # it), the second kernel's 10 s, then the last three views' issues after it.
    assert _backward_s(profile, hw, StatePlacement.HOST, 3.0) == pytest.approx(
        0.6 + 10 + 10 + 3 * 0.6, rel=1e-3
    )


def test_beside_the_host_the_backward_is_never_shorter_than_alone() -> None:
    # The busy chain above issued ahead at f x 0.2 s spans 0.2 f + 20 + 0.6 f seconds, so
    # any factor under 1.5 would price it under its 21.2 s alone (1.01: 20.8 s). The pass
    # takes the longer: its price rises continuously from the factor 1 and leaves the
    # price alone only where issuing ahead at the factor costs more.
    profile = viewed_chain(
        2, 3, size_bytes=20, saved_bytes=10, flop=1000, bwd_flop=10_000, name="busy"
    )
    hw = dataclasses.replace(flat_hardware(), op_overhead_s=0.2)
    alone = _backward_s(profile, hw, StatePlacement.HOST)
    assert alone == pytest.approx(21.2, rel=1e-3)
    for factor in (1.0, 1.001, 1.01, 1.5):
        assert _backward_s(profile, hw, StatePlacement.HOST, factor) == pytest.approx(
            alone, rel=1e-6
        )
    # Above 1.5 the issued-ahead pass is the longer.
    for factor in (2.0, 3.0, 5.0):
        assert _backward_s(profile, hw, StatePlacement.HOST, factor) == pytest.approx(
            20 + 0.8 * factor, rel=1e-6
        )


def test_the_factor_survives_json_defaults_to_the_fitted_one_and_refuses_the_rest() -> None:
    model = CostModel(backward_issue_factor=2.5)
    assert CostModel.from_json(model.to_json()).backward_issue_factor == 2.5
    assert CostModel().backward_issue_factor == 4.0
    assert CostModel.from_json('{"schema_version": 1}').backward_issue_factor == 4.0
    for bad in (0.5, 0.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="backward_issue_factor"):
            CostModel(backward_issue_factor=bad)


def test_solve_plans_with_the_fitted_factor_unless_told_otherwise() -> None:
    # A bare solve() prices the backward beside host-state regions at CostModel()'s
    # factor, and records it: the busy chain's host-state backward is the pass issued
    # ahead at 4 x 0.2 s, 20 + 0.8 x 4 s (as in the test above), and at factor 1 the
    # pass priced alone, 21.2 s.
    profile = viewed_chain(
        2, 3, size_bytes=20, saved_bytes=10, flop=1000, bwd_flop=10_000, name="busy"
    )
    hw = dataclasses.replace(flat_hardware(), op_overhead_s=0.2)
    fitted = solve(profile, hw, 10**6, state_on_device=False, block_search_range_bytes=0)
    unfitted = solve(
        profile,
        hw,
        10**6,
        state_on_device=False,
        block_search_range_bytes=0,
        cost_model=UNFITTED,
    )
    assert fitted.cost_model == CostModel() and unfitted.cost_model == UNFITTED
    spans = []
    for plan in (fitted, unfitted):
        bwd = [iv for iv in plan.timeline if iv.kind == "bwd"]
        spans.append(max(iv.end_s for iv in bwd) - min(iv.start_s for iv in bwd))
    assert spans == pytest.approx([20 + 0.8 * 4, 21.2], rel=1e-6)
