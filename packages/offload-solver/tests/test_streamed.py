"""STREAMED optimizer state: host-resident state stepped on the device (hand-checked
timelines, memory, the search in ``solve``, validation, JSON and the CLI)."""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from solver_helpers import UNFITTED, assignments, engine_cases, flat_hardware

from offload_solver import (
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    RegionAssignment,
    SimulationContext,
    StatePlacement,
    Stream,
    StreamedStepCosts,
    TimelineInterval,
    get_simulator,
    solve,
)
from offload_solver.cli import main
from offload_solver.simulators._steady import steady_state
from offload_solver.simulators._step import run
from offload_solver.simulators._stream import stage_split
from offload_solver.simulators._timeline import KINDS, LANES, EngineRun
from offload_solver.solve import BUDGET_SAFETY_FACTOR
from offload_solver.solvers._streamed import interleave, stream_candidates

A, S, R = ParamPlacement.ASYNC, ParamPlacement.SYNC, ParamPlacement.RESIDENT
HOST, DEVICE, STREAMED = StatePlacement.HOST, StatePlacement.DEVICE, StatePlacement.STREAMED
W4_LIKE = StreamedStepCosts(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=500)
"""10 bytes up and down per parameter (fp32 master, bf16 moments, fp16 training); a
500-byte ring."""
W4_WRITING = dataclasses.replace(W4_LIKE, resident_down_bytes_per_param=8)
"""W4_LIKE, with a RESIDENT region's device step writing its fp16 parameters on the
device: 8 bytes down (master and moments), none of them uploaded again."""
W4_STAGED = dataclasses.replace(
    W4_LIKE, staged_chunks=1, staged_chunk_numel=100, staged_bytes_per_param=8
)
"""W4_LIKE, with one chunk of 100 parameters' master weights and moments (8 bytes each)
sent up in the backward (``PlanOptions.stage_in_backward``)."""


def three_layers(saved_bytes: int = 10) -> ModelProfile:
    """Three 100-parameter (200 B) regions; forward 1 s and backward 2 s each at 1000
    FLOP/s."""
    params = tuple(Parameter(f"w{i}", 100, 200) for i in range(3))
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=saved_bytes, fwd_flop=1000, bwd_flop=2000)
        for i in range(3)
    )
    return ModelProfile("three", params, ops)


def layers(n: int = 6, numel: int = 1000) -> ModelProfile:
    """``n`` regions of ``numel`` fp16 parameters; forward 1 s and backward 2 s each."""
    params = tuple(Parameter(f"w{i}", numel, 2 * numel) for i in range(n))
    ops = tuple(
        Operation(f"mm{i}", (f"w{i}",), saved_bytes=100, fwd_flop=1000, bwd_flop=2000)
        for i in range(n)
    )
    return ModelProfile("layers", params, ops)


def intervals(
    timeline: tuple[TimelineInterval, ...],
) -> list[tuple[str, int, str, tuple[float, float]]]:
    return [(iv.stream.value, iv.region, iv.kind, (iv.start_s, iv.end_s)) for iv in timeline]


def tasks(out: EngineRun) -> list[tuple[str, int, str, tuple[float, float]]]:
    return [
        (LANES[ln].value, r, KINDS[k], (s, e))
        for ln, r, k, s, e in zip(out.lane, out.region, out.kind, out.start, out.end, strict=True)
    ]


# --------------------------------------------------------------------------------------
# The step, by hand
# --------------------------------------------------------------------------------------


def test_a_streamed_region_is_stepped_on_the_device_after_the_answer() -> None:
    # fp16 (host steps wait for the overflow answer at the end of backward); three
    # resident regions, region 1 STREAMED, the others HOST. Copies at 1000 B/s: a
    # gradient (100 x 2 B) or a parameter upload 0.2 s, the state up and down
    # (100 x 10 B) 1 s each; Adam on the host 2 s, on the device 0.1 s (1000/s).
    # Cold step: forward [0,3]; B2 [3,5], B1 [5,7], B0 [7,9]; gradients land at 5.2, 7.2
    #   and 9.2. Region 0 lands after the answer (9) and steps in its hook [9.2,11.2],
    #   its upload issued at its end. The job step() queues for regions 1 and 2 starts
    #   on the host worker then (11.2): it issues region 1's device step first, then
    #   steps region 2 [11.2,13.2]. Region 1's state goes up after region 0's upload
    #   (issued at the same instant) [11.2,11.4]: [11.4,12.4]; its step [12.4,12.5] on
    #   the compute lane (idle since 9), down [12.5,13.5] on D2H, and its post-step
    #   upload [13.5,13.7] after region 2's [13.2,13.4].
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    assert intervals(res.timeline) == [
        ("compute", 0, "fwd", pytest.approx((0.0, 1.0))),
        ("compute", 1, "fwd", pytest.approx((1.0, 2.0))),
        ("compute", 2, "fwd", pytest.approx((2.0, 3.0))),
        ("compute", 2, "bwd", pytest.approx((3.0, 5.0))),
        ("d2h", 2, "grad_offload", pytest.approx((5.0, 5.2))),
        ("compute", 1, "bwd", pytest.approx((5.0, 7.0))),
        ("d2h", 1, "grad_offload", pytest.approx((7.0, 7.2))),
        ("compute", 0, "bwd", pytest.approx((7.0, 9.0))),
        ("d2h", 0, "grad_offload", pytest.approx((9.0, 9.2))),
        ("host", 0, "host_step", pytest.approx((9.2, 11.2))),
        ("host", 2, "host_step", pytest.approx((11.2, 13.2))),
        ("h2d", 0, "param_upload", pytest.approx((11.2, 11.4))),
        ("h2d", 1, "stream_up", pytest.approx((11.4, 12.4))),
        ("compute", 1, "stream_step", pytest.approx((12.4, 12.5))),
        ("d2h", 1, "stream_down", pytest.approx((12.5, 13.5))),
        ("h2d", 2, "param_upload", pytest.approx((13.2, 13.4))),
        ("h2d", 1, "param_upload", pytest.approx((13.5, 13.7))),
    ]
    assert res.step_time_s == pytest.approx(13.7)
    # The repeating step starts at 9, region 0's update done at 2.2 and region 2's at
    #   4.2. F0 waits for region 0's upload [2.2,2.4]: [2.4,3.4], while region 1's state
    #   goes up [2.4,3.4] (issued at 2.2). Its step [3.4,3.5] goes on the compute lane
    #   before F1, down [3.5,4.5], its upload [4.5,4.7] after region 2's [4.2,4.4]: F1
    #   waits for it [4.7,5.7]; F2 [5.7,6.7]; backward 6 s: the period is 12.7, against
    #   13.4 with region 1 stepped on the host (test_steady_state).
    assert res.steady_step_time_s == pytest.approx(12.7)
    cold = get_simulator("async").run(ctx, asg)
    steady = steady_state(ctx, asg, cold)
    assert steady.converged and steady.periods_s == pytest.approx((9.0, 12.7))
    assert tasks(steady.last)[:9] == [
        ("h2d", 0, "param_upload", pytest.approx((2.2, 2.4))),
        ("h2d", 1, "stream_up", pytest.approx((2.4, 3.4))),
        ("compute", 0, "fwd", pytest.approx((2.4, 3.4))),
        ("compute", 1, "stream_step", pytest.approx((3.4, 3.5))),
        ("d2h", 1, "stream_down", pytest.approx((3.5, 4.5))),
        ("h2d", 2, "param_upload", pytest.approx((4.2, 4.4))),
        ("h2d", 1, "param_upload", pytest.approx((4.5, 4.7))),
        ("compute", 1, "fwd", pytest.approx((4.7, 5.7))),
        ("compute", 2, "fwd", pytest.approx((5.7, 6.7))),
    ]
    all_host = [RegionAssignment(R, HOST)] * 3
    assert get_simulator("async").simulate(ctx, all_host).steady_step_time_s == pytest.approx(13.4)
    # Memory: 600 B of resident parameters; the ring (500 B) from the copy up's start
    # (11.4) to the copy down's end (13.5), when no gradient is left on the device. In
    # the repeating step the ring is held [2.4,4.5], over the 10 B F0 saves: the peak.
    curve = [(m.time_s, m.bytes) for m in res.memory_curve if m.time_s >= 9.0]
    assert curve == [
        (pytest.approx(9.0), 600),
        (pytest.approx(9.0), 800),
        (pytest.approx(9.2), 600),
        (pytest.approx(11.4), 1100),
        (pytest.approx(13.5), 600),
    ]
    assert cold.peak_bytes == 1100
    assert steady.last.carried_stream_window == pytest.approx((2.4, 4.5))
    assert res.peak_bytes == steady.last.stream_peak_bytes == 1110


def test_a_resident_streamed_region_written_on_the_device_is_not_uploaded_again() -> None:
    # test_a_streamed_region_is_stepped_on_the_device_after_the_answer, with the device
    # step writing region 1's parameters in place (W4_WRITING): its copy down is 800 B,
    # [12.5,13.3], and nothing of it goes up after; the cold step ends with region 2's
    # upload, 13.4 against 13.7.
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_WRITING,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    assert intervals(res.timeline)[-4:] == [
        ("h2d", 1, "stream_up", pytest.approx((11.4, 12.4))),
        ("compute", 1, "stream_step", pytest.approx((12.4, 12.5))),
        ("d2h", 1, "stream_down", pytest.approx((12.5, 13.3))),
        ("h2d", 2, "param_upload", pytest.approx((13.2, 13.4))),
    ]
    assert res.step_time_s == pytest.approx(13.4)
    # The repeating step: F1 waits for region 1's device step [3.4,3.5] alone, its copy
    # down [3.5,4.3] running beside it: F1 [3.5,4.5], F2 after region 2's upload [4.5,5.5],
    # backward 6 s: a period of 11.5 against 12.7 with the copy down and upload between.
    cold = get_simulator("async").run(ctx, asg)
    steady = steady_state(ctx, asg, cold)
    assert steady.converged and steady.periods_s == pytest.approx((9.0, 11.5))
    assert tasks(steady.last)[:8] == [
        ("h2d", 0, "param_upload", pytest.approx((2.2, 2.4))),
        ("h2d", 1, "stream_up", pytest.approx((2.4, 3.4))),
        ("compute", 0, "fwd", pytest.approx((2.4, 3.4))),
        ("compute", 1, "stream_step", pytest.approx((3.4, 3.5))),
        ("d2h", 1, "stream_down", pytest.approx((3.5, 4.3))),
        ("compute", 1, "fwd", pytest.approx((3.5, 4.5))),
        ("h2d", 2, "param_upload", pytest.approx((4.2, 4.4))),
        ("compute", 2, "fwd", pytest.approx((4.5, 5.5))),
    ]
    assert res.steady_step_time_s == pytest.approx(11.5)
    # The ring is held until the copy down lands, as it is without in-place writes.
    assert steady.last.carried_stream_window == pytest.approx((2.4, 4.3))
    # Offloaded regions are not written on the device: their copy down is unchanged.
    asg_a = [RegionAssignment(R, HOST), RegionAssignment(S, STREAMED), RegionAssignment(R, HOST)]
    for costs in (W4_LIKE, W4_WRITING):
        ctx = SimulationContext.build(
            three_layers(),
            hw,
            host_step_after_backward=True,
            streamed=costs,
            cost_model=UNFITTED,
        )
        got = {
            (ln, r, k): span
            for ln, r, k, span in intervals(get_simulator("async").simulate(ctx, asg_a).timeline)
        }
        assert got["d2h", 1, "stream_down"][1] - got["d2h", 1, "stream_down"][0] == (
            pytest.approx(1.0)
        )


def test_state_staged_in_the_backward_leaves_the_step_the_gradient() -> None:
    # test_a_streamed_region_is_stepped_on_the_device_after_the_answer with region 1's
    # master weights and moments (100 x 8 B) sent up from its gradient hook in the
    # backward (W4_STAGED): its gradient lands at 7.2, when the hook opens the ring; the
    # state goes up [7.2,8.0] while B0 runs. At the step only its gradient goes up
    # (100 x 2 B) [11.4,11.6]; its step [11.6,11.7], down [11.7,12.7], its post-step
    # upload [12.7,12.9]: the cold step ends with region 2's upload [13.2,13.4], 13.4
    # against 13.7.
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_STAGED,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    got = {(stream, r, kind): span for stream, r, kind, span in intervals(res.timeline)}
    assert got["h2d", 1, "stream_stage"] == pytest.approx((7.2, 8.0))
    assert got["h2d", 1, "stream_up"] == pytest.approx((11.4, 11.6))
    assert got["compute", 1, "stream_step"] == pytest.approx((11.6, 11.7))
    assert got["d2h", 1, "stream_down"] == pytest.approx((11.7, 12.7))
    assert got["h2d", 1, "param_upload"] == pytest.approx((12.7, 12.9))
    assert res.step_time_s == pytest.approx(13.4)
    # Memory: the ring (500 B) is held from the hook (7.2) to the copy down's end, over
    # B0's 10 saved bytes and then region 0's gradient (200 B) on its way down at 9: 700
    # B above the 600 of parameters from the hook on (stage_level), the peak (1300),
    # against 1110 when the ring waited for the step.
    curve = [(m.time_s, m.bytes) for m in res.memory_curve if m.time_s >= 7.0]
    assert curve == [
        (pytest.approx(7.0), 610),
        (pytest.approx(7.0), 810),
        (pytest.approx(7.2), 610),
        (pytest.approx(7.2), 1110),
        (pytest.approx(9.0), 1100),
        (pytest.approx(9.0), 1300),
        (pytest.approx(9.2), 1100),
        (pytest.approx(12.7), 600),
    ]
    cold = get_simulator("async").run(ctx, asg)
    assert cold.stage_start == pytest.approx(7.2) and cold.stage_level == 700
    assert res.peak_bytes == 1300
    plain = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=UNFITTED,
    )
    assert get_simulator("async").simulate(plain, asg).peak_bytes == 1110
    # The repeating step stages in its own backward as well (B1 ends at 10.7, the
    # gradient lands at 10.9), and its period is the unstaged one's (12.7): region 1's
    # forward still waits for its copy down and upload.
    steady = steady_state(ctx, asg, cold)
    assert steady.converged and steady.periods_s == pytest.approx((9.0, 12.7))
    assert ("h2d", 1, "stream_stage", pytest.approx((10.9, 11.7))) in tasks(steady.last)
    assert steady.last.stage_level == 700
    # A micro-batch that only accumulates stages nothing.
    assert run(ctx, asg, optimizer_step=False).stage_start is None


def test_staged_chunks_are_the_streamed_regions_leading_ones_in_forward_order() -> None:
    # Six regions of 1000 parameters, 1, 3 and 4 STREAMED; 10 B up, 8 of them staged, at
    # 1000 B/s. Three chunks of 600: region 1 takes two (all 1000 parameters), region 3
    # the third (600); region 4 none. Region 4's hook (the first to run in the backward)
    # opens the ring; the staged state is 1600 x 8 B, 12.8 s. At the step region 1 sends
    # its gradients (1000 x 2 B), region 3 its gradients and its last 400 parameters'
    # state (2000 + 400 x 8 B), region 4 everything (10000 B).
    hw = flat_hardware()
    streamed = [False, True, False, True, True, False]
    for chunk, staged, up in (
        (600, 12.8, [2.0, 5.2, 10.0]),
        (400, 8.0, [2.0, 10.0, 10.0]),  # region 1's three chunks use every slot
        (5000, 24.0, [2.0, 2.0, 2.0]),  # one chunk a region: all three are staged
    ):
        costs = dataclasses.replace(
            W4_LIKE, staged_chunks=3, staged_chunk_numel=chunk, staged_bytes_per_param=8
        )
        ctx = SimulationContext.build(layers(), hw, streamed=costs, cost_model=UNFITTED)
        hook, first, seconds, sup = stage_split(ctx, costs, streamed)
        assert (hook, first) == (4, 1)
        assert seconds == pytest.approx(staged)
        assert [sup[r] for r in (1, 3, 4)] == pytest.approx(up)
        assert sup[0] == pytest.approx(10.0)  # as the context has it


def test_streamed_copies_up_run_at_the_profiles_fraction_of_h2d() -> None:
    # The first test's step with stream_up_fraction 0.5: region 1's state goes up in 2 s
    # instead of 1 [11.4,13.4]; its device step [13.4,13.5], down [13.5,14.5] and post-step
    # upload [14.5,14.7] move with it. Region 2's post-step upload, issued at 13.2, now
    # waits for the copy up on the H2D lane: [13.4,13.6].
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    cost_model = dataclasses.replace(UNFITTED, stream_up_fraction=0.5)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=cost_model,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    got = {(stream, r, kind): span for stream, r, kind, span in intervals(res.timeline)}
    assert got["h2d", 1, "stream_up"] == pytest.approx((11.4, 13.4))
    assert got["compute", 1, "stream_step"] == pytest.approx((13.4, 13.5))
    assert got["d2h", 1, "stream_down"] == pytest.approx((13.5, 14.5))
    assert got["h2d", 2, "param_upload"] == pytest.approx((13.4, 13.6))
    assert got["h2d", 1, "param_upload"] == pytest.approx((14.5, 14.7))
    assert res.step_time_s == pytest.approx(14.7)
    # Parameter uploads and prefetches keep the full rate.
    assert got["h2d", 0, "param_upload"] == pytest.approx((11.2, 11.4))


def test_streamed_copies_cost_the_host_where_its_step_would_run() -> None:
    # The case above with host work at half its rate while copies run both ways
    # (contention 0.5): a second of one-way copy costs the host 0.5 s. Region 0's step
    # in its hook costs 2 s plus its own copies (gradient 0.2, upload 0.2): [9.2,11.4].
    # Then the deferred job, in forward order: region 1's place holds what its copies
    # cost (gradient 0.2, upload 0.2, state up 1 and down 1: 1.2 s) [11.4,12.6], and
    # region 2 steps [12.6,14.8]. Region 1's device step is issued at the job's start
    # (11.4) all the same: its state goes up after region 0's upload [11.4,11.6].
    hw = flat_hardware(
        host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0, host_copy_contention=0.5
    )
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    host = [t for t in intervals(res.timeline) if t[0] == "host"]
    assert host == [
        ("host", 0, "host_step", pytest.approx((9.2, 11.4))),
        ("host", 1, "stream_contention", pytest.approx((11.4, 12.6))),
        ("host", 2, "host_step", pytest.approx((12.6, 14.8))),
    ]
    up = next(iv for iv in res.timeline if iv.kind == "stream_up")
    assert (up.start_s, up.end_s) == pytest.approx((11.6, 12.6))


@pytest.mark.parametrize(
    ("charge", "host"),
    [
        # Half the charge: region 1's place holds 0.6 s [11.4,12.0], region 2 steps
        # [12.0,14.2].
        (
            0.5,
            [
                ("host", 0, "host_step", pytest.approx((9.2, 11.4))),
                ("host", 1, "stream_contention", pytest.approx((11.4, 12.0))),
                ("host", 2, "host_step", pytest.approx((12.0, 14.2))),
            ],
        ),
        # None: no task for region 1, region 2 steps right after region 0 [11.4,13.6].
        (
            0.0,
            [
                ("host", 0, "host_step", pytest.approx((9.2, 11.4))),
                ("host", 2, "host_step", pytest.approx((11.4, 13.6))),
            ],
        ),
    ],
)
def test_stream_host_charge_scales_only_what_streamed_copies_cost_the_host(
    charge: float, host: list[object]
) -> None:
    # The case above with stream_host_charge below 1: region 0's step still pays for its
    # own copies in full (2 s + 0.2 + 0.2), and the streamed copies themselves are
    # untouched (stream_up_fraction is their side of the contention).
    hw = flat_hardware(
        host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0, host_copy_contention=0.5
    )
    cost_model = dataclasses.replace(UNFITTED, stream_host_charge=charge)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=cost_model,
    )
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    assert [t for t in intervals(res.timeline) if t[0] == "host"] == host
    up = next(iv for iv in res.timeline if iv.kind == "stream_up")
    assert (up.start_s, up.end_s) == pytest.approx((11.6, 12.6))


def test_a_streamed_region_landing_after_the_answer_is_issued_in_its_hook() -> None:
    # As above with region 0 STREAMED: its gradient lands at 9.2, after the answer (9),
    # so its device step is issued in its hook, where a host-state region would step:
    # up [9.2,10.2], step [10.2,10.3], down [10.3,11.3]. The job for regions 1 and 2
    # starts at 9.2 too and steps them [9.2,11.2] and [11.2,13.2]; region 1's upload
    # (issued at 11.2) goes before region 0's (11.3).
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(
        three_layers(),
        hw,
        host_step_after_backward=True,
        streamed=W4_LIKE,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, STREAMED), RegionAssignment(R, HOST), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    after = [t for t in intervals(res.timeline) if t[3][0] >= 9.2 - 1e-9]
    assert after == [
        ("host", 1, "host_step", pytest.approx((9.2, 11.2))),
        ("host", 2, "host_step", pytest.approx((11.2, 13.2))),
        ("h2d", 0, "stream_up", pytest.approx((9.2, 10.2))),
        ("compute", 0, "stream_step", pytest.approx((10.2, 10.3))),
        ("d2h", 0, "stream_down", pytest.approx((10.3, 11.3))),
        ("h2d", 1, "param_upload", pytest.approx((11.2, 11.4))),
        ("h2d", 0, "param_upload", pytest.approx((11.4, 11.6))),
        ("h2d", 2, "param_upload", pytest.approx((13.2, 13.4))),
    ]


def test_without_the_answer_a_streamed_region_waits_for_every_hook() -> None:
    # bf16 (no answer to wait for; every region may step in its hook). Gradients land at
    # 5.2, 7.2 and 9.2. Region 2's hook runs before the last copy lands: it steps
    # speculatively [5.2,7.2]. Region 1 never does: it is left to step(), which has seen
    # every hook when region 0's gradient lands (9.2); region 0 (landing last) steps
    # then [9.2,11.2], and region 1's device step is issued at 9.2: up [9.2,10.2], step
    # [10.2,10.3], down [10.3,11.3], its upload after region 0's (issued at 11.2):
    # [11.4,11.6]; region 2's upload, issued at 7.2, goes first [7.2,7.4].
    hw = flat_hardware(host_adam_params_per_s=50.0, device_adam_params_per_s=1000.0)
    ctx = SimulationContext.build(three_layers(), hw, streamed=W4_LIKE, cost_model=UNFITTED)
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    res = get_simulator("async").simulate(ctx, asg)
    after = [t for t in intervals(res.timeline) if t[2] not in ("fwd", "bwd", "grad_offload")]
    assert after == [
        ("host", 2, "host_step", pytest.approx((5.2, 7.2))),
        ("host", 0, "host_step", pytest.approx((9.2, 11.2))),
        ("h2d", 2, "param_upload", pytest.approx((7.2, 7.4))),
        ("h2d", 1, "stream_up", pytest.approx((9.2, 10.2))),
        ("compute", 1, "stream_step", pytest.approx((10.2, 10.3))),
        ("d2h", 1, "stream_down", pytest.approx((10.3, 11.3))),
        ("h2d", 0, "param_upload", pytest.approx((11.2, 11.4))),
        ("h2d", 1, "param_upload", pytest.approx((11.4, 11.6))),
    ]


def test_the_ring_held_into_the_next_forward_counts_in_the_peak() -> None:
    # Regions 0 and 1 keep their state on the device (100 x 16 B each), region 2 is
    # STREAMED; every operation saves 1000 B; the ring is 3000 B. Static bytes: 600 of
    # parameters and 3200 of state. Cold step: the device steps run [9,9.2], region 2's
    # state goes up [9,10], steps [10,10.1] and comes down [10.1,11.1] with no gradient
    # left on its way: 3000 B above the static ones there, as at the start of B2 (3000 B
    # saved). The repeating step starts at 9.2: region 2's up [-0.2,0.8] (issued at the
    # answer, 9), F0 [0,1], its step [1,1.1], F1 [1.1,2.1] while it comes down
    # [1.1,2.1]: the ring overlaps 1000 B saved by F0, 4000 B in all, above the cold
    # step's 3000. Its upload [2.1,2.3] holds F2 to [2.3,3.3]: the period is 9.5.
    hw = flat_hardware(device_adam_params_per_s=1000.0)
    costs = StreamedStepCosts(10, 10, 3000)
    ctx = SimulationContext.build(
        three_layers(saved_bytes=1000),
        hw,
        host_step_after_backward=True,
        streamed=costs,
        cost_model=UNFITTED,
    )
    asg = [RegionAssignment(R, DEVICE), RegionAssignment(R, DEVICE), RegionAssignment(R, STREAMED)]
    cold = get_simulator("async").run(ctx, asg)
    assert cold.stream_window == pytest.approx((9.0, 11.1))
    assert cold.peak_bytes == 3800 + 3000
    steady = steady_state(ctx, asg, cold)
    assert steady.period_s == pytest.approx(9.5)
    assert steady.last.carried_stream_window == pytest.approx((-0.2, 2.1))
    assert steady.last.stream_peak_bytes == 3800 + 3000 + 1000
    res = get_simulator("async").simulate(ctx, asg)
    assert max(m.bytes for m in res.memory_curve) == 6800  # the cold step's
    assert res.peak_bytes == 7800
    # solve() reports the same peak, and keeps to a budget that holds it.
    plan = solve(
        three_layers(saved_bytes=1000),
        hw,
        10**6,
        host_step_after_backward=True,
        streamed=costs,
        block_search_range_bytes=0,
        cost_model=UNFITTED,
    )
    assert plan.predicted_peak_bytes >= max(m.bytes for m in plan.memory_curve)


# --------------------------------------------------------------------------------------
# The search
# --------------------------------------------------------------------------------------


def test_interleave_spreads_the_streamed_parameters_over_forward_order() -> None:
    ten = list(range(10))
    assert interleave(ten, [1] * 10, 0.5) == [0, 2, 4, 6, 8]
    assert interleave(ten, [1] * 10, 0.3) == [0, 3, 6]
    assert interleave(ten, [1] * 10, 1.0) == ten
    # By parameters: a large candidate counts for more.
    assert interleave([0, 1, 2, 3], [10, 1, 1, 10], 0.5) == [0, 3]


def test_candidates_are_host_state_regions_that_do_not_speculate() -> None:
    hw = flat_hardware(host_adam_params_per_s=50.0)
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, HOST), RegionAssignment(R, DEVICE)]
    # fp16 without speculation: every host-state region steps after backward.
    ctx = SimulationContext.build(three_layers(), hw, host_step_after_backward=True)
    cold = get_simulator("async").run(ctx, asg)
    assert stream_candidates(ctx, asg, cold) == [0, 1]
    # Speculating with undo buffers for 100 parameters: region 1 (its gradients land
    # first among the host-state ones) steps in its hook, region 0 after backward.
    asg = [RegionAssignment(R, HOST)] * 3
    ctx = SimulationContext.build(three_layers(), hw, speculative_params=100)
    cold = get_simulator("async").run(ctx, asg)
    assert cold.stepped_early == [False, False, True]
    assert stream_candidates(ctx, asg, cold) == [0, 1]


def test_streaming_pays_where_the_host_bounds_the_step_and_pcie_is_idle() -> None:
    # Six regions of 1000 parameters, all state on the host, Adam at 250 parameters/s:
    # 4 s per region on the host against 3 s of compute, so the host bounds the step.
    # With copies at 1 MB/s, PCIe is idle: streaming a region's 20 kB costs 20 ms.
    profile = layers()
    fast = flat_hardware(
        h2d_bytes_per_s=1e6,
        d2h_bytes_per_s=1e6,
        host_adam_params_per_s=250.0,
        device_adam_params_per_s=1e6,
    )
    ctx = SimulationContext.build(profile, fast, host_step_after_backward=True, streamed=W4_LIKE)
    sim = get_simulator("async")
    all_host = [RegionAssignment(R, HOST)] * 6
    half = [RegionAssignment(R, STREAMED if r % 2 == 0 else HOST) for r in range(6)]
    host_bound = sim.simulate(ctx, all_host).steady_step_time_s
    assert host_bound > 6 * 4.0
    assert sim.simulate(ctx, half).steady_step_time_s < host_bound - 8.0

    kwargs: dict[str, Any] = dict(
        state_on_device=False, host_step_after_backward=True, block_search_range_bytes=0
    )
    # The streamed phase streams some regions, not all, at the fractions.
    base = solve(profile, fast, 10**6, **kwargs)
    plan = solve(profile, fast, 10**6, streamed=W4_LIKE, **kwargs)
    streamed = [rp.region.index for rp in plan.regions if rp.state is STREAMED]
    assert streamed and len(streamed) < 6
    assert plan.predicted_step_time_s < base.predicted_step_time_s - 8.0
    assert plan.streamed == W4_LIKE
    assert [rp.placement for rp in plan.regions] == [rp.placement for rp in base.regions]
    assert plan.num_simulations > base.num_simulations
    assert plan.predicted_peak_bytes <= 10**6 * BUDGET_SAFETY_FACTOR

    # At 1 kB/s PCIe is busy already (gradients down and parameters up take 2 s per
    # region each way) and a streamed step's 20 kB would take 20 s: none is streamed,
    # and the plan is the one without streaming.
    slow = flat_hardware(
        h2d_bytes_per_s=1000.0,
        d2h_bytes_per_s=1000.0,
        host_adam_params_per_s=250.0,
        device_adam_params_per_s=1e6,
    )
    base = solve(profile, slow, 10**6, **kwargs)
    plan = solve(profile, slow, 10**6, streamed=W4_LIKE, **kwargs)
    assert all(rp.state is HOST for rp in plan.regions)
    assert plan.regions == base.regions and plan.streamed is None
    assert plan.predicted_step_time_s == base.predicted_step_time_s
    assert plan.timeline == base.timeline
    one = [RegionAssignment(R, STREAMED)] + [RegionAssignment(R, HOST)] * 5
    ctx = SimulationContext.build(profile, slow, host_step_after_backward=True, streamed=W4_LIKE)
    assert sim.simulate(ctx, one).steady_step_time_s > base.predicted_step_time_s


def test_a_ring_that_does_not_fit_is_not_chosen() -> None:
    # The fast case above under a 1 MB budget (950 kB planned): the six resident regions
    # hold 12 kB all step, so a ring of 938 kB + 1 never fits, one of 900 kB does.
    profile = layers()
    fast = flat_hardware(
        h2d_bytes_per_s=1e6,
        d2h_bytes_per_s=1e6,
        host_adam_params_per_s=250.0,
        device_adam_params_per_s=1e6,
    )
    kwargs: dict[str, Any] = dict(
        state_on_device=False, host_step_after_backward=True, block_search_range_bytes=0
    )
    too_big = StreamedStepCosts(10, 10, 950_000 - 12_000 + 1)
    plan = solve(profile, fast, 10**6, streamed=too_big, **kwargs)
    assert all(rp.state is HOST for rp in plan.regions)
    plan = solve(profile, fast, 10**6, streamed=StreamedStepCosts(10, 10, 900_000), **kwargs)
    assert any(rp.state is STREAMED for rp in plan.regions)
    assert 900_000 + 12_000 <= plan.predicted_peak_bytes <= 950_000


# --------------------------------------------------------------------------------------
# Any plan
# --------------------------------------------------------------------------------------


@engine_cases(
    max_examples=150,
    flips=st.lists(st.booleans(), min_size=20, max_size=20),
    costs=st.sampled_from(
        [
            StreamedStepCosts(10, 10, 64),
            StreamedStepCosts(0.5, 2.0, 1),
            W4_LIKE,
            W4_WRITING,
            W4_STAGED,
            StreamedStepCosts(
                10, 10, 64, 8, staged_chunks=2, staged_chunk_numel=50, staged_bytes_per_param=8
            ),
        ]
    ),
    contention=st.sampled_from([1.0, 0.5]),
)
def test_streamed_steps_keep_lanes_ordered_and_forwards_waiting(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: HardwareProfile,
    after_backward: bool,
    flips: list[bool],
    costs: StreamedStepCosts,
    contention: float,
) -> None:
    hardware = dataclasses.replace(hardware, host_copy_contention=contention)
    ctx = SimulationContext.build(
        profile, hardware, host_step_after_backward=after_backward, streamed=costs
    )
    asg = data.draw(assignments(ctx.layout))
    asg = [
        RegionAssignment(a.placement, STREAMED, a.prefetch_at)
        if a.state is HOST and flips[r % len(flips)]
        else a
        for r, a in enumerate(asg)
    ]
    sim = get_simulator("async")
    cold = sim.run(ctx, asg)
    steady = steady_state(ctx, asg, cold)
    chains = [r for r, a in enumerate(asg) if a.state is STREAMED and ctx.numel[r] > 0]
    writes = costs.resident_down_bytes_per_param is not None
    for out in (cold, steady.last):
        # Every lane runs one task at a time.
        for ln in range(len(LANES)):
            spans = [
                (s, e) for x, s, e in zip(out.lane, out.start, out.end, strict=True) if x == ln
            ]
            assert all(b[0] >= a[1] - 1e-9 for a, b in itertools.pairwise(spans))
        # This step's own streamed steps (the last of each kind): once its gradient is
        # down, up, step, down, then a resident one's upload.
        spans: dict[tuple[int, str], list[tuple[float, float]]] = {}
        for r, k, s, e in zip(out.region, out.kind, out.start, out.end, strict=True):
            spans.setdefault((r, KINDS[k]), []).append((s, e))
        for r in chains:
            u, p, d = (spans[r, kind][-1] for kind in ("stream_up", "stream_step", "stream_down"))
            landed = spans[r, "grad_offload"][-1][1]
            assert landed - 1e-9 <= u[0] and u[1] <= p[0] + 1e-9 and p[1] <= d[0] + 1e-9
            if asg[r].placement is R and not writes:
                assert spans[r, "param_upload"][-1][0] >= d[1] - 1e-9
            elif asg[r].placement is R:
                # The device step wrote its parameters: nothing goes up after it.
                assert (r, "param_upload") not in spans
        assert not any(
            KINDS[k] == "host_step" and asg[r].state is STREAMED
            for r, k in zip(out.region, out.kind, strict=True)
        )
        # Staging: one copy of state up, once the last streamed region's gradient is
        # down (its hook) and before this step's copies up, with the ring held from then.
        stages = spans.get((chains[0], "stream_stage"), []) if chains else []
        if costs.staged_chunks and chains and out.tail_streams:
            (stage,) = stages
            assert stage[0] >= spans[chains[-1], "grad_offload"][-1][1] - 1e-9
            assert all(stage[1] <= spans[r, "stream_up"][-1][0] + 1e-9 for r in chains)
            assert out.stage_start is not None and out.stage_level is not None
        else:
            assert not stages and out.stage_start is None
    # The repeating step: each streamed region's parameters are used only once its
    # previous step is back down (and, resident, uploaded again), or, written on the
    # device, once its device step is done.
    last = steady.last
    for r in chains:
        ends = {
            KINDS[k]: e
            for x, k, e in reversed(list(zip(last.region, last.kind, last.end, strict=True)))
            if x == r
        }  # each kind's first end in the step
        down = ends["stream_down"]
        if asg[r].placement is R and writes:
            assert last.cs_f[r] >= ends["stream_step"] - 1e-9
            continue
        if asg[r].placement is R:
            used = last.cs_f[r]
            up = [
                e
                for x, k, s, e in zip(last.region, last.kind, last.start, last.end, strict=True)
                if x == r and KINDS[k] == "param_upload" and s < used + 1e-9
            ]
            assert up and used >= max(up) - 1e-9
        elif asg[r].placement is S:
            used = last.cs_f[r] - ctx.upload_s[r]
        else:
            used = last.start[last.pf_f_task[r]]
        assert used >= down - 1e-9
    # Memory: the cold step's curve reaches its peak; the steady overlap only adds.
    res = sim.simulate(ctx, asg)
    assert max(m.bytes for m in res.memory_curve) == cold.peak_bytes
    assert res.peak_bytes == max(cold.peak_bytes, steady.last.stream_peak_bytes)
    if chains:
        assert res.peak_bytes >= res.static_bytes + costs.slot_bytes
    assert math.isfinite(res.steady_step_time_s) and res.steady_step_time_s >= 0


@engine_cases(max_examples=60)
def test_costs_without_streamed_regions_change_nothing(
    data: st.DataObject, profile: ModelProfile, hardware: HardwareProfile, after_backward: bool
) -> None:
    plain = SimulationContext.build(profile, hardware, host_step_after_backward=after_backward)
    with_costs = SimulationContext.build(
        profile, hardware, host_step_after_backward=after_backward, streamed=W4_LIKE
    )
    asg = data.draw(assignments(plain.layout))
    sim = get_simulator("async")
    assert sim.simulate(with_costs, asg) == sim.simulate(plain, asg)
    assert run(with_costs, asg).stream_peak_bytes == 0


# --------------------------------------------------------------------------------------
# Validation, JSON, CLI
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            dict(up_bytes_per_param=0, down_bytes_per_param=10, slot_bytes=1),
            "up_bytes_per_param is 0",
        ),
        (
            dict(up_bytes_per_param=10, down_bytes_per_param=-1, slot_bytes=1),
            "down_bytes_per_param is -1",
        ),
        (dict(up_bytes_per_param=math.inf, down_bytes_per_param=1, slot_bytes=1), "finite"),
        (dict(up_bytes_per_param=math.nan, down_bytes_per_param=1, slot_bytes=1), "finite"),
        (dict(up_bytes_per_param=True, down_bytes_per_param=1, slot_bytes=1), "up_bytes_per_param"),
        (dict(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=0), "slot_bytes is 0"),
        (dict(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=1.5), "must be an int"),
        (
            dict(
                up_bytes_per_param=10,
                down_bytes_per_param=10,
                slot_bytes=1,
                resident_down_bytes_per_param=math.inf,
            ),
            "resident_down_bytes_per_param is inf",
        ),
        (
            dict(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=1, staged_chunks=-1),
            "staged_chunks is -1",
        ),
        (
            dict(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=1, staged_chunks=True),
            "staged_chunks is True",
        ),
        (
            dict(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=1, staged_chunks=2),
            "staged_chunk_numel is 0",
        ),
        (
            dict(
                up_bytes_per_param=10,
                down_bytes_per_param=10,
                slot_bytes=1,
                staged_chunks=2,
                staged_chunk_numel=5,
                staged_bytes_per_param=10,
            ),
            "staged_bytes_per_param is 10",
        ),
    ],
)
def test_bad_streamed_costs_are_named(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        StreamedStepCosts(**kwargs)


def test_a_streamed_region_needs_costs() -> None:
    ctx = SimulationContext.build(three_layers(), flat_hardware())
    asg = [RegionAssignment(R, HOST), RegionAssignment(R, STREAMED), RegionAssignment(R, HOST)]
    with pytest.raises(ValueError, match=r"region 1 is streamed, but .* no StreamedStepCosts"):
        get_simulator("async").run(ctx, asg)
    with pytest.raises(ValueError, match="streamed must be None or a StreamedStepCosts"):
        SimulationContext.build(three_layers(), flat_hardware(), streamed=(10, 10, 5))  # type: ignore[arg-type]
    # Any parameter placement may be streamed.
    ctx = SimulationContext.build(three_layers(), flat_hardware(), streamed=W4_LIKE)
    asg = [
        RegionAssignment(A, STREAMED, 2),
        RegionAssignment(S, STREAMED),
        RegionAssignment(R, STREAMED),
    ]
    assert get_simulator("async").simulate(ctx, asg).steady_step_time_s > 0


def fast_plan() -> Plan:
    fast = flat_hardware(
        h2d_bytes_per_s=1e6,
        d2h_bytes_per_s=1e6,
        host_adam_params_per_s=250.0,
        device_adam_params_per_s=1e6,
    )
    return solve(
        layers(),
        fast,
        10**6,
        state_on_device=False,
        host_step_after_backward=True,
        block_search_range_bytes=0,
        streamed=W4_LIKE,
    )


def test_plans_with_streamed_regions_round_trip() -> None:
    plan = fast_plan()
    assert any(rp.state is STREAMED for rp in plan.regions)
    assert {iv.kind for iv in plan.timeline} >= {"stream_up", "stream_step", "stream_down"}
    text = plan.to_json()
    data = json.loads(text)
    assert "streamed" in {rp["state"] for rp in data["regions"]}
    assert data["streamed"] == {
        "up_bytes_per_param": 10,
        "down_bytes_per_param": 10,
        "slot_bytes": 500,
    }
    assert data["schema_version"] == 1
    again = Plan.from_json(text)
    assert again == plan and again.to_json() == text
    assert any(iv.stream is Stream.COMPUTE and iv.kind == "stream_step" for iv in again.timeline)
    # Without STREAMED regions the document has no "streamed" key.
    plain = dataclasses.replace(plan, streamed=None)
    assert "streamed" not in json.loads(plain.to_json())
    assert Plan.from_json(plain.to_json()) == plain
    # Written on the device: the key is there, and reads back.
    writing = dataclasses.replace(plan, streamed=W4_WRITING)
    assert json.loads(writing.to_json())["streamed"]["resident_down_bytes_per_param"] == 8
    assert Plan.from_json(writing.to_json()) == writing
    # Staged in the backward: its three keys are there, and read back.
    staged = dataclasses.replace(plan, streamed=W4_STAGED)
    assert json.loads(staged.to_json())["streamed"]["staged_chunks"] == 1
    assert Plan.from_json(staged.to_json()) == staged
    data["streamed"]["slot_bytes"] = 0
    with pytest.raises(ValueError, match="slot_bytes is 0"):
        Plan.from_json(json.dumps(data))
    data["streamed"] = {"up_bytes_per_param": 10}
    with pytest.raises(ValueError, match="streamed"):
        Plan.from_json(json.dumps(data))


def test_cli_streams_and_prints_streamed_regions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    profile = tmp_path / "profile.json"
    profile.write_text(layers().to_json())
    hardware = tmp_path / "hw.json"
    hardware.write_text(
        flat_hardware(
            h2d_bytes_per_s=1e6,
            d2h_bytes_per_s=1e6,
            host_adam_params_per_s=250.0,
            device_adam_params_per_s=1e6,
        ).to_json()
    )
    out = tmp_path / "plan.json"
    # 40 kB: room for one region's state on the device (16 kB), the others' on the host.
    base_args = [str(profile), "--budget", "40kB", "--hardware", str(hardware)]
    base_args += ["--block-search-range", "0", "--host-step-after-backward", "-o", str(out)]
    assert main(base_args) == 0
    plain = capsys.readouterr().out
    assert "streamed" not in plain
    assert main([*base_args, "--streamed", "10,10,500"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    assert lines[0].split() == ["region", "ops", "MiB", "placement", "state", "prefetch_at"]
    states = [line.split()[4] for line in lines[1:7]]
    assert "streamed" in states and set(states) <= {"host", "streamed", "device"}
    assert f"{states.count('streamed')} streamed;" in text
    assert Plan.from_json(out.read_text()).streamed == W4_LIKE
    assert main([*base_args, "--streamed", "10,10,500,8"]) == 0
    capsys.readouterr()
    assert Plan.from_json(out.read_text()).streamed == W4_WRITING
    assert main([*base_args, "--streamed", "10,10,500", "--streamed-staged", "1,100,8"]) == 0
    capsys.readouterr()
    assert Plan.from_json(out.read_text()).streamed == W4_STAGED
    for staged, message in (
        ("1,100", "CHUNKS,NUMEL,BYTES"),
        ("1.5,100,8", "CHUNKS,NUMEL,BYTES"),
        ("1,100,x", "CHUNKS,NUMEL,BYTES"),
        ("1,0,8", "staged_chunk_numel is 0"),
        ("1,100,10", "staged_bytes_per_param is 10"),
    ):
        assert main([*base_args, "--streamed", "10,10,500", "--streamed-staged", staged]) == 2
        assert message in capsys.readouterr().err
    assert main([*base_args, "--streamed-staged", "1,100,8"]) == 2
    assert "--streamed-staged needs --streamed" in capsys.readouterr().err
    for bad, message in (
        ("10,10", "UP,DOWN,SLOT"),
        ("10,10,500,8,1", "UP,DOWN,SLOT"),
        ("a,10,1MiB", "numbers"),
        ("10,10,500,b", "numbers"),
        ("10,10,0", "slot_bytes"),
        ("10,10,500,0", "resident_down_bytes_per_param is 0"),
    ):
        assert main([*base_args, "--streamed", bad]) == 2
        assert message in capsys.readouterr().err
