"""A local search over one-region changes, run on the finished plan.

[Note: local search]
The greedy phases choose one kind of change at a time with estimates (offload until the
peak fits, then place state, then streamed regions at a few even fractions), so the plan
they end with can sit next to a better one that no phase tries: one more region streamed
where the host tail bounds the step, one offloaded region made resident where its upload
delays a compute, one region given the host state that lets another stream. The last
phase therefore simulates every change of a single region (:func:`moves`) with its
steady state, and goes on from the change with the shortest repeating step whose peak,
the streamed ring included, still fits the cap, even when that is no shorter than the
plan it came from: a step sideways can open a better one. It stops after
:data:`POLISH_PATIENCE` rounds in a row without a plan shorter than the best so far by
more than :data:`POLISH_MIN_GAIN`, or after ``max_rounds`` rounds, and returns the best
plan seen; plans already simulated are not tried again. Each round costs one cold step
per move (a move whose cold peak already exceeds the cap stops there) and a steady state
for the others; all of them count in ``num_simulations``.

The changes, for a region that owns parameters:

- host state to STREAMED (when the context has streamed costs), and STREAMED to host;
- device state (resident regions only) to host state, or to STREAMED;
- a resident region offloaded: ASYNC, prefetched for backward at the next region's
  backward start (not for a pinned region, nor the last region, nor with a simulator
  without prefetch), else SYNC where the region is not pinned;
- an offloaded region made resident, keeping its state;
- an ASYNC region made SYNC, and a SYNC one ASYNC as above.

Every candidate is a plan the runtime carries out as it does the greedy ones: the search
only recombines placements the phases already produce.

Off by default (``polish_rounds=0``), because what it finds did not hold on the GPU. On the
H200 (BENCHMARKS.md, session 24; ``gpu_session.sh polishab``, runs alternating with and
without it), W3's polished plans were predicted 3% shorter than the greedy ones (416-421
ms against 430-432) and measured 6-9% longer (451-469 ms against 425-430, the 5 fastest
steps; run means 3-5% longer); W2's predicted 6% shorter and measured 1.5-3% longer. A
search against a model picks out the model's errors: W3's polished plans stream region
29, whose gradients land first, and there the host waited 75 ms from backward's start
to its first step against 43-46 ms for the greedy plans, which the simulator does not
show. The whole search takes 1.1-1.5 s for W2 and W3 (30 regions) and 3.4 s for W4 (92),
as ``benchmarks/plan_neighbours.py`` prints it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence

from offload_solver.model import ParamPlacement, StatePlacement
from offload_solver.simulators._engine import RegionAssignment, SimulationContext
from offload_solver.simulators.base import Simulator
from offload_solver.solvers._search import Candidate, SolveStats, evaluate

log = logging.getLogger(__name__)

POLISH_ROUNDS = 0
"""Rounds of the local search :func:`~offload_solver.solve` runs by default: none (see
the note: measured, the search's plans were slower)."""
POLISH_SUGGESTED_ROUNDS = 8
"""Rounds that let the search converge on the benchmark workloads (it stopped after 3-5
on W2, W3 and W4), for callers that opt in."""
POLISH_PATIENCE = 2
"""Rounds in a row without a better plan after which the local search stops."""
POLISH_MIN_GAIN = 2e-3
"""A plan counts as better only if its repeating step is shorter by more than this
fraction (above the steady state's own tolerance, so float noise never drives a round)."""


def moves(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], *, allow_async: bool
) -> Iterator[tuple[int, RegionAssignment]]:
    """Every one-region change of ``assignment`` the search tries (see the note)."""
    n = ctx.num_regions
    streamable = ctx.streamed is not None
    for r, a in enumerate(assignment):
        if ctx.numel[r] == 0:
            continue
        if a.state is StatePlacement.HOST and streamable:
            yield r, RegionAssignment(a.placement, StatePlacement.STREAMED, a.prefetch_at)
        elif a.state is StatePlacement.STREAMED:
            yield r, RegionAssignment(a.placement, StatePlacement.HOST, a.prefetch_at)
        elif a.state is StatePlacement.DEVICE:
            yield r, RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.HOST)
            if streamable:
                yield r, RegionAssignment(ParamPlacement.RESIDENT, StatePlacement.STREAMED)
            continue  # device state stays resident
        if a.placement is ParamPlacement.RESIDENT:
            if ctx.pinned[r]:
                continue
            if allow_async and r + 1 < n:
                yield r, RegionAssignment(ParamPlacement.ASYNC, a.state, r + 1)
            else:
                yield r, RegionAssignment(ParamPlacement.SYNC, a.state)
        else:
            yield r, RegionAssignment(ParamPlacement.RESIDENT, a.state)
            if a.placement is ParamPlacement.ASYNC:
                yield r, RegionAssignment(ParamPlacement.SYNC, a.state)
            elif allow_async and r + 1 < n:
                yield r, RegionAssignment(ParamPlacement.ASYNC, a.state, r + 1)


def polish(
    ctx: SimulationContext,
    simulator: Simulator,
    cap_bytes: float,
    stats: SolveStats,
    start: Candidate,
    *,
    max_rounds: int = POLISH_SUGGESTED_ROUNDS,
) -> Candidate:
    """Improve ``start`` by one-region changes while that shortens the repeating step and
    the peak fits ``cap_bytes`` (see the note). Returns the best candidate found:
    ``start`` when no change helps or ``max_rounds`` is 0."""
    if max_rounds < 0:
        raise ValueError(f"max_rounds must be >= 0, got {max_rounds}")
    best = current = start
    seen = {tuple(start.assignment)}
    stale = 0
    for round_ in range(max_rounds):
        found: Candidate | None = None  # the round's shortest fitting change (first on ties)
        for r, change in moves(ctx, current.assignment, allow_async=simulator.allow_async):
            trial = list(current.assignment)
            trial[r] = change
            key = tuple(trial)
            if key in seen:
                continue
            seen.add(key)
            c = evaluate(ctx, simulator, stats, trial, cap_bytes)
            if c is None or c.peak_bytes > cap_bytes:
                continue
            if found is None or c.period_s < found.period_s:
                found = c
        if found is None:
            break
        current = found
        if found.period_s < best.period_s * (1.0 - POLISH_MIN_GAIN):
            best, stale = found, 0
        else:
            stale += 1
            if stale >= POLISH_PATIENCE:
                break
        log.debug(
            "local search round %d: best %.1f ms, round's best %.1f ms (%d plans tried)",
            round_ + 1,
            best.period_s * 1e3,
            found.period_s * 1e3,
            len(seen),
        )
    return best
