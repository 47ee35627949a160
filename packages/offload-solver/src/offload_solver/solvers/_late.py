"""Host work moved to regions late in forward order, after the greedy phases.

[Note: host work late]
A host-state region (optimizer state on the host, and offloaded regions always are) has
its Adam step on the host between its gradients landing in backward and its parameters'
first use in the next forward. Backward runs the regions in reverse, so a region late in
forward order has its gradients first and its parameters needed last: the most time for
its host step. An early region is the reverse: its gradients land at backward's end and
the next forward wants it within milliseconds, so its host step, and the upload after
it, sit between two steps' computes.

The greedy phases decide on the cold step (one step on an idle machine, [Note:
incremental candidate evaluation] in ``_search``), in which no next forward waits, and
break ties by the earliest region, so they can leave host work on early regions whose
next forward then waits for the host (measured: BENCHMARKS.md, Decisions, "Late host
work"). So this phase, on the finished greedy plan, moves host work later: for a
host-state region ``r`` (the :data:`LATE_SWAP_REGIONS` earliest, earliest first) and
each of the :data:`LATE_SWAP_TARGETS` latest resident device-state regions ``s > r``
that can take its placement, it gives ``s`` the placement and state ``r`` had (an ASYNC
prefetch issued as many regions after ``s`` as it was after ``r``) and ``r`` device
state, resident. The first such swap whose repeating step ([Note: steady state] in
``simulators._steady``) is shorter by more than the steady state's tolerance and whose
peak fits the cap is kept, and the search starts again from it. Each kept swap moves
host work to a later region, so the sum of the host-state regions' indices rises and the
search ends. Every simulation counts in ``num_simulations``.

Trying every later device-state region for every host-state region made the last pass
(the one that keeps nothing) cost a simulation of each pair, quadratic in the regions
and so cubic in time. The swaps kept on traced GPT-2 profiles (gpt2_xl to a
290-layer model, budgets from 3 to 100 GiB) were all of one of a pass's first two
host-state regions with the latest or next-latest device-state region, so a pass tries
only the first few of each, and the plans came out unchanged
(``benchmarks/solver_bench.py --planner`` solves such profiles).

It runs before streamed regions are placed, and ``solve`` places them on both plans,
the greedy one and the moved one, keeping the one whose repeating step is shorter in the
end: a moved plan's host lane has less left for streaming to take over, so the moved
plan can end longer once both are streamed.
"""

from __future__ import annotations

from offload_solver.plan import ParamPlacement, StatePlacement
from offload_solver.simulators._engine import STEADY_REL_TOL, RegionAssignment, SimulationContext
from offload_solver.simulators.base import Simulator
from offload_solver.solvers._search import Candidate, SolveStats, evaluate

LATE_SWAP_REGIONS = 4
"""Host-state regions (the earliest first) whose host work each pass tries to move (see
the note)."""
LATE_SWAP_TARGETS = 2
"""Device-state regions (the latest first) each host-state region's swap is tried with
(see the note)."""


def swapped(
    ctx: SimulationContext, assignment: list[RegionAssignment], r: int, s: int
) -> list[RegionAssignment] | None:
    """``assignment`` with host-state region ``r``'s placement and state given to the
    later region ``s`` and ``r`` resident with device state; None where ``s`` cannot take
    them (offloaded: ``s`` pinned, larger than a pool block, or with no region after it
    to issue the prefetch)."""
    a = assignment[r]
    prefetch_at = None
    if a.placement is not ParamPlacement.RESIDENT:
        if ctx.pinned[s] or ctx.size[s] > ctx.block_size_bytes:
            return None
        if a.placement is ParamPlacement.ASYNC:
            assert a.prefetch_at is not None
            prefetch_at = s + (a.prefetch_at - r)
            if prefetch_at >= ctx.num_regions:
                return None
    out = list(assignment)
    out[s] = RegionAssignment(a.placement, a.state, prefetch_at)
    out[r] = RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.DEVICE)
    return out


def move_host_work_late(
    ctx: SimulationContext,
    simulator: Simulator,
    cap_bytes: float,
    stats: SolveStats,
    start: Candidate,
) -> Candidate:
    """``start`` with host work moved to later regions while that shortens the repeating
    step within ``cap_bytes`` (see the note); ``start`` when no swap does."""
    best = start
    while True:
        asg = best.assignment
        hosts = [
            r
            for r, a in enumerate(asg)
            if a.state is not StatePlacement.DEVICE and ctx.trainable[r]
        ][:LATE_SWAP_REGIONS]
        devices = [
            s
            for s, a in enumerate(asg)
            if a.state is StatePlacement.DEVICE
            and a.placement is ParamPlacement.RESIDENT
            and ctx.trainable[s]
        ]
        threshold = best.period_s * (1.0 - STEADY_REL_TOL)
        found: Candidate | None = None
        for r in hosts:
            targets = 0
            for s in reversed(devices):
                if s <= r or targets >= LATE_SWAP_TARGETS:
                    break
                trial = swapped(ctx, asg, r, s)
                if trial is None:
                    continue
                targets += 1
                c = evaluate(ctx, simulator, stats, trial, cap_bytes)
                if c is not None and c.peak_bytes <= cap_bytes and c.period_s < threshold:
                    found = c
                    break
            if found is not None:
                break
        if found is None:
            return best
        best = found
