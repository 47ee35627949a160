"""Host work moved to later regions after the greedy phases ([Note: host work late] in
``solvers._late``)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from solver_helpers import assignments, chain, engine_cases, flat_hardware, solve_near

from offload_solver import (
    InfeasibleBudgetError,
    ModelProfile,
    ParamPlacement,
    Plan,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    StreamedStepCosts,
    get_simulator,
    solve,
)
from offload_solver.cli import main
from offload_solver.simulators._steady import steady_state
from offload_solver.solve import BUDGET_SAFETY_FACTOR
from offload_solver.solvers._late import move_host_work_late, swapped
from offload_solver.solvers._search import Candidate, SolveStats, evaluate

R, S, A = ParamPlacement.RESIDENT, ParamPlacement.SYNC, ParamPlacement.ASYNC
HOST, DEVICE = StatePlacement.HOST, StatePlacement.DEVICE
COSTS = StreamedStepCosts(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=500)
BUDGET = 16000
"""Bytes: for four regions of ``chain([400] * 4, 100, 200)`` on ``flat_hardware()``,
room for three regions' optimizer state on the device, not four."""


def candidate(ctx: SimulationContext, asg: list[RegionAssignment]) -> Candidate:
    found = evaluate(ctx, get_simulator("async"), SolveStats(), asg)
    assert found is not None
    return found


def test_an_early_host_step_moves_to_the_last_region() -> None:
    # Four regions of 200 parameters, 0.1 s forward and 0.2 s backward each, a host Adam
    # of 100 parameters/s (2 s a region). With region 0's state on the host, its
    # gradients land last and its 2 s host step and upload sit between the backward and
    # the next forward; with region 3's, its gradients land first and its step runs under
    # the rest of the backward and the next forward's first three regions.
    profile = chain([400] * 4, fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware(host_adam_params_per_s=100.0)
    ctx = SimulationContext.build(profile, hardware, block_search_range_bytes=0)
    start = candidate(ctx, [RegionAssignment(R, HOST)] + [RegionAssignment(R, DEVICE)] * 3)
    stats = SolveStats()
    found = move_host_work_late(ctx, get_simulator("async"), 1e9, stats, start)
    assert found.assignment == [RegionAssignment(R, DEVICE)] * 3 + [RegionAssignment(R, HOST)]
    assert found.period_s < start.period_s - 0.5  # nearly 1 s: three computes less waited
    assert found.period_s == candidate(ctx, found.assignment).period_s
    # Region 0 tried at 3 (kept), then region 3 has no later device-state region.
    assert stats.num_simulations >= 2


def test_the_cap_keeps_the_plan() -> None:
    # As above, but region 0 holds twice the parameters of region 3 (the middle two are
    # sized not to merge into one region): moving the host state there puts 200 more
    # parameters' state on the device. Taken with room for it, not with no byte to spare
    # over the start's peak.
    profile = chain([800, 600, 600, 400], fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware(host_adam_params_per_s=100.0)
    ctx = SimulationContext.build(profile, hardware, block_search_range_bytes=0)
    start = candidate(ctx, [RegionAssignment(R, HOST)] + [RegionAssignment(R, DEVICE)] * 3)
    sim = get_simulator("async")
    roomy = move_host_work_late(ctx, sim, 1e9, SolveStats(), start)
    assert roomy.assignment[3] == RegionAssignment(R, HOST)
    assert roomy.peak_bytes > start.peak_bytes
    tight = move_host_work_late(ctx, sim, start.peak_bytes, SolveStats(), start)
    assert tight is start


def test_swapped_keeps_a_prefetch_s_distance_and_refuses_what_cannot_run() -> None:
    profile = chain([400] * 5, fwd_flop=100, bwd_flop=200)
    ctx = SimulationContext.build(profile, flat_hardware(), block_search_range_bytes=0)
    asg = [RegionAssignment(A, HOST, 2)] + [RegionAssignment(R, DEVICE)] * 4
    out = swapped(ctx, asg, 0, 2)
    assert out is not None
    assert out[2] == RegionAssignment(A, HOST, 4)
    assert out[0] == RegionAssignment(R, DEVICE)
    assert out[1:2] + out[3:] == asg[1:2] + asg[3:]
    assert swapped(ctx, asg, 0, 3) is None  # its prefetch would be issued at region 5
    ctx.pinned[4] = True
    sync = [RegionAssignment(S, HOST)] + [RegionAssignment(R, DEVICE)] * 4
    assert swapped(ctx, sync, 0, 4) is None  # a pinned region stays resident
    resident = [RegionAssignment(R, HOST)] + [RegionAssignment(R, DEVICE)] * 4
    assert swapped(ctx, resident, 0, 4) is not None  # but may keep host state


@engine_cases(max_examples=60, where=st.floats(0.0, 1.2))
def test_the_moved_plan_is_no_slower_fits_and_keeps_what_each_region_may_hold(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: Any,
    after_backward: bool,
    where: float,
) -> None:
    ctx = SimulationContext.build(profile, hardware, host_step_after_backward=after_backward)
    asg = data.draw(assignments(ctx.layout))
    start = candidate(ctx, asg)
    cap = start.peak_bytes * where if where > 1 else max(start.peak_bytes, 1)
    stats = SolveStats()
    found = move_host_work_late(ctx, get_simulator("async"), cap, stats, start)
    ctx.validate(found.assignment, allow_async=True)
    assert found.period_s <= start.period_s
    assert found is start or found.peak_bytes <= cap
    # Swaps only: as many regions of each placement and state, host work no earlier.
    roles = Counter((a.placement, a.state) for a, n in zip(asg, ctx.numel, strict=True) if n)
    after = Counter(
        (a.placement, a.state) for a, n in zip(found.assignment, ctx.numel, strict=True) if n
    )
    assert roles == after
    hosts = [r for r, a in enumerate(asg) if a.state is not DEVICE and ctx.numel[r]]
    moved = [r for r, a in enumerate(found.assignment) if a.state is not DEVICE and ctx.numel[r]]
    assert sum(moved) >= sum(hosts)
    assert (found is start) == (stats.num_simulations == 0 or found.assignment == asg)


def test_solve_runs_it_by_default_and_not_when_told() -> None:
    # Room for three regions' state on the device: the greedy phases leave region 0's on
    # the host (state goes to the device for the region whose host step the cold step's
    # critical path runs through, and ties go to the earliest), and its host step then
    # delays the next forward; the pass moves the host state to region 3.
    profile = chain([400] * 4, fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware()
    kw: dict[str, Any] = dict(block_search_range_bytes=0)
    greedy = solve(profile, hardware, BUDGET, late_host_work=False, **kw)
    plan = solve(profile, hardware, BUDGET, **kw)
    assert [rp.state for rp in greedy.regions] == [HOST, DEVICE, DEVICE, DEVICE]
    assert [rp.state for rp in plan.regions] == [DEVICE, DEVICE, DEVICE, HOST]
    assert all(rp.placement is R for rp in plan.regions)
    assert plan.predicted_step_time_s < greedy.predicted_step_time_s - 0.5
    assert plan.predicted_peak_bytes <= BUDGET * BUDGET_SAFETY_FACTOR
    assert plan.num_simulations > greedy.num_simulations
    ctx = SimulationContext.build(profile, hardware, **kw)
    asg = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    sim = get_simulator("async")
    assert steady_state(ctx, asg, sim.run(ctx, asg)).period_s == plan.predicted_step_time_s


@engine_cases(max_examples=40, streamed=st.booleans(), where=st.floats(0.0, 1.2))
def test_solved_plans_are_no_slower_than_without_the_pass(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: Any,
    after_backward: bool,
    streamed: bool,
    where: float,
) -> None:
    # With streamed costs, both plans have regions streamed and the shorter is kept, so
    # the pass never ends a solve longer than the greedy phases alone.
    costs = COSTS if streamed else None
    kwargs: dict[str, Any] = dict(host_step_after_backward=after_backward, streamed=costs)
    budget, greedy = solve_near(profile, hardware, where, late_host_work=False, **kwargs)
    plan = solve(profile, hardware, budget, **kwargs)
    assert plan.predicted_step_time_s <= greedy.predicted_step_time_s
    assert plan.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    if plan.regions != greedy.regions:
        assert plan.predicted_step_time_s < greedy.predicted_step_time_s


def test_the_cli_turns_it_off(tmp_path: Path) -> None:
    profile = chain([400] * 4, fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware()
    (tmp_path / "profile.json").write_text(profile.to_json())
    (tmp_path / "hw.json").write_text(hardware.to_json())
    out = tmp_path / "plan.json"
    args = [str(tmp_path / "profile.json"), "--budget", str(BUDGET)]
    args += ["--hardware", str(tmp_path / "hw.json"), "--block-search-range", "0", "-o", str(out)]
    plans: dict[bool, Plan] = {}
    for late in (True, False):
        assert main(args + ([] if late else ["--no-late-host-work"])) == 0
        plans[late] = Plan.from_json(out.read_text())
        expected = solve(profile, hardware, BUDGET, block_search_range_bytes=0, late_host_work=late)
        assert plans[late].regions == expected.regions
    assert plans[True].regions != plans[False].regions


def test_no_plan_still_names_the_least_budget() -> None:
    # The pass runs on a plan that fits; an infeasible budget still raises.
    with pytest.raises(InfeasibleBudgetError):
        solve(chain([400] * 4, 100, 200), flat_hardware(), 10, late_host_work=True)


@engine_cases(max_examples=30, streamed=st.booleans(), where=st.floats(0.2, 1.2))
def test_the_bounded_pass_plans_as_well_as_trying_every_pair(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: Any,
    after_backward: bool,
    streamed: bool,
    where: float,
) -> None:
    # The pass tries a few early host-state regions with a few late device-state ones
    # (LATE_SWAP_REGIONS, LATE_SWAP_TARGETS); trying every pair, as it once did, plans
    # no shorter step on these profiles (within 1%) and the bounded plan fits the budget.
    from offload_solver.solvers import _late

    kwargs: dict[str, Any] = dict(
        host_step_after_backward=after_backward, streamed=COSTS if streamed else None
    )
    budget, _ = solve_near(profile, hardware, where, late_host_work=False, **kwargs)
    bounded = solve(profile, hardware, budget, **kwargs)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_late, "LATE_SWAP_REGIONS", 10**9)
        patch.setattr(_late, "LATE_SWAP_TARGETS", 10**9)
        every = solve(profile, hardware, budget, **kwargs)
    assert bounded.predicted_step_time_s <= every.predicted_step_time_s * 1.01
    assert bounded.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
