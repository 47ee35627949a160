"""Activation handling in plans: the simulator's pricing of RECOMPUTE and HOST regions
([Note: activations] in ``simulators._activations``) and the solver's choice of them
(``solve(..., activations=True)``, [Note: activation search] in ``solvers._activations``).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
from solver_helpers import flat_hardware

from offload_solver import (
    ActivationPlacement,
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    SimulationContext,
    StatePlacement,
    get_simulator,
    solve,
)
from offload_solver.simulators import RegionAssignment, SimulationResult
from offload_solver.solve import BUDGET_SAFETY_FACTOR, InfeasibleBudgetError, least_budget_bytes
from offload_solver.solvers._activations import least_peak
from offload_solver.solvers._search import SolveStats

KEEP, RECOMPUTE, HOST = (
    ActivationPlacement.KEEP,
    ActivationPlacement.RECOMPUTE,
    ActivationPlacement.HOST,
)
N = 8
SAVED, OUT = 100_000, 10_000


def act_chain(n: int = N) -> ModelProfile:
    """A chain as ``solver_helpers.chain`` builds one, whose activations dominate: per
    operation a 200-byte parameter, 100 kB saved for backward, a 10 kB output (the next
    region's boundary input), 1000 FLOP forward, 2000 backward."""
    params = tuple(Parameter(f"w{i}", 100, 200) for i in range(n))
    ops = tuple(
        Operation(
            f"op{i}",
            (f"w{i}",),
            fwd_out_bytes=OUT,
            saved_bytes=SAVED,
            fwd_flop=1000,
            bwd_flop=2000,
        )
        for i in range(n)
    )
    return ModelProfile("act_chain", params, ops, host_grad_bytes_per_param=0)


def slow_copies() -> HardwareProfile:
    """Copies of a region's activations (5 s) cost more than its forward (1 s)."""
    return flat_hardware(h2d_bytes_per_s=2e4, d2h_bytes_per_s=2e4, flop_per_s=1000.0)


def fast_copies() -> HardwareProfile:
    """Copies of a region's activations (0.1 s) hide under the compute."""
    return flat_hardware(h2d_bytes_per_s=1e6, d2h_bytes_per_s=1e6, flop_per_s=1000.0)


def _solve(hw: HardwareProfile, budget: int, **kwargs: object) -> Plan:
    return solve(act_chain(), hw, budget, block_search_range_bytes=0, **kwargs)  # type: ignore[arg-type]


def _least(hw: HardwareProfile, activations: bool) -> int:
    with pytest.raises(InfeasibleBudgetError) as e:
        _solve(hw, 1000, activations=activations)
    return e.value.least_budget_bytes


def _ctx(hw: HardwareProfile) -> SimulationContext:
    return SimulationContext.build(act_chain(), hw, block_search_range_bytes=0)


def _count(plan: Plan, mode: ActivationPlacement) -> int:
    return sum(r.activations is mode for r in plan.regions)


def test_bounds_order_and_the_error_names_the_all_recompute_budget() -> None:
    hw = slow_copies()
    keep, rec = _least(hw, False), _least(hw, True)
    assert rec < keep
    with pytest.raises(InfeasibleBudgetError) as e:
        _solve(hw, rec - 1, activations=True)
    ctx = _ctx(hw)
    every = ctx.with_activations([RECOMPUTE] * ctx.num_regions)
    peak = least_peak(every, get_simulator("async"), SolveStats())
    assert e.value.least_budget_bytes == rec == least_budget_bytes(peak)
    assert str(rec) in str(e.value) and "recomputed" in str(e.value)
    plan = _solve(hw, rec, activations=True)  # the least budget named works
    assert plan.predicted_peak_bytes <= rec * BUDGET_SAFETY_FACTOR


def test_a_budget_between_the_bounds_recomputes_some_regions() -> None:
    hw = slow_copies()
    keep, rec = _least(hw, False), _least(hw, True)
    budget = (keep + rec) // 2
    with pytest.raises(InfeasibleBudgetError):
        _solve(hw, budget)
    plan = _solve(hw, budget, activations=True)
    assert 0 < _count(plan, RECOMPUTE) + _count(plan, HOST) < N
    assert plan.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    # The plan's prediction is a simulation of its own choices.
    ctx = _ctx(hw).with_activations([r.activations for r in plan.regions])
    asg = [RegionAssignment(r.placement, r.state, r.prefetch_at) for r in plan.regions]
    sim = get_simulator("async").simulate(ctx, asg)
    assert sim.peak_bytes == plan.predicted_peak_bytes
    assert sim.steady_step_time_s == plan.predicted_step_time_s


def test_fewer_regions_recompute_as_the_budget_grows_and_beat_recomputing_all() -> None:
    hw = slow_copies()
    keep, rec = _least(hw, False), _least(hw, True)
    ctx = _ctx(hw)
    every = ctx.with_activations([RECOMPUTE] * ctx.num_regions)
    fastest = [RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.DEVICE)] * N
    all_recompute_s = get_simulator("async").simulate(every, fastest).steady_step_time_s
    counts = []
    for share in (0.25, 0.5, 0.75):
        plan = _solve(hw, int(rec + share * (keep - rec)), activations=True)
        counts.append(_count(plan, RECOMPUTE))
        assert _count(plan, HOST) == 0  # slow copies: recomputing is cheaper
        assert plan.predicted_step_time_s < all_recompute_s
    assert counts[0] > counts[1] > counts[2] > 0


def test_fast_copies_send_activations_to_the_host() -> None:
    hw = fast_copies()
    keep, rec = _least(hw, False), _least(hw, True)
    budget = (keep + rec) // 2
    plan = _solve(hw, budget, activations=True)
    assert _count(plan, HOST) > 0
    assert plan.predicted_peak_bytes <= budget * BUDGET_SAFETY_FACTOR
    kinds = {(iv.stream.value, iv.kind) for iv in plan.timeline}
    assert {("d2h", "act_offload"), ("h2d", "act_fetch")} <= kinds


def _simulate(
    hw: HardwareProfile, acts: list[ActivationPlacement], simulator: str = "async"
) -> SimulationResult:
    ctx = _ctx(hw).with_activations(acts)
    return get_simulator(simulator).simulate(ctx, [RegionAssignment()] * N)


@pytest.mark.parametrize("simulator", ["async", "sync"])
def test_a_recomputed_region_runs_its_forward_again_before_its_backward(simulator: str) -> None:
    hw = slow_copies()
    r = 3
    acts = [KEEP] * N
    acts[r] = RECOMPUTE
    keep, rec = _simulate(hw, [KEEP] * N, simulator), _simulate(hw, acts, simulator)
    on = [iv for iv in rec.timeline if iv.region == r and iv.stream.value == "compute"]
    by_kind = {iv.kind: iv for iv in on}
    again, fwd, bwd = by_kind["recompute"], by_kind["fwd"], by_kind["bwd"]
    assert again.end_s - again.start_s == pytest.approx(fwd.end_s - fwd.start_s)
    assert again.end_s == pytest.approx(bwd.start_s)
    assert not any(iv.kind == "recompute" for iv in keep.timeline)
    assert rec.step_time_s == pytest.approx(keep.step_time_s + (fwd.end_s - fwd.start_s))
    # Between its forward and backward it holds its boundary input, not its saved bytes.
    assert keep.peak_bytes - rec.peak_bytes == SAVED - OUT


def test_a_host_region_copies_its_saved_bytes_down_and_back() -> None:
    hw = fast_copies()  # the copy down ends before the backward starts
    r = 2
    acts = [KEEP] * N
    acts[r] = HOST
    res = _simulate(hw, acts)
    mine = {iv.kind: iv for iv in res.timeline if iv.region == r}
    down, back = mine["act_offload"], mine["act_fetch"]
    assert down.stream.value == "d2h" and back.stream.value == "h2d"
    assert down.start_s == pytest.approx(mine["fwd"].end_s)
    assert down.end_s - down.start_s == pytest.approx(SAVED / 1e6)
    assert back.end_s - back.start_s == pytest.approx(SAVED / 1e6)
    assert back.end_s <= mine["bwd"].start_s
    # Issued at the next region's backward start, or its copy down's end.
    nxt = next(iv for iv in res.timeline if iv.region == r + 1 and iv.kind == "bwd")
    assert back.start_s == pytest.approx(max(nxt.start_s, down.end_s))
    keep = _simulate(hw, [KEEP] * N)
    assert res.peak_bytes == keep.peak_bytes - SAVED
    # The saved bytes are off the device from the copy down's end to the copy back's start.
    gap = [m.bytes for m in res.memory_curve if down.end_s < m.time_s < back.start_s]
    on_keep = [m.bytes for m in keep.memory_curve if down.end_s < m.time_s < back.start_s]
    assert gap and max(gap) <= max(on_keep) - SAVED


def test_budgets_that_fit_with_activations_kept_give_the_same_plan() -> None:
    hw = slow_copies()
    keep = _least(hw, False)
    for budget in (keep, 2 * keep):
        a = json.loads(_solve(hw, budget).to_json())
        b = json.loads(_solve(hw, budget, activations=True).to_json())
        for doc in (a, b):
            doc.pop("solve_time_s")
        assert a == b


def test_plans_are_deterministic_and_read_back() -> None:
    hw = fast_copies()
    keep, rec = _least(hw, False), _least(hw, True)
    budget = (keep + 2 * rec) // 3
    docs = [json.loads(_solve(hw, budget, activations=True).to_json()) for _ in range(2)]
    for doc in docs:
        doc.pop("solve_time_s")
    assert docs[0] == docs[1]
    plan = _solve(hw, budget, activations=True)
    again = Plan.from_json(plan.to_json())
    assert [r.activations for r in again.regions] == [r.activations for r in plan.regions]
    assert any(r.activations is not KEEP for r in again.regions)


def test_the_command_line_option(
    tmp_path: pytest.TempPathFactory, capsys: pytest.CaptureFixture[str]
) -> None:
    from offload_solver.cli import main

    path = tmp_path / "profile.json"  # type: ignore[operator]
    path.write_text(act_chain().to_json())
    args = [str(path), "--budget", "500000", "--block-search-range", "0"]
    assert main(args) == 2  # activations kept: too small
    assert main([*args, "--activations"]) == 0
    assert "activations recompute" in capsys.readouterr().out


@pytest.mark.parametrize("in_use", [0, 5 * 2**20])
def test_the_least_budget_named_works_on_the_gpt_like_profile(in_use: int) -> None:
    from pathlib import Path

    from offload_solver import default_hardware

    text = (Path(__file__).parent / "data" / "gpt_like.profile.json").read_text()
    profile, hw = ModelProfile.from_json(text), default_hardware()
    kwargs = {"device_bytes_in_use": in_use, "activations": True}
    with pytest.raises(InfeasibleBudgetError) as kept:
        solve(profile, hw, 2**20, device_bytes_in_use=in_use)
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(profile, hw, 2**20, **kwargs)  # type: ignore[arg-type]
    least = e.value.least_budget_bytes
    assert least <= kept.value.least_budget_bytes
    plan = solve(profile, hw, least, **kwargs)  # type: ignore[arg-type]
    assert plan.predicted_peak_bytes <= least * BUDGET_SAFETY_FACTOR


def test_a_region_that_writes_into_its_inputs_is_never_recomputed() -> None:
    """An operation that writes in place (``Operation.mutates``) rules out RECOMPUTE for
    its region, at every budget: at the least one named its activations go to the host."""
    base = act_chain()
    ops = tuple(
        dataclasses.replace(op, mutates=i in (2, 5)) for i, op in enumerate(base.operations)
    )
    profile = dataclasses.replace(base, operations=ops)
    hw = slow_copies()
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(profile, hw, 1000, block_search_range_bytes=0, activations=True)
    least = e.value.least_budget_bytes
    for budget in (least, (least + _least(hw, False)) // 2):
        plan = solve(profile, hw, budget, block_search_range_bytes=0, activations=True)
        for rp in plan.regions:
            mutating = any(op.mutates for op in ops[rp.region.op_start : rp.region.op_end])
            if mutating:
                assert rp.activations is not RECOMPUTE, rp.region.index
        assert any(rp.activations is not KEEP for rp in plan.regions)
    assert ModelProfile.from_json(profile.to_json()) == profile


def test_a_recomputed_region_holds_every_storage_it_reads_once() -> None:
    """With ``Operation.reads``, a RECOMPUTE region holds each storage made before it that
    its operations read (not only the previous operation's output), and a storage an
    earlier RECOMPUTE region holds already is not counted twice."""
    from offload_solver.plan import Region
    from offload_solver.simulators._activations import boundary_bytes

    ops = (
        Operation("a", fwd_out_bytes=307, out_storage_bytes=(300, 7), saved_bytes=50),
        Operation("b", fwd_out_bytes=40, out_storage_bytes=(40,), reads=(0,), saved_bytes=50),
        Operation("c", reads=(0, 2), saved_bytes=50),  # a view: makes nothing
        Operation("d", fwd_out_bytes=5, out_storage_bytes=(5,), reads=(1, 0), saved_bytes=50),
    )  # storages: 0 and 1 made by a, 2 by b, 3 by d
    regions = [Region(i, i, i + 1, (), 0, 0) for i in range(4)]
    # Alone, each region holds what it reads from before it, however small the output of
    # the operation just before it (what a profile without reads counts).
    assert boundary_bytes(ops, regions) == [0, 300, 340, 307]
    # Region 1 recomputed holds storage 0: regions 2 and 3 add only what it does not.
    both = [KEEP, RECOMPUTE, RECOMPUTE, RECOMPUTE]
    assert boundary_bytes(ops, regions, both) == [0, 300, 40, 7]
    # A profile without reads keeps the approximation: the edge, at most the saved bytes.
    bare = tuple(dataclasses.replace(op, reads=()) for op in ops)
    assert boundary_bytes(bare, regions) == [0, 50, 40, 0]


WITH_PREVIOUS = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
RES = 60_000


def residual_chain(n: int = N) -> ModelProfile:
    """``act_chain`` whose operations also make a 60 kB residual storage and read both
    storages of the operation before: a region recomputed alone holds 70 kB, a run of
    regions holds 70 kB in all."""
    base = act_chain(n)
    ops = tuple(
        dataclasses.replace(
            op,
            fwd_out_bytes=OUT + RES,
            out_storage_bytes=(OUT, RES),
            reads=(2 * i - 2, 2 * i - 1) if i else (),
        )
        for i, op in enumerate(base.operations)
    )
    return dataclasses.replace(base, operations=ops)


def test_a_run_holds_what_it_reads_from_before_its_first_region() -> None:
    from offload_solver.plan import Region
    from offload_solver.simulators._activations import activation_levels, boundary_bytes

    ops = residual_chain(4).operations
    regions = [Region(i, i, i + 1, (), 0, 0) for i in range(4)]
    single = [KEEP, RECOMPUTE, RECOMPUTE, RECOMPUTE]
    run = [KEEP, RECOMPUTE, WITH_PREVIOUS, WITH_PREVIOUS]
    assert boundary_bytes(ops, regions, single) == [0, OUT + RES, OUT + RES, OUT + RES]
    assert boundary_bytes(ops, regions, run) == [0, OUT + RES, 0, 0]
    levels = activation_levels(ops, regions, flat_hardware(), run)
    # One recomputation, of regions 1 to 3, before region 3's backward.
    assert levels.recompute == [False, False, False, True]
    assert levels.recompute_from == [-1, -1, -1, 1]
    # The forward holds region 0's saved bytes and the run's input; each backward of the
    # run also sees the saved bytes its recomputation re-created for the earlier regions.
    assert levels.saved_prefix[1:4] == [SAVED, SAVED + OUT + RES, SAVED + OUT + RES]
    assert levels.saved_prefix_bwd[1:4] == [SAVED, 2 * SAVED, 3 * SAVED]


def test_a_run_is_recomputed_once_before_its_last_regions_backward() -> None:
    hw = slow_copies()
    ctx = SimulationContext.build(residual_chain(), hw, block_search_range_bytes=0)
    acts = [KEEP] * N
    acts[2:5] = [RECOMPUTE, WITH_PREVIOUS, WITH_PREVIOUS]
    result = get_simulator("async").simulate(ctx.with_activations(acts), [RegionAssignment()] * N)
    again = [iv for iv in result.timeline if iv.kind == "recompute"]
    assert [iv.region for iv in again] == [4]
    fwd = {iv.region: iv for iv in result.timeline if iv.kind == "fwd"}
    bwd = {iv.region: iv for iv in result.timeline if iv.kind == "bwd"}
    seconds = sum(fwd[r].end_s - fwd[r].start_s for r in (2, 3, 4))
    assert again[0].end_s - again[0].start_s == pytest.approx(seconds)
    assert again[0].end_s == pytest.approx(bwd[4].start_s)
    # Its regions but the last must stay resident.
    assert ctx.with_activations(acts).pinned[2:5] == [True, True, False]


def test_runs_lower_the_least_budget_and_it_works() -> None:
    hw = slow_copies()
    profile = residual_chain()
    ctx = SimulationContext.build(profile, hw, block_search_range_bytes=0)
    singles = least_budget_bytes(
        least_peak(ctx.with_activations([RECOMPUTE] * N), get_simulator("async"), SolveStats())
    )
    with pytest.raises(InfeasibleBudgetError) as e:
        solve(profile, hw, 1000, block_search_range_bytes=0, activations=True)
    least = e.value.least_budget_bytes
    assert least < singles
    plan = solve(profile, hw, least, block_search_range_bytes=0, activations=True)
    assert plan.predicted_peak_bytes <= least * BUDGET_SAFETY_FACTOR
    assert _count(plan, WITH_PREVIOUS) > 0
    for before, after in zip(plan.regions, plan.regions[1:], strict=False):
        if after.activations is WITH_PREVIOUS:
            assert before.activations in (RECOMPUTE, WITH_PREVIOUS)
            assert before.placement is ParamPlacement.RESIDENT
    assert Plan.from_json(plan.to_json()) == plan


def test_a_region_a_run_is_recomputed_through_may_not_be_offloaded() -> None:
    ctx = SimulationContext.build(residual_chain(), slow_copies(), block_search_range_bytes=0)
    acts = [KEEP] * N
    acts[2:4] = [RECOMPUTE, WITH_PREVIOUS]
    assignment = [RegionAssignment()] * N
    assignment[2] = RegionAssignment(ParamPlacement.SYNC)
    with pytest.raises(ValueError, match=r"region 2 is pinned \(a later region of its recomputed"):
        ctx.with_activations(acts).validate(assignment, allow_async=True)
    ctx.validate(assignment, allow_async=True)  # alone, it may be
