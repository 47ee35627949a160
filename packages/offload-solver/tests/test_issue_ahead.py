"""``HardwareProfile.issue_ahead`` ([Note: issuing ahead] in the engine): the host issues
operations ahead of the device, so operations that launch nothing cost the device nothing
where it is behind, and small kernels still take their issue costs."""

from __future__ import annotations

import dataclasses

import pytest
from solver_helpers import flat_hardware, viewed_chain

from offload_solver import (
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    get_simulator,
)
from offload_solver.simulators._engine import issued_starts


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


def _viewed_chain(regions: int, views: int) -> ModelProfile:
    """Per region one 1000-FLOP (10000 backward) operation on its parameter, then
    ``views`` operations that compute nothing (views)."""
    return viewed_chain(
        regions, views, size_bytes=1000, saved_bytes=1000, flop=1000, bwd_flop=10_000
    )


def _step_s(profile: ModelProfile, hw: HardwareProfile) -> float:
    ctx = SimulationContext.build(profile, hw)
    asg = [RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.DEVICE)] * len(ctx.regions)
    return get_simulator("sync").run(ctx, asg).step_time_s


def test_issue_ahead_drops_the_views_charge_where_the_device_is_the_bound() -> None:
    # 1000 FLOP/s: 1 s forward and 10 s backward per kernel; 3 views each; 0.2 s to issue
    # an operation. Priced one by one, each view costs 0.2 s in both passes.
    profile = _viewed_chain(3, 3)
    per_op = dataclasses.replace(flat_hardware(), op_overhead_s=0.2)
    ahead = dataclasses.replace(per_op, issue_ahead=True)
    charged = _step_s(profile, per_op)
    assert _step_s(profile, ahead) == pytest.approx(charged - 3 * 3 * 2 * 0.2, abs=0.2 * 3 * 2)
    assert _step_s(profile, ahead) < charged


def test_issue_ahead_keeps_issue_bound_steps() -> None:
    # 0.2 s to issue, kernels of 1 ms and 10 ms: the host is the bound either way.
    profile = _viewed_chain(3, 3)
    fast = dataclasses.replace(flat_hardware(flop_per_s=1e6), op_overhead_s=0.2)
    ahead = dataclasses.replace(fast, issue_ahead=True)
    assert _step_s(profile, ahead) == pytest.approx(_step_s(profile, fast), rel=0.05)


def test_issue_ahead_survives_json_and_defaults_to_off() -> None:
    hw = dataclasses.replace(flat_hardware(), issue_ahead=True)
    assert HardwareProfile.from_json(hw.to_json()).issue_ahead is True
    assert flat_hardware().issue_ahead is False
    assert HardwareProfile.from_json(flat_hardware().to_json()).issue_ahead is False


def test_attention_runs_at_its_own_rate_where_known() -> None:
    # 1000 FLOP/s for matmuls; attention at 250 FLOP/s forward and 500 backward.
    hw = dataclasses.replace(
        flat_hardware(), attention_fwd_flop_per_s=250.0, attention_bwd_flop_per_s=500.0
    )
    attn = Operation("sdpa", fwd_flop=1000, bwd_flop=2500, attention=True)
    mm = Operation("mm", fwd_flop=1000, bwd_flop=2500)
    assert hw.operation_device_s(attn) == 4.0
    assert hw.operation_device_s(attn, backward=True) == 5.0
    assert hw.operation_device_s(mm) == 1.0  # matmul rate
    assert flat_hardware().operation_device_s(attn) == 1.0  # rate unknown: matmul rate
    back = HardwareProfile.from_json(hw.to_json())
    assert (back.attention_fwd_flop_per_s, back.attention_bwd_flop_per_s) == (250.0, 500.0)
    profile = ModelProfile("one", (Parameter("w", 10, 20),), (attn,))
    assert ModelProfile.from_json(profile.to_json()).operations[0].attention is True
    with pytest.raises(ValueError, match="attention_fwd_flop_per_s"):
        dataclasses.replace(flat_hardware(), attention_fwd_flop_per_s=-1.0)
