"""The interface every solver strategy implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from offload_solver.solvers._search import GreedySearch


class Solver(ABC):
    """A strategy that offloads regions until the simulated peak fits.

    ``offload`` starts from ``search``'s current assignment (everything resident, optimizer
    state on the host), changes it through ``search`` and returns whether the peak now
    fits ``search.cap_bytes``. Optimizer placement, the first all-device check and the
    infeasibility error are shared and live in ``offload_solver.solve``.
    """

    name: ClassVar[str] = ""
    simulator: ClassVar[str] = "async"
    """Name of the registered simulator whose model this strategy plans for."""

    @abstractmethod
    def offload(self, search: GreedySearch) -> bool:
        """Offload regions through ``search``; True when the peak fits its cap."""
