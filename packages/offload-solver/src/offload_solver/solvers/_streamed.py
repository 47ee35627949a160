"""Which host-state regions to step on the device instead (STREAMED), after the search.

[Note: streamed search]
A STREAMED region keeps its state in host memory but is stepped on the device: its state
goes up and back down over PCIe, so the host lane loses its Adam step and the copy lanes
gain its state (see [Note: streamed steps] in ``simulators._engine``). That pays while
the host lane bounds the step and PCIe has time to spare, and it competes with the
step's own uploads when PCIe is busy, so the search simulates rather than estimates.

Candidates (:func:`stream_candidates`) are the host-state regions that own parameters
and whose host step does not run speculatively in the chosen plan's cold step: with
``speculative_params`` those outside the speculating set (``may_speculate`` in
``_engine.run``); with every region allowed to speculate, the ones whose hook comes too
late to (the runtime leaves them to ``step()``); with ``host_step_after_backward`` all
of them. A speculating host step already runs under backward, so the device gains
little by taking it over, and a streamed region is never stepped speculatively.

For each fraction ``f`` in :data:`STREAM_FRACTIONS`, :func:`interleave` marks candidates
STREAMED spread evenly over forward order: walking candidates in forward order, one
becomes STREAMED while the streamed parameters so far are below ``f`` times the
candidates' parameters so far (host and streamed steps then alternate, so the host and
the copy lanes work side by side through the step). Each choice is simulated with its
steady state; the plan keeps the shortest period that beats the plan without streaming
by more than the steady state's tolerance (``STEADY_REL_TOL``) and whose peak, the ring
of buffers included, fits the cap. The best fraction's neighbours at
:data:`STREAM_REFINE_STEP` either side are then tried too. Every simulation, the gated
steps of each steady state included, is counted in ``num_simulations``.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_solver.plan import StatePlacement
from offload_solver.simulators._engine import (
    STEADY_REL_TOL,
    EngineRun,
    RegionAssignment,
    SimulationContext,
)
from offload_solver.simulators.base import Simulator
from offload_solver.solvers._search import Candidate, SolveStats, evaluate

STREAM_FRACTIONS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
"""Fractions of the candidates' parameters tried as STREAMED (see the note)."""
STREAM_REFINE_STEP = 0.05
"""How far either side of the best fraction the refinement tries."""


def stream_candidates(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], cold: EngineRun
) -> list[int]:
    """Regions of ``assignment`` (simulated as the cold step ``cold``) that may become
    STREAMED: host-state, owning parameters, and not stepped speculatively in ``cold``."""
    return [
        r
        for r, a in enumerate(assignment)
        if a.state is StatePlacement.HOST and ctx.trainable[r] > 0 and not cold.stepped_early[r]
    ]


def interleave(candidates: Sequence[int], numel: Sequence[int], fraction: float) -> list[int]:
    """The candidates (in forward order) to make STREAMED for about ``fraction`` of their
    parameters, spread evenly: one is taken while the parameters taken so far are below
    ``fraction`` times the candidates' parameters so far, itself included."""
    chosen: list[int] = []
    seen = taken = 0
    for r in candidates:
        seen += numel[r]
        if taken < fraction * seen:
            chosen.append(r)
            taken += numel[r]
    return chosen


def place_streamed(
    ctx: SimulationContext,
    simulator: Simulator,
    cap_bytes: float,
    stats: SolveStats,
    start: Candidate,
) -> Candidate:
    """Make some host-state regions of ``start`` STREAMED where that shortens the
    repeating step and the peak fits ``cap_bytes`` (see the note); ``start`` when nothing
    does. Needs ``ctx.streamed``."""
    candidates = stream_candidates(ctx, start.assignment, start.cold)
    if not candidates or ctx.streamed is None:
        return start
    numel = ctx.trainable
    tried: dict[tuple[int, ...], Candidate | None] = {}

    def trial(fraction: float) -> Candidate | None:
        chosen = interleave(candidates, numel, fraction)
        key = tuple(chosen)
        if not chosen or key in tried:
            return tried.get(key)
        asg = list(start.assignment)
        for r in chosen:
            a = asg[r]
            asg[r] = RegionAssignment(a.placement, StatePlacement.STREAMED, a.prefetch_at)
        tried[key] = evaluate(ctx, simulator, stats, asg)
        return tried[key]

    threshold = start.period_s * (1.0 - STEADY_REL_TOL)
    best: Candidate | None = None
    best_fraction = 0.0

    def consider(fraction: float) -> None:
        nonlocal best, best_fraction
        t = trial(fraction)
        if (
            t is not None
            and t.peak_bytes <= cap_bytes
            and t.period_s < threshold
            and (best is None or t.period_s < best.period_s)
        ):
            best, best_fraction = t, fraction

    for fraction in STREAM_FRACTIONS:
        consider(fraction)
    if best is not None:
        for fraction in (best_fraction - STREAM_REFINE_STEP, best_fraction + STREAM_REFINE_STEP):
            if 0.0 < fraction < 1.0:
                consider(fraction)
    return start if best is None else best
