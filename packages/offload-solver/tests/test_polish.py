"""The local search a solve can end with ([Note: local search] in ``solvers._polish``)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
from hypothesis import strategies as st
from solver_helpers import assignments, chain, engine_cases, flat_hardware, solve_near

from offload_solver import (
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
from offload_solver.simulators._engine import steady_state
from offload_solver.solve import BUDGET_SAFETY_FACTOR, POLISH_ROUNDS, POLISH_SUGGESTED_ROUNDS
from offload_solver.solvers._polish import POLISH_MIN_GAIN, moves, polish
from offload_solver.solvers._search import Candidate, SolveStats

R, S, A = ParamPlacement.RESIDENT, ParamPlacement.SYNC, ParamPlacement.ASYNC
HOST, DEVICE, STREAMED = StatePlacement.HOST, StatePlacement.DEVICE, StatePlacement.STREAMED
COSTS = StreamedStepCosts(up_bytes_per_param=10, down_bytes_per_param=10, slot_bytes=500)


def period_and_peak(ctx: SimulationContext, asg: list[RegionAssignment]) -> tuple[float, int]:
    """The repeating step (s) and the peak the solver compares with its cap (bytes)."""
    run = get_simulator("async").run(ctx, asg)
    st_ = steady_state(ctx, asg, run)
    return st_.period_s, max(run.peak_bytes, st_.last.stream_peak_bytes)


@pytest.mark.parametrize(
    ("sizes", "h2d"),
    [([400, 400, 400, 400], 100.0), ([200, 400, 300, 500], 100.0), ([400] * 4, 1000.0)],
)
def test_from_all_sync_the_search_reaches_the_best_plan_of_its_moves(
    sizes: list[int], h2d: float
) -> None:
    # Small chains uploaded synchronously before each forward and backward, with room for
    # everything: the search ends at the shortest step of every plan its moves reach with
    # host state (each region resident, sync, or prefetched at the next region), found
    # here by trying them all. Not always all resident: a resident host-state region's
    # parameters go up after its host step, where an upload of region 0 before the next
    # forward can cost less.
    profile = chain(sizes, fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware(h2d_bytes_per_s=h2d, d2h_bytes_per_s=1e6)
    ctx = SimulationContext.build(profile, hardware, block_search_range_bytes=0)
    n = len(sizes)
    start = [RegionAssignment(S, HOST)] * n
    sim = get_simulator("async")
    cold = sim.run(ctx, start)
    steady = steady_state(ctx, start, cold)
    stats = SolveStats()
    first = Candidate(start, cold, steady)
    found = polish(ctx, sim, 1e9, stats, first, max_rounds=20)
    asg, cold2, steady2 = found.assignment, found.cold, found.steady

    def options(r: int) -> list[RegionAssignment]:
        out = [RegionAssignment(R, HOST), RegionAssignment(S, HOST)]
        return out + ([RegionAssignment(A, HOST, r + 1)] if r + 1 < n else [])

    best = min(
        period_and_peak(ctx, list(c))[0] for c in itertools.product(*(options(r) for r in range(n)))
    )
    assert steady2.period_s == pytest.approx(best, rel=1e-9)
    assert steady2.period_s < steady.period_s / 2
    assert all(a.state is HOST for a in asg)  # the search never adds device state
    assert (steady2.period_s, cold2.peak_bytes) == (
        period_and_peak(ctx, asg)[0],
        sim.run(ctx, asg).peak_bytes,
    )
    assert stats.num_simulations >= 2 * n  # every round simulates each region's moves

    # No rounds, no change; a bad round count is named.
    assert polish(ctx, sim, 1e9, SolveStats(), first, max_rounds=0) is first
    with pytest.raises(ValueError, match="max_rounds must be >= 0"):
        polish(ctx, sim, 1e9, SolveStats(), first, max_rounds=-1)


def test_the_cap_holds_the_search_back() -> None:
    # Four 400 B regions with a cap at the all-sync peak: making any region resident
    # adds its 400 B to the static bytes while the pool keeps its block, so none is.
    profile = chain([400, 400, 400, 400], fwd_flop=100, bwd_flop=200)
    hardware = flat_hardware(h2d_bytes_per_s=100.0, d2h_bytes_per_s=1e6)
    ctx = SimulationContext.build(profile, hardware, block_search_range_bytes=0)
    start = [RegionAssignment(S, HOST)] * 4
    sim = get_simulator("async")
    cold = sim.run(ctx, start)
    steady = steady_state(ctx, start, cold)
    asg = polish(ctx, sim, cold.peak_bytes, SolveStats(), Candidate(start, cold, steady)).assignment
    for r, a in enumerate(asg):
        assert a.placement is not R, f"region {r} made resident above the cap"
    assert period_and_peak(ctx, asg)[1] <= cold.peak_bytes


@engine_cases(max_examples=60, streamed=st.booleans())
def test_every_move_is_a_plan_the_simulator_takes(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: Any,
    after_backward: bool,
    streamed: bool,
) -> None:
    ctx = SimulationContext.build(
        profile,
        hardware,
        host_step_after_backward=after_backward,
        streamed=COSTS if streamed else None,
    )
    asg = data.draw(assignments(ctx.layout))
    for allow_async in (True, False):
        for r, change in moves(ctx, asg, allow_async=allow_async):
            trial = list(asg)
            trial[r] = change
            assert ctx.numel[r] > 0
            ctx.validate(trial, allow_async=True)  # raises on a bad move
            if not allow_async:  # no region newly prefetched
                assert change.placement is not A or asg[r].placement is A
            if change.state is DEVICE:
                pytest.fail("the search added device state")
            if change.state is STREAMED:
                assert streamed


@engine_cases(max_examples=40, streamed=st.booleans(), where=st.floats(0.0, 1.2))
def test_solved_plans_are_local_optima_no_slower_than_the_greedy_ones(
    data: st.DataObject,
    profile: ModelProfile,
    hardware: Any,
    after_backward: bool,
    streamed: bool,
    where: float,
) -> None:
    costs = COSTS if streamed else None
    ctx = SimulationContext.build(
        profile, hardware, host_step_after_backward=after_backward, streamed=costs
    )
    kwargs: dict[str, Any] = dict(host_step_after_backward=after_backward, streamed=costs)
    budget, greedy = solve_near(profile, hardware, where, polish_rounds=0, **kwargs)
    plan = solve(profile, hardware, budget, polish_rounds=50, **kwargs)
    cap = budget * BUDGET_SAFETY_FACTOR
    assert plan.predicted_peak_bytes <= cap
    assert plan.predicted_step_time_s <= greedy.predicted_step_time_s
    asg = [RegionAssignment(rp.placement, rp.state, rp.prefetch_at) for rp in plan.regions]
    period, _ = period_and_peak(ctx, asg)
    assert period == plan.predicted_step_time_s
    if all(a.placement is R and a.state is DEVICE for a in asg):
        return  # everything on the device: no search ran
    # No single change beats the plan by the search's margin within the cap.
    for r, change in moves(ctx, asg, allow_async=True):
        trial = list(asg)
        trial[r] = change
        p, pk = period_and_peak(ctx, trial)
        assert pk > cap or p >= period * (1 - POLISH_MIN_GAIN) - 1e-12, (r, change, p, period)


@pytest.mark.parametrize("rounds", [-1, 1.5, True])
def test_bad_polish_rounds_are_named(rounds: Any) -> None:
    with pytest.raises(ValueError, match="polish_rounds must be an int >= 0"):
        solve(chain([300, 400], 100, 200), flat_hardware(), 10**6, polish_rounds=rounds)


def test_cli_takes_the_round_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # By default (and with --polish-rounds 0) the CLI plans with the greedy phases alone;
    # with rounds the local search runs after them, simulating more for a plan no slower.
    # A negative count is named.
    profile = tmp_path / "profile.json"
    profile.write_text(chain([400, 400, 400, 400], fwd_flop=100, bwd_flop=200).to_json())
    hardware = tmp_path / "hw.json"
    hardware.write_text(flat_hardware(h2d_bytes_per_s=100.0, d2h_bytes_per_s=1e6).to_json())
    out = tmp_path / "plan.json"
    args = [str(profile), "--budget", "5.5kB", "--hardware", str(hardware), "-o", str(out)]
    args += ["--block-search-range", "0"]
    assert POLISH_ROUNDS == 0
    assert main([*args, "--polish-rounds", "0"]) == 0
    greedy = Plan.from_json(out.read_text())
    assert main(args) == 0
    default = Plan.from_json(out.read_text())
    assert default.regions == greedy.regions
    assert default.num_simulations == greedy.num_simulations
    assert main([*args, "--polish-rounds", str(POLISH_SUGGESTED_ROUNDS)]) == 0
    polished = Plan.from_json(out.read_text())
    assert polished.predicted_step_time_s < greedy.predicted_step_time_s
    assert polished.num_simulations > greedy.num_simulations
    capsys.readouterr()
    assert main([*args, "--polish-rounds", "-1"]) == 2
    assert "polish_rounds must be an int >= 0" in capsys.readouterr().err
