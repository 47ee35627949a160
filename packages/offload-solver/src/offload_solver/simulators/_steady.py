"""The repeating step: steps started from what the previous one left, until one repeats.

[Note: steady state]
A training loop does not wait for the host: ``step()`` returns at the compute lane's end
([Note: step model] in ``_engine``) and the host steps of step k run under the forward of
step k+1. So the time per step is the period of a repeating schedule, not the single
step's span. Step k+1 starts when step k's compute lane ends (``compute_end_s``) and
differs from a cold step in two ways:
- lanes carry over: the host worker, D2H and H2D start busy with step k's remaining
  work; step k's post-step uploads not yet on H2D at its last issue point (region 0's
  backward start) join step k+1's forward prefetches on the lane in issue order;
- a region's forward waits for step k's update of it: the runtime's ``begin_forward``,
  ``upload`` and ``prefetch`` of region r block the host (``wait_update``) until r's Adam
  step (and publish) is done. A SYNC region's upload therefore starts after it; a
  RESIDENT host-state region's forward also waits for its post-step upload (the device
  waits for that copy's event); the forward prefetch of region q is called before
  region q-1's first operation (``offload_runtime.passes``), so the compute lane waits
  there, and the prefetch starts after it. Backward needs nothing of step k.
:func:`steady_state` runs the cold step, then gated steps, each started from what the
previous one left (:func:`carry_from`, times shifted by its ``compute_end_s``), until a
step leaves the next one what it started from (:func:`same_carry`: lane-free times,
gates and carried uploads, each within :data:`STEADY_REL_TOL` of the span; at most
:data:`STEADY_MAX_STEPS` steps). A step is a function of its carry, so that step repeats
and its compute-lane span is the period. Comparing spans alone could stop early: a gated
step may match the one before in span while a lane still ends later each time. On every
profile tried the first gated step already repeats (it is simulated, then checked).
Memory is the cold step's: gated steps run the same operations in the same compute-lane
order, only later, so lifetimes overlap alike and the pool is the same; a gated step's
gradients can wait longer for a D2H lane still busy with the previous step's copies (not
seen on the workloads measured). Solvers rank candidates on the cold step (its slack)
and compare steady-state periods where they accept a change of step time (optimizer
placement).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload_solver.simulators._context import RegionAssignment, SimulationContext
from offload_solver.simulators._step import run
from offload_solver.simulators._timeline import NEVER, EngineRun


@dataclass(frozen=True)
class Carry:
    """What one step leaves to the next, in the next step's time (it starts at 0, when
    the previous step's compute lane finished). See [Note: steady state]."""

    host_free_s: float
    """When the host worker finishes the previous step's work."""
    d2h_free_s: float
    """When the device-to-host lane finishes the previous step's gradient copies."""
    h2d_free_s: float
    """When the host-to-device lane finishes the copies the previous step placed on it."""
    gate_s: tuple[float, ...]
    """Per region, when the previous step's update makes it usable (``-inf``: nothing to
    wait for): an offloaded region's Adam step (and publish) end; a resident host-state
    region's post-step upload end, or, when that upload is in ``uploads``, its issue."""
    uploads: tuple[tuple[float, int], ...]
    """(issue time, region) of the previous step's post-step uploads not yet on the H2D
    lane, in issue order: they share it with this step's forward prefetches."""
    streams: tuple[tuple[float, int], ...] = ()
    """(issue time, region) of the previous step's streamed steps, in issue order: all
    of their work (state up, device step, state down, post-step upload) runs in this
    step, and each region's forward waits for its own ([Note: streamed steps] in ``_engine``)."""


STEADY_MAX_STEPS = 12
"""Gated steps :func:`steady_state` simulates at most after the cold one."""
STEADY_REL_TOL = 1e-3
""":func:`steady_state` stops when a gated step leaves what it started from, every time
within this fraction of its span."""


@dataclass(frozen=True)
class SteadyState:
    """The repeating step (see [Note: steady state])."""

    period_s: float
    """Seconds per step once steps repeat: what a training loop measures per step."""
    periods_s: tuple[float, ...]
    """Compute-lane spans of the steps simulated, the cold step first."""
    converged: bool
    """Whether the last step left the next one what it had started from (within
    :data:`STEADY_REL_TOL`), so that every later step repeats it; if not, ``period_s`` is
    the mean of the last two spans (a schedule alternating between two spans repeats
    every two steps)."""
    last: EngineRun
    """The last step simulated (the cold one when nothing carries over)."""


def carry_from(prev: EngineRun, period_s: float) -> Carry:
    """What ``prev`` leaves to a step that starts ``period_s`` after it did."""
    gate = [u - period_s for u in prev.update_end]
    # A streamed step runs again in the next step, which waits for it there.
    tail = {r for _, r in prev.tail_uploads} | {r for _, r in prev.tail_streams}
    for r, e in enumerate(prev.param_upload_end):
        if e != NEVER and r not in tail:
            gate[r] = e - period_s
    return Carry(
        host_free_s=prev.host_free_end - period_s,
        d2h_free_s=prev.d2h_free_end - period_s,
        h2d_free_s=prev.h2d_free_before_tail - period_s,
        gate_s=tuple(gate),
        uploads=tuple((s - period_s, r) for s, r in prev.tail_uploads),
        streams=tuple((s - period_s, r) for s, r in prev.tail_streams),
    )


def _effective_times(carry: Carry) -> list[float]:
    """The times of ``carry`` that :func:`run` can tell apart. Every step event is at or
    after the step's start (0), so an earlier lane-free time or gate acts as 0; the H2D
    lane's free time is only compared with prefetch issues (at or after 0) and with the
    first carried upload's issue."""
    floor = 0.0
    if carry.uploads:
        floor = min(floor, carry.uploads[0][0])
    if carry.streams:
        floor = min(floor, carry.streams[0][0])
    return [
        max(carry.host_free_s, 0.0),
        max(carry.d2h_free_s, 0.0),
        max(carry.h2d_free_s, floor),
        *(max(g, 0.0) for g in carry.gate_s),
        *(issue for issue, _ in carry.uploads),
        *(issue for issue, _ in carry.streams),
    ]


def same_carry(a: Carry, b: Carry, tol_s: float) -> bool:
    """Whether steps started from ``a`` and from ``b`` run alike: the same carried uploads,
    and every time :func:`run` reads within ``tol_s`` seconds (equal ones: the same step)."""
    if [r for _, r in a.uploads] != [r for _, r in b.uploads]:
        return False
    if [r for _, r in a.streams] != [r for _, r in b.streams]:
        return False
    return all(
        abs(x - y) <= tol_s for x, y in zip(_effective_times(a), _effective_times(b), strict=True)
    )


def steady_state(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], cold: EngineRun
) -> SteadyState:
    """Iterate steps from the cold step ``cold`` of ``assignment`` until one leaves the
    next what it started from (see [Note: steady state]). With several micro-batches per
    step, the period also counts the others (see [Note: micro-batches] in ``_engine``)."""
    found = _steady_state(ctx, assignment, cold)
    if ctx.micro_batches == 1:
        return found
    accumulate = run(ctx, assignment, optimizer_step=False).compute_end_s
    extra = (ctx.micro_batches - 1) * accumulate
    return SteadyState(found.period_s + extra, found.periods_s, found.converged, found.last)


def _steady_state(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], cold: EngineRun
) -> SteadyState:
    period = cold.compute_end_s
    numel, device = ctx.trainable, cold.device_state
    if not any(numel[r] > 0 and not device[r] for r in range(ctx.num_regions)):
        # Nothing runs off the compute lane, so nothing carries over.
        return SteadyState(period, (period,), True, cold)
    periods = [period]
    prev = cold
    carry = carry_from(cold, period)
    for _ in range(STEADY_MAX_STEPS):
        prev = run(ctx, assignment, carry)
        span = prev.compute_end_s
        periods.append(span)
        # A step is a function of its carry alone: one that leaves what it started from
        # repeats forever. Equal spans are not enough: a gated step can match the cold one
        # (or its predecessor) in span while a lane still runs later each step.
        nxt = carry_from(prev, span)
        if same_carry(carry, nxt, STEADY_REL_TOL * span):
            return SteadyState(span, tuple(periods), True, prev)
        carry = nxt
    return SteadyState((periods[-1] + periods[-2]) / 2, tuple(periods), False, prev)


__all__ = [
    "STEADY_MAX_STEPS",
    "STEADY_REL_TOL",
    "Carry",
    "SteadyState",
    "carry_from",
    "same_carry",
    "steady_state",
]
