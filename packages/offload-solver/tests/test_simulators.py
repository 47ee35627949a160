"""Simulators: a hand-checked step, agreement with a brute-force reference, curve
properties, sync/async agreement with nothing offloaded, the pool, and bad assignments."""

from __future__ import annotations

import dataclasses
import itertools
from functools import partial

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from solver_helpers import (
    assignments,
    engine_cases,
    flat_hardware,
    hardware_profiles,
    layered_profiles,
    profiles,
    reference_simulate,
)

from offload_solver import (
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    RegionAssignment,
    SimulationContext,
    SimulationResult,
    StatePlacement,
    Stream,
    get_simulator,
    simulate,
)

A, S, R = ParamPlacement.ASYNC, ParamPlacement.SYNC, ParamPlacement.RESIDENT
HOST, DEVICE = StatePlacement.HOST, StatePlacement.DEVICE


def three_layers() -> ModelProfile:
    params = tuple(Parameter(f"w{i}", 100, 200) for i in range(3))
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=10, fwd_flop=1000, bwd_flop=2000)
        for i in range(3)
    )
    return ModelProfile("three", params, ops)


def test_hand_checked_step() -> None:
    # Upload and gradient copy 200 B at 1000 B/s = 0.2 s; forward 1 s, backward 2 s per
    # region; host Adam 100 params at 1000/s = 0.1 s.
    # Forward: pf(1) [0,0.2] issued as region 0 starts; F0 [0,1]; F1 [1,2]; region 2 sync:
    #   upload [2,2.2], F2 [2.2,3.2].
    # Backward: at 3.2 region 2 issues pf_b(1) [3.2,3.4] and uploads itself [3.2,3.4];
    #   B2 [3.4,5.4], grad copy [5.4,5.6], host [5.6,5.7]; B1 [5.4,7.4] (prefetch done),
    #   copy [7.4,7.6], host [7.6,7.7]; B0 [7.4,9.4], copy [9.4,9.6], host [9.6,9.7],
    #   then resident region 0's updated parameters go up [9.7,9.9]: the step is 9.9 s.
    # Lifetimes: region 1 [0,2) and [3.2,7.4), region 2 [2,3.2) and [3.2,5.4): they coexist,
    #   so the pool has two 200 B blocks.
    # Memory: static 200 (region 0) + pool 400; the highest level after the forward is the
    #   gap after B2: saved of ops 0-1 (20) + region 2's gradient (200) until 5.6, which
    #   op 1's backward at 5.4 also sees (20 + 200): peak 600 + 220 = 820.
    #   Raw: at B2's start (3.4) regions 1 and 2 are both up: 200 + 400 + 30 = 630.
    ctx = SimulationContext.build(three_layers(), flat_hardware(host_adam_params_per_s=1000.0))
    assert ctx.block_size_bytes == 200 and ctx.num_regions == 3
    asg = [RegionAssignment(R, HOST), RegionAssignment(A, HOST, 2), RegionAssignment(S, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    assert res.step_time_s == pytest.approx(9.9)
    assert res.peak_bytes == 820
    assert res.raw_peak_bytes == 630
    assert res.coexisting == ((1, 2),)
    assert res.pool_blocks == (None, 0, 1)
    assert res.pool_size_bytes == 400
    spans = {(iv.stream, iv.region, iv.kind): (iv.start_s, iv.end_s) for iv in res.timeline}
    assert spans[Stream.H2D, 1, "prefetch"] == pytest.approx((3.2, 3.4))
    assert spans[Stream.COMPUTE, 2, "upload"] == pytest.approx((3.2, 3.4))
    assert spans[Stream.COMPUTE, 1, "bwd"] == pytest.approx((5.4, 7.4))
    assert spans[Stream.D2H, 2, "grad_offload"] == pytest.approx((5.4, 5.6))
    assert spans[Stream.HOST, 0, "host_step"] == pytest.approx((9.6, 9.7))
    assert spans[Stream.H2D, 0, "param_upload"] == pytest.approx((9.7, 9.9))
    assert max(m.bytes for m in res.memory_curve) == 820


@pytest.mark.parametrize("after_backward", [False, True])
def test_device_state_and_device_step(after_backward: bool) -> None:
    # All resident, region 1 keeps its optimizer state on the device: 100 params x 16 B
    # resident, and its step (100 / 1e6 s) runs on compute when step() queues it. Backward
    # ends at 9 s (3 x 1 s forward, 3 x 2 s backward); region 0's gradient copy lands at
    # 9.2. With the overflow answer (after_backward) step() returns at the end of backward;
    # otherwise it first waits for every gradient-ready hook, the last of which runs when
    # region 0's copy lands.
    profile = three_layers()
    ctx = SimulationContext.build(profile, flat_hardware(), host_step_after_backward=after_backward)
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, DEVICE), RegionAssignment(R, HOST)]
    res = get_simulator("sync").simulate(ctx, asg)
    assert res.static_bytes == 600 + 100 * profile.device_state_bytes_per_param
    steps = [iv for iv in res.timeline if iv.kind == "device_step"]
    assert len(steps) == 1 and steps[0].region == 1 and steps[0].stream is Stream.COMPUTE
    assert max(iv.end_s for iv in res.timeline if iv.kind == "bwd") == pytest.approx(9.0)
    assert steps[0].start_s == pytest.approx(9.0 if after_backward else 9.2)
    assert not [iv for iv in res.timeline if iv.region == 1 and iv.kind == "grad_offload"]


@engine_cases()
def test_engine_agrees_with_the_reference(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile, after_backward: bool
) -> None:
    ctx = SimulationContext.build(profile, hardware, host_step_after_backward=after_backward)
    asg = data.draw(assignments(ctx.layout))
    res = get_simulator("async").simulate(ctx, asg)
    ref = reference_simulate(
        profile, hardware, ctx.layout, asg, host_step_after_backward=after_backward
    )
    assert res.step_time_s == pytest.approx(ref.step_time_s, rel=1e-9, abs=1e-12)
    assert res.peak_bytes == ref.peak_bytes
    assert set(res.coexisting) == ref.coexisting
    assert res.pool_size_bytes == ref.num_blocks * ctx.block_size_bytes
    # The raw curve also samples prefetch starts inside operations, which the reference
    # does not, and never exceeds the pooled peak.
    assert ref.raw_peak_bytes <= res.raw_peak_bytes <= res.peak_bytes


def _host_spans(res: SimulationResult) -> list[tuple[int, str, float, float]]:
    """(region, kind, start, end) of every host-lane task, in lane order."""
    return [
        (iv.region, iv.kind, iv.start_s, iv.end_s)
        for iv in res.timeline
        if iv.stream is Stream.HOST
    ]


def _approx_spans(
    spans: list[tuple[int, str, float, float]],
) -> list[tuple[int, str, object, object]]:
    return [(r, k, pytest.approx(s), pytest.approx(e)) for r, k, s, e in spans]


def test_host_conversions_run_as_gradients_land_then_adam_then_publish() -> None:
    # Three resident host-state regions of 100 parameters (200 B): forward 1 s and backward
    # 2 s per region, gradient copy 200 B at 1000 B/s = 0.2 s, Adam 100 / 1000 = 0.1 s,
    # a conversion 100 / 500 = 0.2 s. B2 [3,5], B1 [5,7], B0 [7,9]; copies end at 5.2,
    # 7.2, 9.2. Each region then widens, steps and publishes on the host, and its updated
    # parameters go up (0.2 s) after the publish: region 0's last upload is [9.7, 9.9].
    # No partial: the step does not wait for a global answer.
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=500.0)
    ctx = SimulationContext.build(three_layers(), hw)
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    assert _host_spans(res) == _approx_spans(
        [
            (2, "grad_widen", 5.2, 5.4),
            (2, "host_step", 5.4, 5.5),
            (2, "publish", 5.5, 5.7),
            (1, "grad_widen", 7.2, 7.4),
            (1, "host_step", 7.4, 7.5),
            (1, "publish", 7.5, 7.7),
            (0, "grad_widen", 9.2, 9.4),
            (0, "host_step", 9.4, 9.5),
            (0, "publish", 9.5, 9.7),
        ]
    )
    uploads = [iv for iv in res.timeline if iv.kind == "param_upload"]
    assert [iv.region for iv in uploads] == [2, 1, 0]
    assert [(iv.start_s, iv.end_s) for iv in uploads] == [
        pytest.approx((5.7, 5.9)),
        pytest.approx((7.7, 7.9)),
        pytest.approx((9.7, 9.9)),
    ]
    assert res.step_time_s == pytest.approx(9.9)
    # Without a conversion rate only Adam is charged: region 0 steps [9.2, 9.3], uploads
    # [9.3, 9.5].
    plain = get_simulator("async").simulate(
        SimulationContext.build(three_layers(), flat_hardware(host_adam_params_per_s=1000.0)),
        [RegionAssignment(R, HOST)] * 3,
    )
    assert {k for _, k, _, _ in _host_spans(plain)} == {"host_step"}
    assert plain.step_time_s == pytest.approx(9.5)


def test_gradient_work_spills_past_backward_when_the_step_waits_for_it() -> None:
    # As above, conversions at 100 elements/s (1 s each) and the step waiting for the
    # overflow answer (computed on the device, so the host computes no partial). Each
    # region widens as its copy lands (5.2, 7.2, 9.2): regions 2 and 1 are ready by the end
    # of backward (9 s) and wait; region 0 is ready at 10.2, after it, and steps then.
    # Regions 1 and 2 follow in forward order: 11.3 + 2 x (0.1 + 1) = 13.5, and region 2's
    # parameters go up [13.5, 13.7].
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=100.0)
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    assert _host_spans(res) == _approx_spans(
        [
            (2, "grad_widen", 5.2, 6.2),
            (1, "grad_widen", 7.2, 8.2),
            (0, "grad_widen", 9.2, 10.2),
            (0, "host_step", 10.2, 10.3),
            (0, "publish", 10.3, 11.3),
            (1, "host_step", 11.3, 11.4),
            (1, "publish", 11.4, 12.4),
            (2, "host_step", 12.4, 12.5),
            (2, "publish", 12.5, 13.5),
        ]
    )
    assert res.step_time_s == pytest.approx(13.7)
    # Device memory does not depend on host work: the same peak as without conversions.
    plain = get_simulator("async").simulate(
        SimulationContext.build(
            three_layers(),
            flat_hardware(host_adam_params_per_s=1000.0),
            host_step_after_backward=True,
        ),
        [RegionAssignment(R, HOST)] * 3,
    )
    assert res.peak_bytes == plain.peak_bytes


def test_fp16_regions_landing_after_backward_step_first_in_landing_order() -> None:
    # Backward 1 s per region (2000 FLOP at 2000 FLOP/s), forward 0.5 s; gradient copies
    # of 200 B at 100 B/s take 2 s, longer than a region's backward, so they queue on D2H:
    # B2 [1.5,2.5] copy [2.5,4.5]; B1 [2.5,3.5] copy [4.5,6.5]; B0 [3.5,4.5] copy [6.5,8.5].
    # The overflow answer is known at the end of backward, 4.5 s. Region 2 landed then
    # (landing at that instant counts as landing before it) and waits; regions 1 and 0
    # land after it and step as they land, in landing order (1 before 0, not forward
    # order); then region 2. Adam 0.1 s.
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=10, fwd_flop=1000, bwd_flop=2000)
        for i in range(3)
    )
    profile = ModelProfile("three", three_layers().parameters, ops)
    hw = flat_hardware(d2h_bytes_per_s=100.0, flop_per_s=2000.0, host_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(profile, hw, host_step_after_backward=True)
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    assert max(iv.end_s for iv in res.timeline if iv.kind == "bwd") == pytest.approx(4.5)
    assert _host_spans(res) == _approx_spans(
        [
            (1, "host_step", 6.5, 6.6),
            (0, "host_step", 8.5, 8.6),
            (2, "host_step", 8.6, 8.7),
        ]
    )
    # Post-step uploads (0.2 s) in the order the steps issued them.
    uploads = [iv for iv in res.timeline if iv.kind == "param_upload"]
    assert [iv.region for iv in uploads] == [1, 0, 2]
    assert [(iv.start_s, iv.end_s) for iv in uploads] == [
        pytest.approx((6.6, 6.8)),
        pytest.approx((8.6, 8.8)),
        pytest.approx((8.8, 9.0)),
    ]
    assert res.step_time_s == pytest.approx(9.0)


@pytest.mark.parametrize("after_backward", [False, True])
def test_fp32_gradients_from_the_device_are_not_widened_on_the_host(after_backward: bool) -> None:
    # host_grad_bytes_per_param == 4: the runtime widened on the device and copies 400 B
    # (0.4 s): copies land at 5.4, 7.4 and 9.4. As each step goes, region 2's Adam starts
    # at 5.4; waiting for the overflow answer (known on the device when backward ends at
    # 9 s, so no partial runs on the host), region 0, landing after that, steps first.
    base = three_layers()
    profile = ModelProfile(base.name, base.parameters, base.operations, host_grad_bytes_per_param=4)
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=100.0)
    ctx = SimulationContext.build(profile, hw, host_step_after_backward=after_backward)
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    spans = _host_spans(res)
    assert "grad_widen" not in {k for _, k, _, _ in spans}
    first = (0, "host_step", 9.4, 9.5) if after_backward else (2, "host_step", 5.4, 5.5)
    assert spans[0] == _approx_spans([first])[0]
    kinds = [k for _, k, _, _ in spans]
    assert kinds == ["host_step", "publish"] * 3


def test_host_work_is_never_charged_to_device_state_regions() -> None:
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=100.0)
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    asg = [RegionAssignment(R, DEVICE), RegionAssignment(R, HOST), RegionAssignment(R, DEVICE)]
    res = get_simulator("async").simulate(ctx, asg)
    assert {r for r, _, _, _ in _host_spans(res)} == {1}
    # Widening, Adam, publish; no overflow partial on the host.
    assert ctx.host_work_s[1] == pytest.approx(1.0 + 0.1 + 1.0)
    assert "grad_partial" not in {k for _, k, _, _ in _host_spans(res)}


def _with_upload_bytes(profile: ModelProfile, per_elem: int) -> ModelProfile:
    return dataclasses.replace(profile, host_upload_bytes_per_param=per_elem)


def test_fp32_uploads_take_twice_as_long_and_leave_nothing_to_publish() -> None:
    # The hand-checked step's regions (resident, async prefetched at 2, sync; all host
    # state) with conversions at 500 elements/s (0.2 s) and Adam 0.1 s. fp16 uploads move
    # 200 B (0.2 s); fp32 masters move 100 x 4 = 400 B (0.4 s), and no publish runs.
    # fp32: pf(1) [0,0.4]; F0 [0,1]; F1 [1,2]; upload(2) [2,2.4], F2 [2.4,3.4]; at 3.4
    #   pf_b(1) and upload(2) [3.4,3.8]; B2 [3.8,5.8]; B1 [5.8,7.8]; B0 [7.8,9.8]; copy
    #   [9.8,10]; widen [10,10.2]; Adam [10.2,10.3]; region 0 goes up [10.3,10.7].
    # fp16: 0.4 s less upload on the compute chain (B0 ends 9.4), then copy, widen, Adam,
    #   publish [9.9,10.1] and region 0's upload [10.1,10.3].
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=500.0)
    asg = [RegionAssignment(R, HOST), RegionAssignment(A, HOST, 2), RegionAssignment(S, HOST)]
    sim = get_simulator("async")
    fp16 = sim.simulate(SimulationContext.build(three_layers(), hw), asg)
    fp32 = sim.simulate(SimulationContext.build(_with_upload_bytes(three_layers(), 4), hw), asg)
    assert fp16.step_time_s == pytest.approx(10.3)
    assert fp32.step_time_s == pytest.approx(10.7)

    def uploads(res: SimulationResult) -> list[tuple[Stream, int, str, float]]:
        return [
            (iv.stream, iv.region, iv.kind, iv.end_s - iv.start_s)
            for iv in res.timeline
            if iv.kind in ("upload", "prefetch", "param_upload")
        ]

    # Every upload kind: sync uploads (forward and backward), both prefetches and the
    # resident region's post-step upload.
    assert sorted((k, r) for _, r, k, _ in uploads(fp16)) == [
        ("param_upload", 0),
        ("prefetch", 1),
        ("prefetch", 1),
        ("upload", 2),
        ("upload", 2),
    ]
    assert [(ln, r, k) for ln, r, k, _ in uploads(fp32)] == [
        (ln, r, k) for ln, r, k, _ in uploads(fp16)
    ]
    assert [d for *_, d in uploads(fp16)] == pytest.approx([0.2] * 5)
    assert [d for *_, d in uploads(fp32)] == pytest.approx([0.4] * 5)

    kinds16 = [k for _, k, _, _ in _host_spans(fp16)]
    kinds32 = [k for _, k, _, _ in _host_spans(fp32)]
    assert kinds16.count("publish") == 3
    assert "publish" not in kinds32
    assert kinds32 == [k for k in kinds16 if k != "publish"]
    # The Adam step itself is unchanged, and the post-step upload follows it directly.
    steps = {r: (s, e) for r, k, s, e in _host_spans(fp32) if k == "host_step"}
    assert {r: e - s for r, (s, e) in steps.items()} == pytest.approx({0: 0.1, 1: 0.1, 2: 0.1})
    spans = {(iv.region, iv.kind): (iv.start_s, iv.end_s) for iv in fp32.timeline}
    assert spans[0, "param_upload"] == pytest.approx((steps[0][1], steps[0][1] + 0.4))
    assert SimulationContext.build(_with_upload_bytes(three_layers(), 4), hw).host_work_s == (
        pytest.approx([0.2 + 0.1] * 3)
    )


def test_fp32_uploads_leave_device_state_regions_alone() -> None:
    # Device-state regions are resident and never uploaded: the step is the same.
    hw = flat_hardware(host_adam_params_per_s=1000.0, host_convert_elems_per_s=500.0)
    asg = [RegionAssignment(R, DEVICE)] * 3
    sim = get_simulator("async")
    a = sim.simulate(SimulationContext.build(three_layers(), hw), asg)
    b = sim.simulate(SimulationContext.build(_with_upload_bytes(three_layers(), 4), hw), asg)
    assert a == b
    assert not [iv for iv in b.timeline if iv.stream is Stream.H2D]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), profile=layered_profiles(), hardware=hardware_profiles())
def test_uploading_two_bytes_per_fp16_element_changes_nothing(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile
) -> None:
    # Layered profiles hold 2-byte parameters, so an explicit 2 bytes per element is the
    # default (the parameters' own size), and below 4 the host still publishes.
    ctx0 = SimulationContext.build(_with_upload_bytes(profile, 0), hardware)
    ctx2 = SimulationContext.build(_with_upload_bytes(profile, 2), hardware)
    asg = data.draw(assignments(ctx0.layout))
    sim = get_simulator("async")
    assert sim.simulate(ctx0, asg) == sim.simulate(ctx2, asg)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    data=st.data(), profile=st.one_of(profiles(), layered_profiles()), hardware=hardware_profiles()
)
def test_memory_curves_are_consistent(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile
) -> None:
    ctx = SimulationContext.build(profile, hardware)
    asg = data.draw(assignments(ctx.layout))
    res = get_simulator("async").simulate(ctx, asg)
    for curve in (res.memory_curve, res.raw_memory_curve):
        times = [m.time_s for m in curve]
        assert times == sorted(times)
        assert min(m.bytes for m in curve) >= 0
        # The step starts and ends with only static bytes (nothing waiting, no activations).
        assert curve[-1].bytes == curve[0].bytes
    assert res.memory_curve[0].bytes == res.static_bytes
    assert min(m.bytes for m in res.memory_curve) >= res.static_bytes
    assert max(m.bytes for m in res.memory_curve) == res.peak_bytes
    assert max(m.bytes for m in res.raw_memory_curve) == res.raw_peak_bytes
    # Pool: never fails, coexisting regions never share a block, at least the lower bound.
    blocks = res.pool_blocks
    for a, b in res.coexisting:
        assert blocks[a] is not None and blocks[a] != blocks[b]
    n_blocks = res.pool_size_bytes // ctx.block_size_bytes if ctx.block_size_bytes else 0
    offloaded = [r for r, a in enumerate(asg) if a.placement is not R]
    if offloaded and ctx.block_size_bytes:
        assert n_blocks >= res.pool_lower_bound_blocks >= 1
        assert {blocks[r] for r in offloaded} == set(range(n_blocks))
    # Every lane runs one task at a time.
    for lane in Stream:
        spans = sorted((iv.start_s, iv.end_s) for iv in res.timeline if iv.stream is lane)
        assert all(e1 <= s2 + 1e-12 for (_, e1), (s2, _) in itertools.pairwise(spans))
    assert max((iv.end_s for iv in res.timeline), default=0.0) == pytest.approx(res.step_time_s)


@settings(max_examples=100, deadline=None)
@given(data=st.data(), profile=profiles(), hardware=hardware_profiles())
def test_sync_and_async_agree_when_nothing_is_offloaded(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile
) -> None:
    ctx = SimulationContext.build(profile, hardware)
    states = data.draw(
        st.lists(
            st.sampled_from([HOST, DEVICE]), min_size=ctx.num_regions, max_size=ctx.num_regions
        )
    )
    asg = [RegionAssignment(R, s) for s in states]
    sync = get_simulator("sync").simulate(ctx, asg)
    asyn = get_simulator("async").simulate(ctx, asg)
    assert sync.peak_bytes == asyn.peak_bytes
    assert sync.step_time_s == asyn.step_time_s
    assert sync.pool_size_bytes == asyn.pool_size_bytes == 0


def test_sync_simulator_rejects_prefetches() -> None:
    ctx = SimulationContext.build(three_layers(), flat_hardware())
    asg = [RegionAssignment(A, HOST, 1), RegionAssignment(), RegionAssignment()]
    with pytest.raises(ValueError, match=r"region 0 is async.*'async' simulator"):
        get_simulator("sync").run(ctx, asg)


@pytest.mark.parametrize(
    ("asg", "message"),
    [
        ([RegionAssignment()] * 2, "2 entries; the layout has 3 regions"),
        (
            [RegionAssignment(), RegionAssignment(), RegionAssignment(A, HOST, 2)],
            "last region",
        ),
        (
            [RegionAssignment(A, HOST, 0), RegionAssignment(), RegionAssignment()],
            r"prefetch_at=0; it must be a later region index in 1\.\.2",
        ),
        (
            [RegionAssignment(S, DEVICE), RegionAssignment(), RegionAssignment()],
            "device state is only allowed for resident regions",
        ),
        (
            [RegionAssignment(S, HOST, 2), RegionAssignment(), RegionAssignment()],
            "only async regions are prefetched",
        ),
    ],
)
def test_bad_assignments_are_named(asg: list[RegionAssignment], message: str) -> None:
    ctx = SimulationContext.build(three_layers(), flat_hardware())
    with pytest.raises(ValueError, match=message):
        get_simulator("async").run(ctx, asg)


def test_pinned_regions_cannot_be_offloaded() -> None:
    params = (Parameter("wte", 10, 20), Parameter("w", 10, 20), Parameter("head", 10, 20))
    ops = (Operation("emb", ("wte",)), Operation("mm", ("w",)), Operation("out", ("head",)))
    profile = ModelProfile("tied", params, ops, tied_groups=(("wte", "head"),))
    with pytest.raises(ValueError, match="region 0 is pinned"):
        simulate(profile, flat_hardware(), [RegionAssignment(S), RegionAssignment()])


def test_unknown_simulator_is_named() -> None:
    with pytest.raises(
        ValueError, match="Simulator 'fast' is not registered; known: 'async', 'sync'"
    ):
        get_simulator("fast")


def test_copy_contention_charges_each_region_for_its_copies() -> None:
    # The conversion case above with host work at half its rate while copies run both
    # ways: a one-way copy of t seconds costs the host t / 2 * (1 / 0.5 - 1) = t / 2. Each
    # resident host-state region copies its gradients (0.2 s) and uploads once (0.2 s), so
    # its Adam step takes 0.1 + 0.2 s; conversions run under copies at half their rate,
    # 0.4 s. Region 0: widen [9.2, 9.6], Adam [9.6, 9.9], publish [9.9, 10.3], upload
    # [10.3, 10.5].
    hw = flat_hardware(
        host_adam_params_per_s=1000.0, host_convert_elems_per_s=500.0, host_copy_contention=0.5
    )
    res = get_simulator("async").simulate(
        SimulationContext.build(three_layers(), hw), [RegionAssignment(R, HOST)] * 3
    )
    assert _host_spans(res)[-3:] == _approx_spans(
        [(0, "grad_widen", 9.2, 9.6), (0, "host_step", 9.6, 9.9), (0, "publish", 9.9, 10.3)]
    )
    assert res.step_time_s == pytest.approx(10.5)
    # An offloaded region uploads twice a step (forward and backward): 0.1 + 0.3 s. (Its
    # step waits for backward's end here: one taken under backward is charged otherwise.)
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, HOST), RegionAssignment(S, HOST)]
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    spans = _host_spans(get_simulator("async").simulate(ctx, asg))
    step2 = next((e - s) for r, k, s, e in spans if r == 2 and k == "host_step")
    assert step2 == pytest.approx(0.4)


@pytest.mark.parametrize("contention", [0.0, -0.5, 1.5, float("nan")])
def test_bad_copy_contention_is_named(contention: float) -> None:
    with pytest.raises(ValueError, match="host_copy_contention"):
        flat_hardware(host_copy_contention=contention)


def test_speculative_steps_cost_more_only_before_backward_ends() -> None:
    # Three resident host-state regions, no conversions: copies land at 5.2, 7.2 and 9.2
    # (backward ends at 9). Regions 2 and 1 step in their hooks while copies are still to
    # come, at 3 x 0.1 s; region 0's copy is the last, so step() steps it after backward
    # at the plain 0.1 s, and its parameters go up [9.3, 9.5] as without speculation.
    ctx = SimulationContext.build(
        three_layers(), flat_hardware(host_adam_params_per_s=1000.0), speculative_step_cost=3.0
    )
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    assert _host_spans(res) == _approx_spans(
        [(2, "host_step", 5.2, 5.5), (1, "host_step", 7.2, 7.5), (0, "host_step", 9.2, 9.3)]
    )
    assert res.step_time_s == pytest.approx(9.5)
    # With host work at half its rate under copies, a step under backward runs at that rate
    # for all of its duration, 3 x 0.1 / 0.5 s; region 0's, after backward, is charged for
    # its own copies only: 0.1 + (0.2 + 0.2) / 2 * (1 / 0.5 - 1) s.
    ctx = SimulationContext.build(
        three_layers(),
        flat_hardware(host_adam_params_per_s=1000.0, host_copy_contention=0.5),
        speculative_step_cost=3.0,
    )
    res = get_simulator("async").simulate(ctx, [RegionAssignment(R, HOST)] * 3)
    assert _host_spans(res) == _approx_spans(
        [(2, "host_step", 5.2, 5.8), (1, "host_step", 7.2, 7.8), (0, "host_step", 9.2, 9.5)]
    )
    # Waiting for the answer, nothing speculates: the cost is never charged.
    waiting = [
        get_simulator("async").simulate(
            SimulationContext.build(
                three_layers(),
                flat_hardware(host_adam_params_per_s=1000.0),
                host_step_after_backward=True,
                speculative_step_cost=cost,
            ),
            [RegionAssignment(R, HOST)] * 3,
        )
        for cost in (1.0, 3.0)
    ]
    assert waiting[0].timeline == waiting[1].timeline
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="speculative_step_cost"):
            SimulationContext.build(three_layers(), flat_hardware(), speculative_step_cost=bad)


def test_speculation_thread_lets_step_return_before_the_speculative_step_ends() -> None:
    # Region 0 keeps its state on the device, regions 1 and 2 on the host; host Adam at
    # 20 params/s: 5 s a region. B2 [3,5], B1 [5,7], B0 [7,9]; copies land at 5.2 and 7.2.
    # Region 2 steps in its hook [5.2, 10.2]. Region 1's copy is the last: step() leaves
    # it for after every hook. In the hooks' way region 1's hook queues behind region 2's
    # step, so step() returns, and the device step of region 0 starts, at 10.2. On a
    # thread of their own, the hook runs as the copy lands, and step() returns when
    # backward ends, 9.0. The host steps keep their times (the same cores).
    hw = flat_hardware(host_adam_params_per_s=20.0)
    asg = [RegionAssignment(R, DEVICE), RegionAssignment(R, HOST), RegionAssignment(R, HOST)]
    runs = {
        thread: get_simulator("async").simulate(
            SimulationContext.build(three_layers(), hw, speculation_thread=thread), asg
        )
        for thread in (False, True)
    }
    for thread, start in ((False, 10.2), (True, 9.0)):
        (device_step,) = [iv for iv in runs[thread].timeline if iv.kind == "device_step"]
        assert device_step.start_s == pytest.approx(start)
        assert _host_spans(runs[thread]) == _approx_spans(
            [(2, "host_step", 5.2, 10.2), (1, "host_step", 10.2, 15.2)]
        )
    # Waiting for backward's end, nothing steps early: the thread changes nothing.
    waiting = [
        get_simulator("async").simulate(
            SimulationContext.build(
                three_layers(), hw, host_step_after_backward=True, speculation_thread=thread
            ),
            asg,
        )
        for thread in (False, True)
    ]
    assert waiting[0].timeline == waiting[1].timeline
    with pytest.raises(ValueError, match="speculation_thread"):
        SimulationContext.build(three_layers(), hw, speculation_thread=1)  # type: ignore[arg-type]


def test_speculative_params_leave_the_regions_past_the_limit_to_step() -> None:
    # The first case above with undo buffers for region 2 only: region 1's hook runs
    # while copies are still to come but it may not step there. step() then steps it
    # after the last hook with region 0, in forward order, at the plain 0.1 s.
    hw = flat_hardware(host_adam_params_per_s=1000.0)
    build = partial(SimulationContext.build, three_layers(), hw, speculative_step_cost=3.0)
    numel = build().numel
    asg = [RegionAssignment(R, HOST)] * 3
    res = get_simulator("async").simulate(build(speculative_params=numel[2]), asg)
    assert _host_spans(res) == _approx_spans(
        [(2, "host_step", 5.2, 5.5), (0, "host_step", 9.2, 9.3), (1, "host_step", 9.3, 9.4)]
    )
    # The limit counts whole regions from the last one down: one parameter short of two
    # regions is one region; 0 is none; all of them is the default.
    short = get_simulator("async").simulate(build(speculative_params=numel[2] + numel[1] - 1), asg)
    assert short.timeline == res.timeline
    none = get_simulator("async").simulate(build(speculative_params=0), asg)
    assert [k for _, k, s, _ in _host_spans(none) if s < 9.0] == []
    every = get_simulator("async").simulate(build(speculative_params=sum(numel)), asg)
    assert every.timeline == get_simulator("async").simulate(build(), asg).timeline
    # Device-state regions need no buffers and do not count.
    mixed = [RegionAssignment(R, HOST), RegionAssignment(R, HOST), RegionAssignment(R, DEVICE)]
    one = get_simulator("async").simulate(build(speculative_params=numel[1]), mixed)
    assert [r for r, k, s, _ in _host_spans(one) if k == "host_step" and s < 9.0] == [1]
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="speculative_params"):
            build(speculative_params=bad)


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
