"""The synchronous simulator: offloaded regions are uploaded on the compute lane only.

It models what the ``syn`` solver plans (and the reference's synchronous simulator):
no prefetching, so an ASYNC region is rejected. Gradients still leave on the D2H lane and
host optimizer steps still overlap the backward, so with nothing offloaded it predicts
exactly what the asynchronous simulator predicts.
"""

from __future__ import annotations

from offload_solver.simulators.base import Simulator


class SyncSimulator(Simulator):
    name = "sync"
    allow_async = False
