"""``syn``: offload regions with synchronous uploads, greedily.

Each round offloads (SYNC) the non-pinned resident region with the most bytes saved per
second of extra step time, until the simulated peak fits. Sync uploads of different
regions never overlap, so one pool block serves them all.
"""

from __future__ import annotations

from offload_solver.plan import ParamPlacement
from offload_solver.solvers._search import GreedySearch, Move
from offload_solver.solvers.base import Solver


class SynSolver(Solver):
    name = "syn"
    simulator = "sync"

    def offload(self, search: GreedySearch) -> bool:
        while not search.fits:
            moves = [Move(r, ParamPlacement.SYNC) for r in search.offloadable()]
            if not moves:
                return False
            search.apply(search.choose(moves))
        return True
