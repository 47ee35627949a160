"""Training-step simulators, registered by name.

All strategies share one interface (:class:`Simulator`): ``run(ctx, assignment)`` for the
raw outcome a solver reads and ``simulate(ctx, assignment)`` for a
:class:`SimulationResult` with timelines and memory curves. The model they implement is
[Note: step model] in ``offload_solver.simulators._engine``.
"""

from __future__ import annotations

from collections.abc import Sequence

from offload_solver.cost_model import CostModel
from offload_solver.hardware import HardwareProfile
from offload_solver.profile import ModelProfile
from offload_solver.simulators._engine import (
    RegionAssignment,
    SimulationContext,
    SimulationResult,
    check_speculative_params,
)
from offload_solver.simulators.asynchronous import AsyncSimulator
from offload_solver.simulators.base import Simulator
from offload_solver.simulators.sync import SyncSimulator

SIMULATORS: dict[str, Simulator] = {
    SyncSimulator.name: SyncSimulator(),
    AsyncSimulator.name: AsyncSimulator(),
}


def get_simulator(name: str) -> Simulator:
    """The simulator registered as ``name``; ``ValueError`` listing the known ones if none."""
    try:
        return SIMULATORS[name]
    except KeyError:
        known = ", ".join(repr(k) for k in sorted(SIMULATORS))
        raise ValueError(f"Simulator {name!r} is not registered; known: {known}") from None


def simulate(
    profile: ModelProfile,
    hardware: HardwareProfile,
    assignment: Sequence[RegionAssignment],
    simulator: str = "async",
    *,
    cost_model: CostModel | None = None,
) -> SimulationResult:
    """Simulate one training step of ``profile`` on ``hardware`` with ``cost_model``'s
    factors (``CostModel()`` when None).

    ``assignment`` has one entry per region of ``build_regions(profile)``. For many
    simulations of one profile, build a :class:`SimulationContext` once and call
    ``get_simulator(name).simulate(ctx, assignment)``.
    """
    ctx = SimulationContext.build(profile, hardware, cost_model=cost_model)
    return get_simulator(simulator).simulate(ctx, assignment)


__all__ = [
    "SIMULATORS",
    "AsyncSimulator",
    "RegionAssignment",
    "SimulationContext",
    "SimulationResult",
    "Simulator",
    "SyncSimulator",
    "check_speculative_params",
    "get_simulator",
    "simulate",
]
