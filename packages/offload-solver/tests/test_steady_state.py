"""The repeating step: the period a training loop measures (hand-derived cases, agreement
with consecutive steps of the brute-force reference), and the host-step orders it
depends on."""

from __future__ import annotations

import pytest
from hypothesis import strategies as st
from solver_helpers import (
    assignments,
    engine_cases,
    flat_hardware,
    reference_periods,
)

from offload_solver import (
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    Stream,
    get_simulator,
    solve,
)
from offload_solver.simulators._steady import (
    STEADY_REL_TOL,
    Carry,
    carry_from,
    same_carry,
    steady_state,
)
from offload_solver.simulators._step import run
from offload_solver.simulators._timeline import (
    KIND_FWD,
    KIND_HOST_STEP,
    KIND_UPLOAD,
    LANE_COMPUTE,
    LANE_D2H,
    LANE_H2D,
    LANE_HOST,
    EngineRun,
)

A, S, R = ParamPlacement.ASYNC, ParamPlacement.SYNC, ParamPlacement.RESIDENT
HOST, DEVICE = StatePlacement.HOST, StatePlacement.DEVICE


def three_layers() -> ModelProfile:
    """Three 100-parameter (200 B) regions; forward 1 s and backward 2 s each at 1000
    FLOP/s."""
    params = tuple(Parameter(f"w{i}", 100, 200) for i in range(3))
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=10, fwd_flop=1000, bwd_flop=2000)
        for i in range(3)
    )
    return ModelProfile("three", params, ops)


def lane_work_s(run: EngineRun, lane: int) -> float:
    return sum(e - s for ln, s, e in zip(run.lane, run.start, run.end, strict=True) if ln == lane)


def test_host_steps_longer_than_the_forward_overlap_the_next_one() -> None:
    # fp16 (steps wait for the overflow answer); every region resident with host state;
    # Adam 100 / 50 = 2 s per region, twice a region's forward; copies and uploads 0.2 s.
    # Cold step: forward [0,3]; B2 [3,5], B1 [5,7], B0 [7,9]; copies land at 5.2, 7.2 and
    #   9.2. Regions 2 and 1 wait for the answer (9 s); region 0 lands after it and steps
    #   [9.2,11.2], then 1 [11.2,13.2] and 2 [13.2,15.2], each uploaded (0.2 s) after its
    #   step: the single step ends at 15.4.
    # The next step starts at 9 (step() returns when backward ends). Relative to it,
    #   region r's update is done at 2.2, 4.2, 6.2: region 0 uploads [2.2,2.4] and runs
    #   F0 [2.4,3.4]; F1 waits for its upload [4.2,4.4] and runs [4.4,5.4]; F2 [6.4,7.4];
    #   backward 6 s: it ends at 13.4. Host steps again start 2.2 s after it, as in the
    #   cold step: the step leaves the next one what it started from, so it repeats after
    #   one gated step:
    #   the period is 13.4, below the single step (15.4) and above the 6 s of host work.
    hw = flat_hardware(host_adam_params_per_s=50.0)
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    asg = [RegionAssignment(R, HOST)] * 3
    cold = get_simulator("async").run(ctx, asg)
    assert cold.step_time_s == pytest.approx(15.4)
    assert cold.compute_end_s == pytest.approx(9.0)
    steady = steady_state(ctx, asg, cold)
    assert steady.converged
    assert steady.periods_s == pytest.approx((9.0, 13.4))
    assert steady.period_s == pytest.approx(13.4)
    assert lane_work_s(cold, LANE_HOST) == pytest.approx(6.0)
    assert lane_work_s(cold, LANE_HOST) <= steady.period_s < cold.step_time_s
    fwd = {
        r: (s, e)
        for r, k, s, e in zip(
            steady.last.region, steady.last.kind, steady.last.start, steady.last.end, strict=True
        )
        if k == KIND_FWD
    }
    assert fwd == {
        0: pytest.approx((2.4, 3.4)),
        1: pytest.approx((4.4, 5.4)),
        2: pytest.approx((6.4, 7.4)),
    }
    # What simulate() and solve() report: the cold step's timeline, the steady period.
    res = get_simulator("async").simulate(ctx, asg)
    assert res.step_time_s == pytest.approx(15.4)
    assert res.steady_step_time_s == pytest.approx(13.4)
    assert max(iv.end_s for iv in res.timeline) == pytest.approx(15.4)
    plan = solve(three_layers(), hw, 10**6, state_on_device=False, host_step_after_backward=True)
    assert [rp.placement for rp in plan.regions] == [R, R, R]
    assert plan.predicted_step_time_s == pytest.approx(13.4)


def test_without_host_state_the_period_is_the_single_step() -> None:
    # Nothing runs off the compute lane, so nothing carries over into the next step.
    hw = flat_hardware(host_adam_params_per_s=50.0)
    for after_backward in (False, True):
        ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=after_backward)
        asg = [RegionAssignment(R, DEVICE)] * 3
        res = get_simulator("async").simulate(ctx, asg)
        assert res.steady_step_time_s == res.step_time_s
        assert res.step_time_s == pytest.approx(9.0 + 3 * 100 / 1e6)
        cold = get_simulator("async").run(ctx, asg)
        assert steady_state(ctx, asg, cold).periods_s == (cold.compute_end_s,)
    plan = solve(three_layers(), hw, 10**6)
    assert all(rp.state is DEVICE for rp in plan.regions)
    assert plan.predicted_step_time_s == pytest.approx(9.0 + 3 * 100 / 1e6)


def test_a_prefetch_waiting_for_its_update_holds_the_previous_region_back() -> None:
    # Region 1 is prefetched (at region 2's backward) and keeps its state on the host;
    # regions 0 and 2 keep theirs on the device (0.1 s steps at 1000 params/s). fp16.
    # Cold: forward [0,3] (prefetch [0,0.2]); backward [3,9], region 1's copy lands at 7.2
    #   and waits for the answer; its Adam runs [9,11]; device steps [9,9.2]. step() returns
    #   at 9, the compute lane ends at 9.2: the next step starts then.
    # Next step: region 1's update is done at 11 - 9.2 = 1.8. Its prefetch is issued before
    #   region 0's first operation and the call blocks the host until then, so region 0's
    #   forward cannot start before 1.8 either: F0 [1.8,2.8] (prefetch [1.8,2.0]), F1, F2
    #   [2.8,4.8], backward [4.8,10.8], device steps: 11.0. Region 1 lands at 9.0 and steps
    #   at 10.8, ending 1.8 after 11.0 again (the step repeats): the period is 11.0.
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    asg = [RegionAssignment(R, DEVICE), RegionAssignment(A, HOST, 2), RegionAssignment(R, DEVICE)]
    cold = get_simulator("async").run(ctx, asg)
    assert cold.compute_end_s == pytest.approx(9.2)
    steady = steady_state(ctx, asg, cold)
    assert steady.periods_s == pytest.approx((9.2, 11.0))
    last = steady.last
    assert last.cs_f == pytest.approx([1.8, 2.8, 3.8])
    prefetch = last.pf_f_task[1]
    assert (last.start[prefetch], last.end[prefetch]) == pytest.approx((1.8, 2.0))
    # The cold step's peak holds in the repeating one: the same operations, later.
    assert last.peak_bytes == cold.peak_bytes


def test_bf16_hooks_after_the_last_copy_leave_their_regions_to_step() -> None:
    # Without the overflow answer each region steps in its gradient-ready hook, but only
    # while copies are still landing. Adam takes 5 s per region (100 / 20), copies 0.25 s:
    # copies land at 5.25, 7.25 and 9.25 (the last). Region 2's hook runs at 5.25 and
    # steps [5.25,10.25]; the worker reaches region 1's hook at 10.25, after the last copy
    # landed, so it and region 0 are left to step(), which queues them in forward order:
    # 0 then 1 (landing order would have put 1 first). step() returns once the hooks have
    # run (10.25), after backward's end (9): the next step starts then.
    hw = flat_hardware(d2h_bytes_per_s=800.0, host_adam_params_per_s=20.0)
    ctx = SimulationContext.build(three_layers(), hw)
    asg = [RegionAssignment(R, HOST)] * 3
    res = get_simulator("async").simulate(ctx, asg)
    steps = [iv for iv in res.timeline if iv.kind == "host_step"]
    assert [iv.region for iv in steps] == [2, 0, 1]
    assert [(iv.start_s, iv.end_s) for iv in steps] == [
        pytest.approx((5.25, 10.25)),
        pytest.approx((10.25, 15.25)),
        pytest.approx((15.25, 20.25)),
    ]
    assert {iv.stream for iv in steps} == {Stream.HOST}
    assert get_simulator("async").run(ctx, asg).compute_end_s == pytest.approx(10.25)


def device_state_below_the_last_copy() -> tuple[ModelProfile, HardwareProfile]:
    """The example CI's hypothesis run found (engine 9.6123 s against the reference's
    9.4873 s for the cold step): a pinned embedding region 0 (50 parameters, 100 B, also
    used by the head), a 1-parameter region 1, and region 2 (26 parameters, 52 B) holding
    the last layer and the head; every rate 64 per second, host Adam 8 parameters/s,
    device Adam 1024/s; nothing crosses for gradients (0 bytes per parameter)."""
    profile = ModelProfile(
        "layered",
        (Parameter("emb", 50, 100), Parameter("w0", 1, 2), Parameter("w1", 26, 52)),
        (
            Operation("emb", ("emb",), saved_bytes=5),
            Operation("l0_0", ("w0",), bwd_flop=200),
            Operation("l1_0", ("w1",)),
            Operation("head", ("emb",), fwd_flop=100, bwd_flop=200),
        ),
        device_state_bytes_per_param=16,
        host_grad_bytes_per_param=0,
        host_upload_bytes_per_param=0,
    )
    hw = flat_hardware(
        h2d_bytes_per_s=64.0,
        d2h_bytes_per_s=64.0,
        flop_per_s=64.0,
        host_adam_params_per_s=8.0,
        device_adam_params_per_s=1024.0,
    )
    return profile, hw


def test_a_hook_after_the_last_copy_defers_its_region_while_backward_still_runs() -> None:
    # bf16. Region 2 is sync with host state, regions 0 and 1 resident with device state.
    # Upload 52/64 = 0.8125 s; F2 100/64 = 1.5625; B2 = B1 = 200/64 = 3.125, B0 0; Adam of
    # region 2 26/8 = 3.25; device Adam (50 + 1)/1024 = 0.0498046875.
    # Cold: upload [0,0.8125], F2 [0.8125,2.375], upload [2.375,3.1875], B2 [3.1875,6.3125];
    #   region 2's copy (0 s) lands at 6.3125 and is the step's last one: its hook runs
    #   after it, so (the runtime's backward-done event is on the D2H stream, complete
    #   then) it leaves region 2 to step(), though B1 [6.3125,9.4375] still runs. step()
    #   returns at backward's end, 9.4375, having queued region 2's Adam on the idle host
    #   worker [6.3125,9.5625]; device steps end the compute lane at 9.4873046875. (Stepping
    #   region 2 in its hook would make step() wait for it: 9.5625 + 0.0498 = 9.6123.)
    # Next step, from 9.4873046875: region 2's update is done 0.0751953125 in; its upload
    #   waits for it (wait_update): [0.0751953125,0.8876953125]; then 1.5625 + 0.8125 +
    #   3.125 + 3.125 + 0.0498046875: the compute lane ends at 9.5625. The Adam runs from
    #   B2's end, 6.3876953125, to 9.6376953125: 0.0751953125 into the step after, as
    #   before, so this step repeats: the period is 9.5625.
    profile, hw = device_state_below_the_last_copy()
    ctx = SimulationContext.build(profile, hw)
    assert [(r.numel, r.size_bytes, r.pinned) for r in ctx.regions] == [
        (50, 100, True),
        (1, 2, False),
        (26, 52, False),
    ]
    asg = [RegionAssignment(R, DEVICE), RegionAssignment(R, DEVICE), RegionAssignment(S, HOST)]
    cold = get_simulator("async").run(ctx, asg)
    host = [
        (s, e)
        for ln, k, s, e in zip(cold.lane, cold.kind, cold.start, cold.end, strict=True)
        if ln == LANE_HOST and k == KIND_HOST_STEP
    ]
    assert host == [pytest.approx((6.3125, 9.5625))]
    assert cold.ce_b[0] == pytest.approx(9.4375)
    assert cold.compute_end_s == pytest.approx(9.4873046875)
    steady = steady_state(ctx, asg, cold)
    assert steady.converged
    assert steady.periods_s == pytest.approx((9.4873046875, 9.5625))
    last = steady.last
    uploads = [
        (s, e)
        for ln, k, s, e in zip(last.lane, last.kind, last.start, last.end, strict=True)
        if ln == LANE_COMPUTE and k == KIND_UPLOAD
    ]
    assert uploads[0] == pytest.approx((0.0751953125, 0.8876953125))
    assert last.update_end[2] - last.compute_end_s == pytest.approx(0.0751953125)
    # The consecutive steps of the independent reference agree, the cold one included.
    ref = reference_periods(profile, hw, ctx.layout, asg, steps=4)
    assert ref == pytest.approx([9.4873046875, 9.5625, 9.5625, 9.5625])


@engine_cases()
def test_steady_state_matches_consecutive_reference_steps(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile, after_backward: bool
) -> None:
    ctx = SimulationContext.build(profile, hardware, host_step_after_backward=after_backward)
    asg = data.draw(assignments(ctx.layout))
    cold = get_simulator("async").run(ctx, asg)
    steady = steady_state(ctx, asg, cold)
    simulated = len(steady.periods_s)
    # The reference runs past the engine's last step: a fixed point reached too early
    # would show there.
    ref = reference_periods(
        profile,
        hardware,
        ctx.layout,
        asg,
        host_step_after_backward=after_backward,
        steps=simulated + 3,
    )
    assert list(steady.periods_s) == pytest.approx(ref[:simulated], rel=1e-9, abs=1e-12)
    assert steady.converged
    assert ref[simulated:] == pytest.approx([steady.period_s] * 3, rel=STEADY_REL_TOL)
    # Every lane does one step's work per period.
    for lane in (LANE_HOST, LANE_H2D, LANE_D2H):
        assert steady.period_s >= lane_work_s(cold, lane) * (1 - 2 * STEADY_REL_TOL) - 1e-12


def _task_times(out: EngineRun) -> list[tuple[int, int, int, float, float]]:
    return list(zip(out.lane, out.region, out.kind, out.start, out.end, strict=True))


@engine_cases(100, earlier_s=st.sampled_from([0.5, 7.0, float("inf")]))
def test_carries_that_differ_only_before_the_step_starts_run_the_same_step(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: HardwareProfile,
    after_backward: bool,
    earlier_s: float,
) -> None:
    # same_carry ignores lane-free times and gates before the step's start (and the H2D
    # lane's before the first carried upload's issue): moving those earlier must leave
    # every task of the step where it was, or steady_state could stop on a false repeat.
    ctx = SimulationContext.build(profile, hardware, host_step_after_backward=after_backward)
    asg = data.draw(assignments(ctx.layout))
    cold = get_simulator("async").run(ctx, asg)
    carry = carry_from(cold, cold.compute_end_s)
    h2d_floor = min([0.0] + [issue for issue, _ in carry.uploads[:1]])

    def back(x: float, floor: float = 0.0) -> float:
        return x - earlier_s if x <= floor else x

    moved = Carry(
        host_free_s=back(carry.host_free_s),
        d2h_free_s=back(carry.d2h_free_s),
        h2d_free_s=back(carry.h2d_free_s, h2d_floor),
        gate_s=tuple(back(g) for g in carry.gate_s),
        uploads=carry.uploads,
    )
    assert same_carry(carry, moved, 0.0)
    assert _task_times(run(ctx, asg, moved)) == _task_times(run(ctx, asg, carry))
    # And a lane that frees later is told apart (when the step can notice it).
    later = Carry(
        host_free_s=max(carry.host_free_s, 0.0) + 1.0,
        d2h_free_s=carry.d2h_free_s,
        h2d_free_s=carry.h2d_free_s,
        gate_s=carry.gate_s,
        uploads=carry.uploads,
    )
    assert not same_carry(carry, later, 0.5)


# ---- micro-batches (gradient accumulation) ------------------------------------------------


def _lane_tasks(out: EngineRun, lane: int) -> list[tuple[int, int, float, float]]:
    return [
        (out.region[i], out.kind[i], out.start[i], out.end[i])
        for i in range(len(out.lane))
        if out.lane[i] == lane
    ]


def test_a_micro_batch_that_only_accumulates_copies_and_adds_but_does_not_step() -> None:
    # Three resident host-state regions: B2 [3,5], B1 [5,7], B0 [7,9]; gradient copies of
    # 200 B at 1000 B/s end at 5.2, 7.2, 9.2. Host work under copies at half its rate:
    # widening 100 / 500 / 0.5 = 0.4 s and adding into the accumulator as much, so
    # [5.2, 6.0], [7.2, 8.0], [9.2, 10.0]. No Adam step, no upload after it: the compute
    # lane ends with backward at 9.
    hw = flat_hardware(host_convert_elems_per_s=500.0, host_copy_contention=0.5)
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    asg = [RegionAssignment(R, HOST)] * 3
    out = run(ctx, asg, optimizer_step=False)
    host = _lane_tasks(out, LANE_HOST)
    assert [(r, s, e) for r, _, s, e in host] == [
        (2, pytest.approx(5.2), pytest.approx(6.0)),
        (1, pytest.approx(7.2), pytest.approx(8.0)),
        (0, pytest.approx(9.2), pytest.approx(10.0)),
    ]
    assert KIND_HOST_STEP not in {k for _, k, _, _ in host}
    assert _lane_tasks(out, LANE_H2D) == []
    assert out.compute_end_s == pytest.approx(9.0)
    # Without a global answer to wait for (speculating, or bf16), the same: a micro-batch
    # that does not step does not wait for its gradients' host work either.
    free = SimulationContext.build(three_layers(), hw, host_step_after_backward=False)
    assert run(free, asg, optimizer_step=False).compute_end_s == pytest.approx(9.0)
    # A step of three micro-batches: the steady state of the last one plus two of these.
    one = steady_state(ctx, asg, run(ctx, asg))
    ctx3 = SimulationContext.build(
        three_layers(), hw, host_step_after_backward=True, micro_batches=3
    )
    three = steady_state(ctx3, asg, run(ctx3, asg))
    assert three.period_s == pytest.approx(one.period_s + 2 * 9.0)


def test_the_predicted_step_covers_every_micro_batch() -> None:
    # A roomy budget keeps everything on the device: each micro-batch before the last is
    # its forward and backward (3 + 6 s), and only the last steps the optimizer. The peak
    # is one micro-batch's.
    hw = flat_hardware(host_convert_elems_per_s=500.0)
    plans = {
        k: solve(three_layers(), hw, 10**6, micro_batches=k, block_search_range_bytes=0)
        for k in (1, 4)
    }
    assert plans[4].predicted_step_time_s == pytest.approx(plans[1].predicted_step_time_s + 27)
    assert plans[4].predicted_peak_bytes == plans[1].predicted_peak_bytes
    assert [rp.state for rp in plans[4].regions] == [DEVICE] * 3


@pytest.mark.parametrize("bad", [0, -2, True, 1.5])
def test_bad_micro_batches_are_named(bad: object) -> None:
    with pytest.raises(ValueError, match="micro_batches"):
        SimulationContext.build(three_layers(), flat_hardware(), micro_batches=bad)  # type: ignore[arg-type]
