"""Offload solvers, registered by name; each is one module with a :class:`Solver`."""

from __future__ import annotations

from offload_solver.solvers.asyn import AsynSolver
from offload_solver.solvers.base import Solver
from offload_solver.solvers.syn import SynSolver

SOLVERS: dict[str, Solver] = {
    SynSolver.name: SynSolver(),
    AsynSolver.name: AsynSolver(),
}


def get_solver(name: str) -> Solver:
    """The solver registered as ``name``; ``ValueError`` listing the known ones if none."""
    if not isinstance(name, str) or name not in SOLVERS:
        known = ", ".join(repr(k) for k in sorted(SOLVERS))
        raise ValueError(f"Solver {name!r} is not registered; known: {known}")
    return SOLVERS[name]


__all__ = ["SOLVERS", "AsynSolver", "Solver", "SynSolver", "get_solver"]
