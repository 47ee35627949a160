"""``solve``: from a model profile, a machine and a budget to a plan.

The steps, shared by every solver strategy:

1. If every region resident with its optimizer state on the device fits, that is the
   plan: nothing moves and nothing waits for the host.
2. Otherwise start from every region resident with optimizer state on the host and let
   the strategy (``syn``, ``asyn``) offload regions until the simulated peak fits.
3. Where the budget leaves room, move resident regions' optimizer state back to the
   device, the one saving most step time first (``GreedySearch.place_optimizer_state``);
   then, while it shortens the simulated step, offload more parameters to make room for
   the next region's state (``GreedySearch.make_room_for_state``): state costs 8x the
   parameters' bytes, and when the host optimizer is the step's tail, uploads are cheaper.
   Then, with ``late_host_work`` (default), move host-state regions' placements to later
   resident device-state regions while the repeating step gets shorter ([Note: host work
   late] in ``solvers._late``): a late region's host step has the most time to run. Step
   5 then runs on both plans and keeps the shorter.
4. If the strategy cannot fit the budget, fall back to the floor plan: every non-pinned
   region uploaded synchronously and all optimizer state on the host (one pool block,
   the fewest resident bytes). If even that does not fit, raise
   :class:`InfeasibleBudgetError` naming the least budget at which step 4 succeeds, so
   solving again with it always succeeds.
   With ``activations=True``, where this fails with every region's activations kept,
   the search runs again with some regions' activations recomputed or sent to the
   host ([Note: activation search] in ``solvers._activations``), and the least budget
   named is that of every region recomputed.
5. With ``streamed`` costs, step some host-state regions on the device instead where
   that shortens the repeating step within the budget ([Note: streamed search] in
   ``solvers._streamed``).

All planning is against ``budget * BUDGET_SAFETY_FACTOR``, less ``device_bytes_in_use``
(measured bytes that stay allocated beside the plan's, charged whole).
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable

from offload_solver.cost_model import CostModel
from offload_solver.hardware import HardwareProfile
from offload_solver.plan import (
    MemorySample,
    ParamPlacement,
    Plan,
    PlanOptions,
    RegionPlan,
    StatePlacement,
    StreamedStepCosts,
)
from offload_solver.profile import ModelProfile
from offload_solver.regions import BLOCK_SEARCH_RANGE_BYTES, BLOCK_SEARCH_STEP_BYTES
from offload_solver.simulators import RegionAssignment, SimulationContext, get_simulator
from offload_solver.simulators._engine import steady_state, to_result
from offload_solver.simulators.base import Simulator
from offload_solver.solvers import get_solver
from offload_solver.solvers._activations import least_recompute, place_activations
from offload_solver.solvers._late import move_host_work_late
from offload_solver.solvers._search import Candidate, GreedySearch, SolveStats
from offload_solver.solvers._streamed import place_streamed
from offload_solver.solvers.base import Solver

BUDGET_SAFETY_FACTOR = 0.95
"""Solvers plan against this fraction of the budget: the simulator's estimates of memory
(allocator rounding, fragmentation, workspaces) are not exact."""

GiB = 2**30


class InfeasibleBudgetError(ValueError):
    """No plan fits the budget; ``least_budget_bytes`` is the least budget that does.
    ``activations``: the search chose activation handling too, and the least budget is
    that of every region's activations recomputed."""

    def __init__(
        self,
        budget_bytes: int,
        least_budget_bytes: int,
        floor_peak_bytes: int,
        *,
        activations: bool = False,
    ):
        self.budget_bytes = budget_bytes
        self.least_budget_bytes = least_budget_bytes
        self.floor_peak_bytes = floor_peak_bytes
        self.activations = activations
        recomputed = " and every region's activations recomputed" if activations else ""
        super().__init__(
            f"memory budget {budget_bytes} bytes ({budget_bytes / GiB:.3f} GiB) is too small: "
            f"the least budget that works is {least_budget_bytes} bytes "
            f"({least_budget_bytes / GiB:.3f} GiB). Even with every non-pinned region "
            f"offloaded{recomputed} and all optimizer state on the host the predicted peak "
            f"is {floor_peak_bytes} bytes, and plans must fit {BUDGET_SAFETY_FACTOR} of the "
            "budget"
        )


def least_budget_bytes(peak_bytes: int) -> int:
    """The smallest integer budget whose planning share holds ``peak_bytes``."""
    budget = max(1, math.ceil(peak_bytes / BUDGET_SAFETY_FACTOR))
    while budget * BUDGET_SAFETY_FACTOR < peak_bytes:
        budget += 1
    while budget > 1 and (budget - 1) * BUDGET_SAFETY_FACTOR >= peak_bytes:
        budget -= 1
    return budget


def _check_budget(budget_bytes: object) -> int:
    if (
        isinstance(budget_bytes, bool)
        or not isinstance(budget_bytes, (int, float))
        or not math.isfinite(budget_bytes)
        or budget_bytes <= 0
    ):
        raise ValueError(
            f"budget_bytes is {budget_bytes!r}; it must be a positive number of bytes, "
            "e.g. 16 * 2**30 for 16 GiB"
        )
    return int(budget_bytes)


def solve(
    profile: ModelProfile,
    hardware: HardwareProfile,
    budget_bytes: int,
    solver: str = "asyn",
    *,
    block_search_step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
    block_search_range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
    host_step_after_backward: bool = False,
    state_on_device: bool = True,
    speculative_step_cost: float = 1.0,
    speculative_params: int | None = None,
    speculation_thread: bool = False,
    device_bytes_in_use: int = 0,
    micro_batches: int = 1,
    streamed: StreamedStepCosts | None = None,
    late_host_work: bool = True,
    cost_model: CostModel | None = None,
    activations: bool = False,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """Plan which regions to offload, how to bring them back and where optimizer state lives.

    ``block_search_*`` bound the pool block-size search (see ``offload_solver.regions``).
    The defaults are the reference's; they merge a model smaller than the range into one
    offloadable region, which is pointless to offload. For such (test-sized) models a
    range of 0 keeps regions at parameter boundaries, merging only what fits the largest.

    ``host_step_after_backward``: no host step may start before backward ends (fp16: the
    overflow answer, which the runtime computes on the device); regions whose gradients
    land after that step as they land, then the others in forward order. Otherwise each
    region steps as its gradients land, while they are still landing (see [Note: step
    model] in ``simulators._engine``). The plan's ``predicted_step_time_s`` is the period
    of the repeating step, whose host steps run under the next forward ([Note: steady
    state] in ``simulators._steady``); its timeline is one step on an idle machine.
    ``state_on_device=False`` keeps every region's optimizer state on the host (the
    reference's behaviour, for ablations).
    ``speculative_step_cost`` (>= 1): how much longer a host step taken in a gradient hook
    before backward ends takes than a plain one. 1 (default) when such steps are exact
    (bf16, fp32 training); an fp16 optimizer that speculates and keeps undo data pays more
    (a hardware profile's speculative step rate over its plain one,
    ``HardwareProfile.host_step_params_per_s``, timed alone: the simulator also runs
    such steps at the host's contended rate, since copies stream both ways under
    backward). Only used without ``host_step_after_backward``.
    ``speculative_params``: without ``host_step_after_backward``, how many trainable host-state
    parameters may step in their gradient hooks (None, the default: all). An fp16
    optimizer that speculates needs undo buffers for them (12 bytes each with fp32
    moments); when host memory holds fewer, the regions whose gradients land first take
    them, up to the first that does not fit, and the rest step after the last hook.
    ``offload_optim``'s optimizer follows the same rule (``PlanOptions.speculative_params``).
    ``speculation_thread``: without ``host_step_after_backward``, the steps taken in
    gradient hooks run on a thread of their own, so that ``step()`` does not wait for the
    one in flight when backward ends (``offload_runtime``'s planner sets it for fp16
    speculation: ``PlanOptions.speculation_thread``). False (default): the hooks run them.
    ``device_bytes_in_use``: device bytes allocated outside the plan for the whole step,
    as a runtime measures them before training (libraries' workspaces, the inputs, the
    caller's tensors). They are exact, so they come off the planning share of the budget
    whole (not scaled by the safety factor), and the plan's predicted peak and memory
    curve include them, as a measured peak does.
    ``micro_batches``: forward and backward passes per optimizer step (gradient
    accumulation). The predicted step time is then per optimizer step, all micro-batches
    included (see [Note: micro-batches] in ``simulators._engine``), and the solver weighs
    the parameters' uploads, paid in every micro-batch, against the host step, paid once.
    ``streamed``: what the runtime moves per parameter and holds on the device to step a
    host-state region on the device (:class:`StreamedStepCosts`). Given, once the plan
    above is chosen, regions whose host step does not run speculatively may become
    ``StatePlacement.STREAMED`` where the simulated repeating step gets shorter and the
    peak, the ring of buffers included, still fits ([Note: streamed search] in
    ``solvers._streamed``; [Note: streamed steps] in ``simulators._engine``). The plan
    then records the costs (``Plan.streamed``). ``None`` (default): no region is
    STREAMED.
    ``late_host_work``: after the greedy phases, move host-state regions' placements to
    later resident device-state regions while that shortens the repeating step (step 3;
    [Note: host work late] in ``solvers._late``). True (default); False keeps the greedy
    phases' placements.
    ``cost_model``: the simulator's fitted factors (:class:`CostModel`); None (default):
    ``CostModel()``, the fitted defaults. The plan records them (``Plan.cost_model``), and
    the arguments above that a runtime executes (``Plan.options``: :class:`PlanOptions`,
    whose other fields a runtime's planner fills).
    ``activations``: where no plan fits with every region's activations kept on the
    device, also choose which regions recompute their activations before their backward
    or send them to the host and back (``RegionPlan.activations``; [Note: activation
    search] in ``solvers._activations``, priced as [Note: activations] in
    ``simulators._activations``); an infeasible budget then names the least budget with
    every region recomputed. False (default): every region keeps its activations. A
    budget that fits with them all kept gets the same plan either way.
    ``progress``: called with a line of text as each phase ends (the greedy placement,
    host work moved late, streamed regions), with its seconds and simulations so far;
    None (default): nothing is reported.

    Raises:
        ValueError: a non-positive budget or an unknown solver name.
        InfeasibleBudgetError: no plan fits; the error carries ``least_budget_bytes``.
    """
    t0 = time.perf_counter()
    budget = _check_budget(budget_bytes)
    if isinstance(device_bytes_in_use, bool) or not isinstance(device_bytes_in_use, int):
        raise ValueError(f"device_bytes_in_use must be an int, got {device_bytes_in_use!r}")
    if device_bytes_in_use < 0:
        raise ValueError(f"device_bytes_in_use must be >= 0 bytes, got {device_bytes_in_use}")
    in_use = device_bytes_in_use
    strategy = get_solver(solver)
    simulator = get_simulator(strategy.simulator)
    ctx = SimulationContext.build(
        profile,
        hardware,
        block_search_step_bytes=block_search_step_bytes,
        block_search_range_bytes=block_search_range_bytes,
        host_step_after_backward=host_step_after_backward,
        speculative_step_cost=speculative_step_cost,
        speculative_params=speculative_params,
        speculation_thread=speculation_thread,
        micro_batches=micro_batches,
        streamed=streamed,
        cost_model=cost_model,
    )
    cap = budget * BUDGET_SAFETY_FACTOR - in_use
    stats = SolveStats()
    report = _reporter(progress, stats, ctx.num_regions)

    def greedy(c: SimulationContext) -> tuple[Candidate, bool]:
        return _greedy_plan(
            c,
            strategy,
            simulator,
            cap,
            stats,
            state_on_device=state_on_device,
            budget=budget,
            in_use=in_use,
        )

    try:
        found, all_device = greedy(ctx)
    except InfeasibleBudgetError:
        if not activations:
            raise
        chosen = place_activations(ctx, simulator, cap, stats, greedy)
        if chosen is None:
            peak = least_recompute(ctx, simulator, stats)[1] + in_use
            raise InfeasibleBudgetError(
                budget, least_budget_bytes(peak), peak, activations=True
            ) from None
        ctx, found, all_device = chosen
        report("activations placed", found)
    report("greedy placement", found)
    if streamed is not None or not all_device:
        options = [found]
        if late_host_work and state_on_device and not all_device:
            moved = move_host_work_late(ctx, simulator, cap, stats, found)
            report("host work moved late", moved)
            if moved is not found:
                options.append(moved)
        if streamed is not None:
            options = [place_streamed(ctx, simulator, cap, stats, c) for c in options]
            report("streamed regions placed", min(options, key=lambda c: c.period_s))
        # The moved plan only where it is still the shorter once regions are streamed
        # (it can leave the streamed search less to gain); the greedy one on a tie.
        found = min(options, key=lambda c: c.period_s)
    plan = _plan_of(ctx, found, strategy.name, budget, in_use, streamed)
    given = PlanOptions(
        host_step_after_backward=host_step_after_backward,
        speculative_params=speculative_params,
        speculative_step_cost=speculative_step_cost,
        speculation_thread=speculation_thread,
        state_on_device=state_on_device,
        late_host_work=late_host_work,
        micro_batches=micro_batches,
    )
    return dataclasses.replace(
        plan,
        options=given,
        model_name=profile.name,
        hardware_name=hardware.name,
        solve_time_s=time.perf_counter() - t0,
        num_simulations=stats.num_simulations,
    )


def _reporter(
    progress: Callable[[str], None] | None, stats: SolveStats, num_regions: int
) -> Callable[[str, Candidate], None]:
    """A function that reports a phase's end to ``progress`` (nothing where it is None):
    the phase, its plan's repeating step, the seconds since this was made and the
    simulations counted so far."""
    t0 = time.perf_counter()

    def report(phase: str, found: Candidate) -> None:
        if progress is not None:
            progress(
                f"solver: {phase} ({num_regions} regions): step "
                f"{found.period_s * 1e3:.1f} ms, {time.perf_counter() - t0:.1f} s, "
                f"{stats.num_simulations} simulations"
            )

    return report


def _greedy_plan(
    ctx: SimulationContext,
    strategy: Solver,
    simulator: Simulator,
    cap: float,
    stats: SolveStats,
    *,
    state_on_device: bool,
    budget: int,
    in_use: int,
) -> tuple[Candidate, bool]:
    """Steps 1 to 4 of the module docstring, before host work moves late: the plan, and
    whether it keeps every region and its state on the device (step 1)."""
    n_reg = ctx.num_regions
    on_device = [RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.DEVICE)] * n_reg
    stats.num_simulations += 1
    first = simulator.run(ctx, on_device)
    if state_on_device and first.peak_bytes <= cap:
        return Candidate(list(on_device), first, steady_state(ctx, on_device, first)), True
    start = [RegionAssignment()] * n_reg
    search = GreedySearch(ctx, simulator, cap, stats, start)
    all_resident_peak = search.peak_bytes
    if not strategy.offload(search):
        floor = [
            RegionAssignment(ParamPlacement.SYNC)
            if not ctx.pinned[r] and ctx.size[r] > 0
            else RegionAssignment()
            for r in range(n_reg)
        ]
        floor_run = search.simulate(floor)
        if floor_run.peak_bytes > cap:
            floor_peak = min(floor_run.peak_bytes, all_resident_peak) + in_use
            raise InfeasibleBudgetError(budget, least_budget_bytes(floor_peak), floor_peak)
        search.reset(floor, floor_run)
    if state_on_device:
        search.place_optimizer_state()
        search.make_room_for_state(strategy.offload)
    return Candidate(list(search.assignment), search.current, search.steady()), False


def _plan_of(
    ctx: SimulationContext,
    found: Candidate,
    solver: str,
    budget: int,
    in_use: int,
    streamed: StreamedStepCosts | None,
) -> Plan:
    """The plan of ``found``: the cold step's timeline and memory curves, the repeating
    step's period (see [Note: steady state] in ``simulators._steady``), and ``in_use``
    device bytes on top of the simulated ones."""
    chosen, steady = found.assignment, found.steady
    detail = to_result(ctx, found.cold, steady.period_s, steady.last.stream_peak_bytes)
    any_streamed = any(a.state is StatePlacement.STREAMED for a in chosen)
    regions = tuple(
        RegionPlan(
            region=ctx.regions[r],
            placement=a.placement,
            state=a.state,
            prefetch_at=a.prefetch_at,
            pool_offset_bytes=(None if b is None else b * ctx.block_size_bytes),
            activations=ctx.activations[r],
        )
        for r, (a, b) in enumerate(zip(chosen, detail.pool_blocks, strict=True))
    )
    return Plan(
        solver=solver,
        budget_bytes=budget,
        regions=regions,
        predicted_peak_bytes=detail.peak_bytes + in_use,
        predicted_step_time_s=detail.steady_step_time_s,
        timeline=detail.timeline,
        memory_curve=tuple(MemorySample(m.time_s, m.bytes + in_use) for m in detail.memory_curve),
        pool_size_bytes=detail.pool_size_bytes,
        device_bytes_in_use=in_use,
        streamed=streamed if any_streamed else None,
        cost_model=ctx.cost_model,
    )


__all__ = [
    "BUDGET_SAFETY_FACTOR",
    "InfeasibleBudgetError",
    "least_budget_bytes",
    "solve",
]
