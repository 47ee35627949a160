"""The interface every simulator strategy implements (see [Note: step model] in _engine)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from offload_solver.simulators._engine import (
    EngineRun,
    RegionAssignment,
    SimulationContext,
    SimulationResult,
    run,
    steady_state,
    to_result,
)


class Simulator:
    """A strategy for simulating one training step; subclasses set what they model."""

    name: ClassVar[str] = ""
    allow_async: ClassVar[bool] = True
    """Whether ASYNC (prefetched) regions are part of this strategy's model."""

    def run(self, ctx: SimulationContext, assignment: Sequence[RegionAssignment]) -> EngineRun:
        """Simulate and keep the raw run (what solvers read); raises ``ValueError`` on a bad
        assignment."""
        ctx.validate(assignment, allow_async=self.allow_async)
        return run(ctx, assignment)

    def simulate(
        self, ctx: SimulationContext, assignment: Sequence[RegionAssignment]
    ) -> SimulationResult:
        """Simulate the cold step and expand it into timelines and memory curves, with the
        steady state's period (see [Note: steady state] in ``_steady``)."""
        cold = self.run(ctx, assignment)
        steady = steady_state(ctx, assignment, cold)
        return to_result(ctx, cold, steady.period_s, steady.last.stream_peak_bytes)
