"""What a simulation of one step predicts (:class:`SimulationResult`), expanded from a
run's tasks and memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from offload_solver.plan import MemorySample, TimelineInterval
from offload_solver.simulators._context import SimulationContext
from offload_solver.simulators._memory import memory_curves
from offload_solver.simulators._timeline import KINDS, LANES, EngineRun


@dataclass(frozen=True)
class SimulationResult:
    """Everything a simulation of one step predicts."""

    peak_bytes: int
    """Peak device bytes with offloaded regions held in the pool. With STREAMED regions
    it also covers the ring of device buffers held into the next step's forward, which
    the cold step's ``memory_curve`` does not show ([Note: streamed steps])."""
    step_time_s: float
    """Seconds from the cold step's start until its last lane goes idle: the span of
    ``timeline``."""
    steady_step_time_s: float
    """Seconds per step once steps repeat, each starting when the previous one's compute
    lane finished (see [Note: steady state]): what a training loop measures per step."""
    raw_peak_bytes: int
    """Peak device bytes counting offloaded regions only while they are on the device."""
    static_bytes: int
    """Device bytes held the whole step: resident parameters, device optimizer state, pool."""
    pool_size_bytes: int
    pool_blocks: tuple[int | None, ...]
    """Per region, the index of its pool block (``None`` for resident regions)."""
    pool_lower_bound_blocks: int
    """Most offloaded regions on the device at once; first fit may need more blocks."""
    coexisting: tuple[tuple[int, int], ...]
    """Pairs ``(i, j)``, ``i < j``, of offloaded regions whose device lifetimes overlap."""
    timeline: tuple[TimelineInterval, ...]
    memory_curve: tuple[MemorySample, ...]
    """Device bytes over time, pool counted whole (its maximum is ``peak_bytes``)."""
    raw_memory_curve: tuple[MemorySample, ...]
    """Device bytes over time, offloaded regions counted while on the device."""


def to_result(
    ctx: SimulationContext,
    out: EngineRun,
    steady_step_time_s: float,
    steady_stream_peak_bytes: int = 0,
) -> SimulationResult:
    """Expand a run into per-lane intervals and per-operation memory curves; the steady
    state's period comes from :func:`steady_state`, and with STREAMED regions the peak
    while its ring overlaps the next forward from its last step's ``stream_peak_bytes``
    (``steady_stream_peak_bytes``; see [Note: streamed steps])."""
    timeline = tuple(
        TimelineInterval(
            stream=LANES[out.lane[x]],
            region=out.region[x],
            kind=KINDS[out.kind[x]],
            start_s=out.start[x],
            end_s=out.end[x],
        )
        for x in range(len(out.start))
    )
    pool_curve, raw_curve = memory_curves(ctx, out)
    pairs = sorted((a, b) for a, nbrs in out.adjacent.items() for b in nbrs if a < b)
    raw_peak = max(m.bytes for m in raw_curve)
    return SimulationResult(
        peak_bytes=max(out.peak_bytes, steady_stream_peak_bytes),
        step_time_s=out.step_time_s,
        steady_step_time_s=steady_step_time_s,
        raw_peak_bytes=raw_peak,
        static_bytes=out.static_bytes + out.pool_bytes,
        pool_size_bytes=out.pool_bytes,
        pool_blocks=tuple(b if b >= 0 else None for b in out.blocks),
        pool_lower_bound_blocks=out.max_live,
        coexisting=tuple(pairs),
        timeline=timeline,
        memory_curve=pool_curve,
        raw_memory_curve=raw_curve,
    )


__all__ = ["SimulationResult", "to_result"]
