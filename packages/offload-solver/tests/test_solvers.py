"""Solvers: hand-derived greedy choices, budget properties over random profiles, optimizer
placement, and named errors."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_helpers import chain, flat_hardware, hardware_profiles, layered_profiles, profiles

from offload_solver import (
    BUDGET_SAFETY_FACTOR,
    BandwidthPoint,
    HardwareProfile,
    InfeasibleBudgetError,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    get_simulator,
    solve,
)
from offload_solver.simulators._timeline import KIND_HOST_STEP

A, S, R = ParamPlacement.ASYNC, ParamPlacement.SYNC, ParamPlacement.RESIDENT
HOST, DEVICE = StatePlacement.HOST, StatePlacement.DEVICE


def placements(plan: Plan) -> list[tuple[ParamPlacement, int | None]]:
    return [(rp.placement, rp.prefetch_at) for rp in plan.regions]


def resimulate(plan: Plan, profile: ModelProfile, hardware: HardwareProfile) -> int:
    ctx = SimulationContext.build(profile, hardware)
    asg = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    return get_simulator("sync" if plan.solver == "syn" else "async").run(ctx, asg).peak_bytes


def test_syn_greedy_choices_by_hand() -> None:
    # Sizes 300/400/500/400/300 B: no two neighbours fit the largest (500), so the block
    # size is 500 and no regions merge. Upload rates by size (log-interpolated): 300 B at
    # 150 B/s; 400 B at 150 - 90 * ln(4/3)/ln(10/3) = 128.5 B/s; 500 B at 111.8 B/s.
    # Backward takes 10 s per region, longer than any upload, so the step ends with the
    # compute chain and region 0's parameter upload: every compute task is critical (no
    # slack) and a sync upload of region r costs 2 * size / rate(size) seconds.
    # Bytes per second = rate / 2: regions 0 and 4 give 75, 1 and 3 give 64.2, 2 gives 55.9.
    # Ties go to the lower index: the order is 0, 4, 1, 3, 2.
    # Peak = resident + pool (one 500 B block once anything is offloaded) + 5000 of
    # activations: 6900 at start, then 1600+500+5000 = 7100, 6800, 6400, 6000, 5500.
    # With a budget of 6500 the solver plans against 6175, so it stops after region 3.
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    hardware = HardwareProfile(
        name="hand",
        h2d=(BandwidthPoint(100, 50.0), BandwidthPoint(300, 150.0), BandwidthPoint(1000, 60.0)),
        d2h=(BandwidthPoint(1, 1e12),),
        compute_flop_per_s=100.0,
        compute_efficiency=1.0,
        device_memory_bytes=10**6,
        host_memory_bytes=10**6,
        host_adam_params_per_s=1e12,
    )
    assert SimulationContext.build(profile, hardware).block_size_bytes == 500
    plan = solve(profile, hardware, 6500, solver="syn")
    assert placements(plan) == [(S, None), (S, None), (R, None), (S, None), (S, None)]
    assert plan.predicted_peak_bytes == 6000
    assert plan.pool_size_bytes == 500
    # One all-device check, the all-resident start, one simulation per offload, then one
    # step after the cold one for the steady state, which repeats its span (region 2's
    # post-step upload ends long before the next forward reaches it).
    assert plan.num_simulations == 2 + 4 + 1
    # Optimizer state of region 2 on the device would need 250 x 16 more bytes: no room.
    assert all(rp.state is HOST for rp in plan.regions)


def test_asyn_greedy_choices_by_hand() -> None:
    # Sizes 200/300/150/250 B at 100 B/s: uploads take 2, 3, 1.5 and 2.5 s; block 300 B
    # (neighbours never share a block). Forward 1 s and backward 4 s per region; host work
    # is instant, so resident regions' parameter uploads follow their backward on H2D and
    # the step ends with region 0's (every compute task is critical, no slack).
    # Round 1 (all resident; backward starts at 4 s):
    #   region 2, prefetch at 3: issued at region 1's forward (1 s), done at 2.5, half a
    #     second after region 2's forward could start; the backward prefetch is hidden.
    #     0.5 s extra for 150 B: 300 B/s.
    #   region 1, prefetch at 2 or 3: issued at 0, done at 3 (forward starts at 1): 2 s
    #     for 300 B: 150 B/s. Region 0, any prefetch host: 2 s for 200 B: 100 B/s.
    #   region 3 is last, so sync: 2 x 2.5 s for 250 B: 50 B/s.
    #   -> region 2 async with prefetch at 3 (its only choice). Peak 900 + 4000 = 4900 rises
    #   to 5050: 750 resident + a 300 B pool block + 4000 of activations.
    # Round 2: forward prefetch of region 2 [1,2.5]; its forward [2.5,3.5]; backward from
    #   4.5, prefetch of region 2 [4.5,6], region 2's backward [8.5,12.5]. Region 2 holds
    #   the only block during [1,3.5) and [4.5,12.5).
    #   region 1 still gives 150 B/s (prefetch hidden in backward, 2 s in forward) but its
    #     forward lifetime [0,2) meets region 2's: it would need a second block.
    #   region 0 with prefetch at 1 (100 B/s) is up during [0,1) and [12.5,20.5): it fits
    #     region 2's block, which hosts 2 and 3 do not (their backward lifetimes would start
    #     at 8.5 or 4.5, inside region 2's).
    #   -> region 0 async, prefetch at 1. Peak 550 + 300 + 4000 = 4850.
    # A budget of 5130 means planning against 4873.5: rounds 0 and 1 do not fit, 2 does.
    profile = chain([200, 300, 150, 250], fwd_flop=100, bwd_flop=400)
    hardware = flat_hardware(
        h2d_bytes_per_s=100.0,
        d2h_bytes_per_s=1e12,
        flop_per_s=100.0,
        host_adam_params_per_s=1e12,
    )
    assert SimulationContext.build(profile, hardware).block_size_bytes == 300
    plan = solve(profile, hardware, 5130, solver="asyn")
    assert placements(plan) == [(A, 1), (R, None), (A, 3), (R, None)]
    assert plan.predicted_peak_bytes == 4850
    assert plan.pool_size_bytes == 300
    assert [rp.pool_offset_bytes for rp in plan.regions] == [0, None, 0, None]
    # The all-device check, the start, two offloads, and one steady-state step (as above).
    assert plan.num_simulations == 2 + 2 + 1


def test_roomy_budget_keeps_everything_on_the_device() -> None:
    profile = chain([300, 400, 500], fwd_flop=100, bwd_flop=200)
    plan = solve(profile, flat_hardware(), 10**9)
    assert all(rp.placement is R and rp.state is DEVICE for rp in plan.regions)
    assert plan.num_simulations == 1
    assert plan.pool_size_bytes == 0


def test_optimizer_state_moves_to_the_device_where_it_saves_time() -> None:
    # Host Adam is slow (10 params/s): the host steps are the step's tail. All on the device
    # needs 1200 + 600 x 16 + 3000 bytes; all on the host 4200. With 9000 the solver keeps
    # some regions' optimizer state on the device and the step gets shorter.
    profile = chain([300, 400, 500], fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware(host_adam_params_per_s=10.0)
    budget = 9000
    plan = solve(profile, hardware, budget)
    assert all(rp.placement is R for rp in plan.regions)
    on_device = [rp.region.index for rp in plan.regions if rp.state is DEVICE]
    assert on_device
    assert plan.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    ctx = SimulationContext.build(profile, hardware)
    all_host = get_simulator("async").run(ctx, [RegionAssignment()] * 3)
    assert plan.predicted_step_time_s < all_host.step_time_s


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_parameters_are_offloaded_to_make_room_for_optimizer_state(solver: str) -> None:
    # Three 300 B regions (150 params each), 1000 B saved per operation. Host Adam at
    # 10 params/s takes 15 s per region and runs back to back: it is the step's tail. An
    # upload takes 0.3 s, hidden behind 5 s forwards and 10 s backwards.
    # All resident: 900 + 3000 = 3900. Planning against 6100 leaves no room for one
    # region's state (150 x 16 = 2400 B). Offloading regions 1 and 2 brings the peak to
    # 300 + one 300 B pool block + 3000 = 3600, and region 0's state then fits:
    # 3600 + 2400 = 6000 <= 6100. That saves region 0's 15 s host step for at most two
    # 0.3 s sync uploads, so the solver makes that trade.
    profile = chain([300, 300, 300], fwd_flop=500, bwd_flop=1000)
    hardware = flat_hardware(flop_per_s=100.0, host_adam_params_per_s=10.0)
    budget = int(6100 / BUDGET_SAFETY_FACTOR) + 1
    plan = solve(profile, hardware, budget, solver=solver)
    assert [rp.state for rp in plan.regions] == [DEVICE, HOST, HOST]
    assert plan.regions[0].placement is R
    assert all(rp.placement is not R for rp in plan.regions[1:])
    assert plan.predicted_peak_bytes == 6000
    ctx = SimulationContext.build(profile, hardware)
    all_host = get_simulator("async").run(ctx, [RegionAssignment()] * 3)
    assert plan.predicted_step_time_s < all_host.step_time_s - 14.0


def test_block_search_range_keeps_small_models_apart() -> None:
    # Layers of 1000 and 24 B (4072 in all = 1000 + 3 x 1024): the reference's search in
    # 1 KiB steps finds a single 4072 B block with no waste and merges everything into one
    # region, and offloading that one saves nothing (the pool holds a block as large). With
    # a range of 0 the block is the largest layer (1000 B) and the layers stay apart.
    # Activations: 7 x 1000 saved. All resident: 4072 + 7000 = 11072; budget 10000 plans
    # against 9500.
    profile = chain([1000, 24, 1000, 24, 1000, 24, 1000], fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware()
    assert SimulationContext.build(profile, hardware).num_regions == 1
    with pytest.raises(InfeasibleBudgetError):
        solve(profile, hardware, 10000)
    plan = solve(profile, hardware, 10000, block_search_range_bytes=0)
    assert len(plan.regions) == 7
    assert any(rp.placement is not R for rp in plan.regions)
    assert plan.predicted_peak_bytes <= 9500


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    profile=st.one_of(profiles(), layered_profiles()),
    hardware=hardware_profiles(),
    solver=st.sampled_from(["syn", "asyn"]),
    where=st.floats(-0.3, 1.2),
)
def test_plans_fit_the_budget_or_name_a_budget_that_does(
    profile: ModelProfile, hardware: HardwareProfile, solver: str, where: float
) -> None:
    # Budgets around the interesting range: from below the floor plan (every offloadable
    # region sync) to above everything resident.
    ctx = SimulationContext.build(profile, hardware)
    sim = get_simulator("async")
    top = sim.run(ctx, [RegionAssignment()] * ctx.num_regions).peak_bytes
    floor_asg = [
        RegionAssignment(S if not reg.pinned and reg.size_bytes else R) for reg in ctx.regions
    ]
    floor = min(top, sim.run(ctx, floor_asg).peak_bytes)
    budget = max(1, int((floor + where * (top - floor)) / BUDGET_SAFETY_FACTOR))
    try:
        plan = solve(profile, hardware, budget, solver=solver)
    except InfeasibleBudgetError as exc:
        assert exc.least_budget_bytes > budget
        assert str(exc.least_budget_bytes) in str(exc)
        plan = solve(profile, hardware, exc.least_budget_bytes, solver=solver)
        budget = exc.least_budget_bytes
    assert plan.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    assert resimulate(plan, profile, hardware) == plan.predicted_peak_bytes
    for rp in plan.regions:
        if rp.placement is not R:
            assert not rp.region.pinned and rp.state is HOST
            assert rp.pool_offset_bytes is not None
            assert rp.pool_offset_bytes + rp.region.size_bytes <= plan.pool_size_bytes
        if solver == "syn":
            assert rp.placement is not A


def test_infeasible_budget_names_the_least_budget() -> None:
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    hardware = flat_hardware()
    with pytest.raises(InfeasibleBudgetError, match=r"least budget that works is \d+ bytes") as e:
        solve(profile, hardware, 1000, solver="asyn")
    # Floor: nothing resident, one 500 B block, 5000 of activations.
    assert e.value.floor_peak_bytes == 5500
    assert e.value.least_budget_bytes * BUDGET_SAFETY_FACTOR >= 5500
    assert (e.value.least_budget_bytes - 1) * BUDGET_SAFETY_FACTOR < 5500
    assert isinstance(e.value, ValueError)
    plan = solve(profile, hardware, e.value.least_budget_bytes, solver="asyn")
    assert plan.predicted_peak_bytes <= 5500


def test_bytes_in_use_come_off_the_budget_and_count_in_the_peak() -> None:
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    hardware = flat_hardware()
    roomy = solve(profile, hardware, 10**9)
    shifted = solve(profile, hardware, 10**9, device_bytes_in_use=12345)
    assert placements(shifted) == placements(roomy)
    assert shifted.predicted_peak_bytes == roomy.predicted_peak_bytes + 12345
    assert [m.bytes for m in shifted.memory_curve] == [m.bytes + 12345 for m in roomy.memory_curve]
    # The plan says what it assumed, and keeps it through JSON (older JSON: none).
    assert (roomy.device_bytes_in_use, shifted.device_bytes_in_use) == (0, 12345)
    assert Plan.from_json(shifted.to_json()) == shifted
    older = json.loads(shifted.to_json())
    del older["device_bytes_in_use"]
    assert Plan.from_json(json.dumps(older)).device_bytes_in_use == 0
    # A budget whose planning share just holds everything on the device holds it no more
    # once the bytes in use are taken: the plan moves something off and still fits.
    budget = math.ceil(roomy.predicted_peak_bytes / BUDGET_SAFETY_FACTOR)
    tight = solve(profile, hardware, budget, device_bytes_in_use=2000)
    assert placements(tight) != placements(roomy) or any(rp.state is HOST for rp in tight.regions)
    assert tight.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    # The least budget named counts them, and solving with it succeeds.
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(profile, hardware, 1000, device_bytes_in_use=700)
    assert e.value.floor_peak_bytes == 5500 + 700
    plan = solve(profile, hardware, e.value.least_budget_bytes, device_bytes_in_use=700)
    assert plan.predicted_peak_bytes <= 6200


def test_speculative_params_reach_the_simulation() -> None:
    # Host state throughout: the fewer parameters may step under backward, the more host
    # work waits for the last hook, and the longer the step (no limit = a limit above all).
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    hardware = flat_hardware()
    steps = [
        solve(
            profile, hardware, 10**9, state_on_device=False, speculative_params=limit
        ).predicted_step_time_s
        for limit in (None, 10**9, 500, 0)
    ]
    assert steps[0] == steps[1] < steps[2] < steps[3]
    with pytest.raises(ValueError, match="speculative_params"):
        solve(profile, hardware, 10**9, speculative_params=-1)


@pytest.mark.parametrize("in_use", [-1, True, 1.5])
def test_bad_bytes_in_use_are_named(in_use: object) -> None:
    with pytest.raises(ValueError, match="device_bytes_in_use"):
        solve(chain([10], 1, 1), flat_hardware(), 10**6, device_bytes_in_use=in_use)  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [0, -5, 0.0, True, float("nan")])
def test_bad_budget_is_named(budget: object) -> None:
    with pytest.raises(ValueError, match=r"budget_bytes is .*positive number of bytes"):
        solve(chain([10], 1, 1), flat_hardware(), budget)  # type: ignore[arg-type]


def test_unknown_solver_is_named() -> None:
    with pytest.raises(
        ValueError, match=r"Solver 'greedy' is not registered; known: 'asyn', 'syn'"
    ):
        solve(chain([10], 1, 1), flat_hardware(), 10**6, solver="greedy")


def test_plan_round_trips_through_json() -> None:
    profile = chain([200, 300, 150, 250], fwd_flop=100, bwd_flop=400)
    hardware = flat_hardware(h2d_bytes_per_s=100.0, flop_per_s=100.0)
    plan = solve(profile, hardware, 5200)
    assert Plan.from_json(plan.to_json()) == plan


def test_host_steps_wait_for_backward_when_the_step_needs_a_global_answer() -> None:
    # Three 1000-byte regions, all resident with host state: backward takes 10 s per region,
    # gradient copies 1 s (1000 B at 1000 B/s), host steps 0.5 s (500 params at 1000/s).
    # Overlapped, region 2's step starts at 31 s (forward 3 x 1 s, its backward ends at 13 s,
    # copy ends at 14 s ...); after backward, every step starts at or after backward's end.
    profile = chain([1000, 1000, 1000], fwd_flop=1000, bwd_flop=10_000)
    hw = flat_hardware()
    asg = [RegionAssignment(R, HOST)] * 3
    sim = get_simulator("async")
    early = sim.run(SimulationContext.build(profile, hw), asg)
    late_ctx = SimulationContext.build(profile, hw, host_step_after_backward=True)
    late = sim.run(late_ctx, asg)
    bwd_end = 3 * 1.0 + 3 * 10.0
    early_steps = [s for s, k in zip(early.start, early.kind, strict=True) if k == KIND_HOST_STEP]
    late_steps = [s for s, k in zip(late.start, late.kind, strict=True) if k == KIND_HOST_STEP]
    assert min(early_steps) < bwd_end
    assert min(late_steps) >= bwd_end
    # Forward order after backward: region 0's step first.
    late_order = [r for r, k in zip(late.region, late.kind, strict=True) if k == KIND_HOST_STEP]
    assert late_order == [0, 1, 2]
    assert late.step_time_s > early.step_time_s


def test_state_on_device_false_keeps_every_region_state_on_the_host() -> None:
    profile = chain([1000, 1000, 1000], fwd_flop=1000, bwd_flop=10_000)
    roomy = 10**9
    assert all(rp.state is DEVICE for rp in solve(profile, flat_hardware(), roomy).regions)
    plan = solve(profile, flat_hardware(), roomy, state_on_device=False)
    assert all(rp.state is HOST for rp in plan.regions)
    assert all(rp.placement is R for rp in plan.regions)


def test_operations_take_at_least_the_issue_overhead() -> None:
    # Three regions of 1000 FLOP forward / 10000 backward at 1000 FLOP/s: 1 s and 10 s per op.
    # With a 20 s issue cost per op, every op takes 20 s: 3 x 20 forward + 3 x 20 backward.
    import dataclasses

    profile = chain([1000, 1000, 1000], fwd_flop=1000, bwd_flop=10_000)
    slow = dataclasses.replace(flat_hardware(), op_overhead_s=20.0)
    asg = [RegionAssignment(R, DEVICE)] * 3
    sim = get_simulator("sync")
    fast_run = sim.run(SimulationContext.build(profile, flat_hardware()), asg)
    slow_run = sim.run(SimulationContext.build(profile, slow), asg)
    assert fast_run.step_time_s < 40
    assert slow_run.step_time_s >= 120
    assert HardwareProfile.from_json(slow.to_json()).op_overhead_s == 20.0


def test_memory_bound_operations_take_their_traffic_time() -> None:
    # Two regions: a FLOP-free op moving 1000 bytes out (2000 bytes of forward traffic,
    # 3 x 500 backward) and a matmul-like op of 4000 FLOP. At 1000 FLOP/s and 1000 B/s of
    # device memory: forward 2 + 4 s, backward 1.5 + 4 s. Without the memory rate the
    # first op is free.
    import dataclasses

    params = (Parameter("w0", 1, 2), Parameter("w1", 1, 2))
    ops = (
        Operation("ew", ("w0",), fwd_out_bytes=1000, bwd_out_bytes=500),
        Operation("mm", ("w1",), fwd_out_bytes=10, bwd_out_bytes=10, fwd_flop=4000, bwd_flop=4000),
    )
    profile = ModelProfile("mixed", params, ops, host_grad_bytes_per_param=0)
    asg = [RegionAssignment(R, DEVICE)] * 2
    sim = get_simulator("sync")
    hw = flat_hardware()
    unknown = sim.run(SimulationContext.build(profile, hw), asg)
    known_hw = dataclasses.replace(hw, device_memory_bytes_per_s=1000.0)
    known = sim.run(SimulationContext.build(profile, known_hw), asg)
    assert unknown.step_time_s == pytest.approx(8.0, rel=1e-3)
    assert known.step_time_s == pytest.approx(11.5, rel=1e-3)
    assert known_hw.op_time_s(4000, 20) == pytest.approx(4.0)  # compute dominates
    assert known_hw.op_time_s(0, 0) == 0.0
