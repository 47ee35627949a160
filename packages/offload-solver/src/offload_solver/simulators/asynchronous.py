"""The asynchronous simulator: SYNC uploads plus ASYNC prefetches on the H2D lane.

Forward prefetches run one region ahead; backward prefetches start at the backward of the
region each plan names (``prefetch_at``); both contend with post-step parameter uploads
for the H2D lane. See [Note: step model] in ``_engine``.
"""

from __future__ import annotations

from offload_solver.simulators.base import Simulator


class AsyncSimulator(Simulator):
    name = "async"
    allow_async = True
