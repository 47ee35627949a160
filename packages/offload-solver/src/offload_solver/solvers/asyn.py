"""``asyn``: offload regions with prefetches on the H2D stream, greedily, with repair.

Each round considers every non-pinned resident region with a backward prefetch issued at
each of the next :data:`PREFETCH_WINDOW` regions (the last region, which has no later
region to prefetch it, is offered as a sync upload) and makes the move with the most
bytes saved per second of extra step time that fits the pool's blocks (see
[Note: incremental candidate evaluation] in ``_search``). When no resident region is
left and the peak still does not fit, the repair step turns the async prefetch whose
sync upload frees the most pool blocks per second back into a sync upload, while that
lowers the peak.
"""

from __future__ import annotations

from offload_solver.plan import ParamPlacement
from offload_solver.solvers._search import GreedySearch, Move
from offload_solver.solvers.base import Solver

PREFETCH_WINDOW = 3
"""Backward prefetch candidates: issued at the backward of region i+1 .. i+3."""


class AsynSolver(Solver):
    name = "asyn"
    simulator = "async"

    def offload(self, search: GreedySearch) -> bool:
        last = search.ctx.num_regions - 1
        while not search.fits:
            moves: list[Move] = []
            for r in search.offloadable():
                if r == last:
                    moves.append(Move(r, ParamPlacement.SYNC))
                    continue
                for p in range(r + 1, min(r + PREFETCH_WINDOW, last) + 1):
                    moves.append(Move(r, ParamPlacement.ASYNC, p))
            if moves:
                search.apply(search.choose(moves))
            elif not search.repair():
                return False
        return True
