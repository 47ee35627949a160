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
4. Runs ([Note: recomputed runs]): where no prefix fits, step 3 again for the RECOMPUTE
   order, each prefix's recomputed regions grouped into runs (the grouping with the least
   floor peak). Then the best plan so far if it recomputes any region, else every region
   RECOMPUTE (or sent to the host where it may not be), grouped the same way, gets the
   full placement search when its floor fits.
5. The plan with the shortest repeating step wins (the earlier on a tie).

[Note: recomputed runs]
A recomputed region holds the values it reads from before it until its backward; where
regions cut a transformer layer into pieces, each piece holds two to four of the
layer's widest values (the residual stream and the branch being computed), so that
every region recomputed can still need several times a layer's saved bytes per layer.
Chaining consecutive RECOMPUTE regions into runs (``RECOMPUTE_WITH_PREVIOUS``) holds only
what a run reads from before its first region, at the price of the run's whole saved
bytes being back on the device during its backward, and of its regions but the last
keeping their parameters resident. ``chain`` groups the consecutive RECOMPUTE regions of
an activation choice into runs of at most ``cap`` saved bytes each, with the least total
held bytes (dynamic programming over where runs start; a run's held bytes are the
storages its regions read from before it, each counted once). The search tries caps of
``RUN_CAPS`` times the largest recomputed region's saved bytes and keeps the grouping
whose floor peak (``least_peak``) is least, so the least budget ``solve`` names counts
runs too.

A region with an operation that writes in place into an input (``Operation.mutates``:
Mixture-of-Experts scatters, for one) is never RECOMPUTE: its second run could read what
the first changed. It may be HOST, and "every region RECOMPUTE" sends its activations to
the host instead.

When nothing fits, ``solve`` reports the least budget of every region recomputed, in runs
(``least_recompute``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from offload_solver.plan import ActivationPlacement, ParamPlacement
from offload_solver.simulators._engine import RegionAssignment, SimulationContext
from offload_solver.simulators.base import Simulator
from offload_solver.solvers._search import Candidate, SolveStats

KEEP, RECOMPUTE, HOST, WITH_PREVIOUS = (
    ActivationPlacement.KEEP,
    ActivationPlacement.RECOMPUTE,
    ActivationPlacement.HOST,
    ActivationPlacement.RECOMPUTE_WITH_PREVIOUS,
)
_EPS_S = 1e-12
RUN_CAPS = (1, 2, 3, 4, 6, 8)
"""Caps on a recomputed run's saved bytes, in multiples of the largest recomputed
region's, that the search tries ([Note: recomputed runs])."""


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


def chain(
    ctx: SimulationContext, activations: Sequence[ActivationPlacement], cap_bytes: int
) -> tuple[ActivationPlacement, ...]:
    """``activations`` with each stretch of consecutive RECOMPUTE regions grouped into
    runs of at most ``cap_bytes`` saved bytes (a single region may exceed it) that hold
    the least bytes in all ([Note: recomputed runs])."""
    reads, edge = ctx.storage_reads, ctx.approximate_boundary
    saved = ctx.act.saved_bytes
    out = list(activations)
    n = len(out)
    lo = 0
    while lo < n:
        if activations[lo] is not RECOMPUTE:
            lo += 1
            continue
        hi = lo
        while hi < n and activations[hi] is RECOMPUTE:
            hi += 1
        # best[k]: least held bytes of regions lo .. lo+k-1 in runs; cut[k]: where the
        # last of those runs starts.
        best = [0.0] + [math.inf] * (hi - lo)
        cut = [lo] * (hi - lo + 1)
        for a in range(lo, hi):
            if best[a - lo] == math.inf:
                continue
            held: set[int] = set()
            run_saved = 0
            for b in range(a, hi):
                run_saved += saved[b]
                if b > a and run_saved > cap_bytes:
                    break
                if reads is not None:
                    held |= reads.held(b, a, held)
                cost = best[a - lo] + (reads.bytes(held) if reads is not None else edge[a])
                if cost < best[b + 1 - lo]:
                    best[b + 1 - lo] = cost
                    cut[b + 1 - lo] = a
        b = hi
        while b > lo:
            a = cut[b - lo]
            for q in range(a + 1, b):
                out[q] = WITH_PREVIOUS
            b = a
        lo = hi
    return tuple(out)


def least_in_runs(
    ctx: SimulationContext,
    activations: Sequence[ActivationPlacement],
    simulator: Simulator,
    stats: SolveStats,
) -> tuple[SimulationContext, int]:
    """Of ``activations`` and its groupings into runs for each of ``RUN_CAPS``, the
    context with the least floor peak (``least_peak``), and that peak; the earlier on a
    tie."""
    largest = max(
        (ctx.act.saved_bytes[r] for r, a in enumerate(activations) if a is RECOMPUTE), default=0
    )
    choices = [tuple(activations)]
    for k in RUN_CAPS:
        grouped = chain(ctx, activations, k * largest)
        if grouped not in choices:
            choices.append(grouped)
    best: tuple[SimulationContext, int] | None = None
    for acts in choices:
        c = ctx.with_activations(acts)
        peak = least_peak(c, simulator, stats)
        if best is None or peak < best[1]:
            best = (c, peak)
    assert best is not None
    return best


def least_recompute(
    ctx: SimulationContext, simulator: Simulator, stats: SolveStats
) -> tuple[SimulationContext, int]:
    """Every region recomputed (:func:`all_recompute`), in the runs with the least floor
    peak, and that peak: the least budget of any activation choice the search makes."""
    return least_in_runs(ctx, all_recompute(ctx).activations, simulator, stats)


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

    def consider(actx: SimulationContext) -> None:
        nonlocal found
        if actx.activations in tried:
            return
        tried.add(actx.activations)
        try:
            cand, all_device = greedy(actx)
        except ValueError:
            return
        if cand.peak_bytes <= cap_bytes and (found is None or cand.period_s < found[1].period_s):
            found = (actx, cand, all_device)

    orders = _orders(ctx, simulator, stats)
    # Steps 3 and 4: the orders' prefixes; where none fits, the prefixes of the RECOMPUTE
    # order in runs.
    for runs in (False, True):
        if runs and (found is not None or len(orders) < 2):
            break
        for order in orders if not runs else orders[1:2]:
            if not order:
                continue

            def at(
                k: int, order: Sequence[tuple[int, ActivationPlacement]] = order, runs: bool = runs
            ) -> tuple[SimulationContext, int]:
                actx = _with_prefix(ctx, order, k)
                if runs:
                    return least_in_runs(ctx, actx.activations, simulator, stats)
                return actx, least_peak(actx, simulator, stats)

            if at(len(order))[1] > cap_bytes:
                continue
            lo, hi = 1, len(order)  # the least fitting prefix lies in [lo, hi]
            while lo < hi:
                mid = (lo + hi) // 2
                if at(mid)[1] <= cap_bytes:
                    hi = mid
                else:
                    lo = mid + 1
            for k in (lo, lo + 1):
                if k <= len(order):
                    consider(at(k)[0])
    # Runs of the best plan so far, or of every region recomputed where none fits.
    if found is None:
        bases = [all_recompute(ctx).activations]
    else:
        bases = [found[0].activations] if RECOMPUTE in found[0].activations else []
    for base in bases:
        actx, floor = least_in_runs(ctx, base, simulator, stats)
        if floor <= cap_bytes:
            consider(actx)
    return found


__all__ = [
    "all_recompute",
    "chain",
    "least_in_runs",
    "least_peak",
    "least_recompute",
    "place_activations",
]
