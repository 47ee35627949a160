"""Which regions' activations to recompute or send to the host, when keeping them all
does not fit the budget ([Note: activation search]).

[Note: activation search]
With ``solve(..., activations=True)``, a budget that no plan with every region's
activations KEEP fits (step 4 of ``offload_solver.solve`` fails) is searched again over
activation handling too ([Note: activations] in ``simulators._activations``):

1. Price each region's two alternatives alone against the start of the greedy search
   (every region resident, state on the host): the bytes it frees between forward and
   backward (RECOMPUTE: its saved bytes less its boundary input; HOST: all of them) per
   second its simulated single step gets longer (a change that costs nothing ranks
   first, the one freeing more bytes first among those).
2. Three orders of regions: each region with the better of its two alternatives (the
   higher ratio, RECOMPUTE on a tie), RECOMPUTE alone, HOST alone; each sorted by that
   ratio, then bytes, then region index, so the search is deterministic.
3. For each order, the fewest leading regions whose change lets the floor of the plan
   search fit (``least_peak``: the lower of the peaks with every region resident and
   with every non-pinned region uploaded synchronously, state on the host), found by
   bisection (fitting is taken as monotone in the prefix), then the full placement search
   (``greedy``: steps 1 to 4 of ``solve``) with that prefix and with one region more,
   which leaves the placement search more room.
4. The plan with the shortest repeating step wins (the earlier on a tie). Where none
   fits, every region RECOMPUTE is tried last, so that the least budget ``solve`` names
   for it always works.

A region with an operation that writes in place into an input (``Operation.mutates``:
Mixture-of-Experts scatters, for one) is never RECOMPUTE: its second run could read what
the first changed. It may be HOST, and "every region RECOMPUTE" sends its activations to
the host instead.

When no order fits, neither does every region RECOMPUTE, and ``solve`` reports the least
budget of that choice (``least_peak`` of it).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from offload_solver.plan import ActivationPlacement, ParamPlacement
from offload_solver.simulators._engine import RegionAssignment, SimulationContext
from offload_solver.simulators.base import Simulator
from offload_solver.solvers._search import Candidate, SolveStats

KEEP, RECOMPUTE, HOST = (
    ActivationPlacement.KEEP,
    ActivationPlacement.RECOMPUTE,
    ActivationPlacement.HOST,
)
_EPS_S = 1e-12


def least_peak(ctx: SimulationContext, simulator: Simulator, stats: SolveStats) -> int:
    """The least simulated peak the placement search can reach with ``ctx``'s activation
    handling: the lower of every region resident and every non-pinned region uploaded
    synchronously, all optimizer state on the host (step 4 of ``solve``)."""
    n = ctx.num_regions
    floor = [
        RegionAssignment(ParamPlacement.SYNC)
        if not ctx.pinned[r] and ctx.size[r] > 0
        else RegionAssignment()
        for r in range(n)
    ]
    stats.num_simulations += 2
    resident = simulator.run(ctx, [RegionAssignment()] * n).peak_bytes
    return min(resident, simulator.run(ctx, floor).peak_bytes)


def recomputable(ctx: SimulationContext) -> list[bool]:
    """Per region, whether its activations may be recomputed: none of its operations
    writes in place into an input (``Operation.mutates``)."""
    ops = ctx.profile.operations
    return [
        not any(op.mutates for op in ops[ctx.op_start[r] : ctx.op_end[r]])
        for r in range(ctx.num_regions)
    ]


def all_recompute(ctx: SimulationContext) -> SimulationContext:
    """``ctx`` with every region's activations recomputed, or sent to the host where a
    region may not be recomputed (:func:`recomputable`)."""
    return ctx.with_activations([RECOMPUTE if ok else HOST for ok in recomputable(ctx)])


def _orders(
    ctx: SimulationContext, simulator: Simulator, stats: SolveStats
) -> list[list[tuple[int, ActivationPlacement]]]:
    """Steps 1 and 2 of the note: the three orders of (region, handling)."""
    n = ctx.num_regions
    start = [RegionAssignment()] * n
    stats.num_simulations += 1
    base_s = simulator.run(ctx, start).step_time_s
    act = ctx.act
    may_recompute = recomputable(ctx)
    scored: dict[ActivationPlacement, list[tuple[float, int, int]]] = {RECOMPUTE: [], HOST: []}
    for r in range(n):
        for mode, freed in (
            (RECOMPUTE, act.saved_bytes[r] - act.boundary_bytes[r]),
            (HOST, act.saved_bytes[r]),
        ):
            if freed <= 0 or (mode is RECOMPUTE and not may_recompute[r]):
                continue
            acts = [KEEP] * n
            acts[r] = mode
            stats.num_simulations += 1
            extra = simulator.run(ctx.with_activations(acts), start).step_time_s - base_s
            ratio = freed / extra if extra > _EPS_S else math.inf
            scored[mode].append((ratio, freed, r))
    best: dict[int, tuple[float, int, ActivationPlacement]] = {}
    for mode in (RECOMPUTE, HOST):
        for ratio, freed, r in scored[mode]:
            if r not in best or (ratio, freed) > best[r][:2]:
                best[r] = (ratio, freed, mode)
    mixed = sorted(best.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
    orders = [[(r, v[2]) for r, v in mixed]]
    for mode in (RECOMPUTE, HOST):
        ranked = sorted(scored[mode], key=lambda x: (-x[0], -x[1], x[2]))
        orders.append([(r, mode) for _, _, r in ranked])
    return orders


def _with_prefix(
    ctx: SimulationContext, order: Sequence[tuple[int, ActivationPlacement]], k: int
) -> SimulationContext:
    acts = [KEEP] * ctx.num_regions
    for r, mode in order[:k]:
        acts[r] = mode
    return ctx.with_activations(acts)


def place_activations(
    ctx: SimulationContext,
    simulator: Simulator,
    cap_bytes: float,
    stats: SolveStats,
    greedy: Callable[[SimulationContext], tuple[Candidate, bool]],
) -> tuple[SimulationContext, Candidate, bool] | None:
    """The note's search: the context with the chosen activation handling, its plan and
    whether that plan keeps everything on the device (``greedy``'s answer); None when no
    choice fits ``cap_bytes``. ``greedy`` runs the placement search on a context and
    raises ``ValueError`` where it finds no plan."""
    found: tuple[SimulationContext, Candidate, bool] | None = None
    tried: set[tuple[ActivationPlacement, ...]] = set()
    for order in _orders(ctx, simulator, stats):
        if not order:
            continue

        def fits(k: int, order: Sequence[tuple[int, ActivationPlacement]] = order) -> bool:
            return least_peak(_with_prefix(ctx, order, k), simulator, stats) <= cap_bytes

        if not fits(len(order)):
            continue
        lo, hi = 1, len(order)  # the least fitting prefix lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi) // 2
            if fits(mid):
                hi = mid
            else:
                lo = mid + 1
        for k in (lo, lo + 1):
            if k > len(order):
                break
            actx = _with_prefix(ctx, order, k)
            if actx.activations in tried:
                continue
            tried.add(actx.activations)
            try:
                cand, all_device = greedy(actx)
            except ValueError:
                continue
            if cand.peak_bytes > cap_bytes:
                continue
            if found is None or cand.period_s < found[1].period_s:
                found = (actx, cand, all_device)
    if found is None:
        # Every region recomputed, the choice whose least budget ``solve`` names, in case
        # the orders' timings differ from it enough to miss a fit it has.
        every = all_recompute(ctx)
        if every.activations not in tried and least_peak(every, simulator, stats) <= cap_bytes:
            try:
                cand, all_device = greedy(every)
            except ValueError:
                return None
            if cand.peak_bytes <= cap_bytes:
                found = (every, cand, all_device)
    return found


__all__ = ["all_recompute", "least_peak", "place_activations"]
