"""Device memory of a simulated step: the pool that holds offloaded regions, the peak,
and the memory curves ([Note: memory model] in ``offload_solver.profile``; how the step
model counts them: [Note: step model] in ``_engine``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence

from offload_solver.plan import MemorySample
from offload_solver.simulators._context import SimulationContext
from offload_solver.simulators._timeline import NEVER, RESIDENT, EngineRun


def backward_level(
    ctx: SimulationContext,
    offsets: Sequence[float],
    in_flight: deque[tuple[float, int]],
    r: int,
    start: float,
    end: float,
    level: int,
    dyn: int,
) -> tuple[int, int]:
    """Region r's backward, from ``start`` to ``end`` with its operations at ``offsets``,
    while gradient copies end in it (``in_flight``: (copy end, bytes) of the gradients
    waiting on the device, in copy order, the first ending by ``end``), against the
    dynamic peak ``dyn``: its activations plus ``level``, the waiting gradients' bytes. A
    copy ending at or before an operation's start frees its bytes for that operation; the
    copies that end by ``end`` leave ``in_flight``. Returns (``level``, ``dyn``) after the
    region."""
    n_ops = len(offsets)
    hi_op = ctx.op_end[r]
    pos = 0
    while in_flight and in_flight[0][0] <= end:
        g_end, g_bytes = in_flight.popleft()
        if g_end > start:
            # First operation (in backward order) starting at or after g_end.
            lo_k, hi_k = pos, n_ops
            while lo_k < hi_k:
                mid = (lo_k + hi_k) // 2
                if g_end <= start + offsets[mid]:
                    hi_k = mid
                else:
                    lo_k = mid + 1
            if lo_k > pos:
                m = ctx.act_bwd_max(hi_op - lo_k, hi_op - pos) + level
                if m > dyn:
                    dyn = m
                pos = lo_k
        level -= g_bytes
    if pos < n_ops:
        m = ctx.act_bwd_max(hi_op - n_ops, hi_op - pos) + level
        if m > dyn:
            dyn = m
    return level, dyn


def settle_peak(ctx: SimulationContext, out: EngineRun, dyn: int, *, cold: bool) -> None:
    """Set ``out``'s static bytes, pool and peak from its dynamic peak ``dyn`` (the
    activations and waiting gradients at their highest), with the ring of streamed-step
    buffers where it is held ([Note: streamed steps] in ``_engine``). ``cold``: a step
    started on an idle machine, whose peak is its memory curve's."""
    n_reg = ctx.num_regions
    device, codes, size = out.device_state, out.codes, ctx.size
    out.static_bytes = sum(
        (ctx.state_bytes[r] if device[r] else 0) + (size[r] if codes[r] == RESIDENT else 0)
        for r in range(n_reg)
    )
    assign_pool(ctx, out)
    curve_dyn = -1  # the memory curve's highest dynamic level, once walked
    if ctx.moves_activations:
        # HOST copies in flight and recomputations are events of the walk only
        # ([Note: activations] in ``_activations``).
        curve_dyn = curve_levels(ctx, out, math.inf)[0]
        dyn = out.dyn_peak_bytes = curve_dyn
    if out.stage_start is not None:
        curve_dyn, out.stage_level = curve_levels(ctx, out, out.stage_start)
    stream_dyn = stream_level(ctx, out, dyn)
    out.peak_bytes = out.static_bytes + out.pool_bytes + max(dyn, stream_dyn)
    if stream_dyn:
        out.stream_peak_bytes = out.static_bytes + out.pool_bytes + stream_dyn
        if cold:
            # The cold step's peak is its memory curve's, exactly: the level above can add
            # activations and gradients that meet only in sequence at one instant.
            if curve_dyn < 0:
                curve_dyn = curve_levels(ctx, out, math.inf)[0]
            out.peak_bytes = out.static_bytes + out.pool_bytes + curve_dyn


def overlaps(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> bool:
    """Whether two sets of half-open lifetimes share an instant."""
    return any(s1 < e2 and s2 < e1 for s1, e1 in a for s2, e2 in b)


def first_fit(order: Sequence[int], adjacent: dict[int, set[int]]) -> dict[int, int]:
    """Give each region, in ``order``, the lowest block none of its neighbours holds."""
    blocks: dict[int, int] = {}
    for r in order:
        used = {blocks[x] for x in adjacent[r] if x in blocks}
        b = 0
        while b in used:
            b += 1
        blocks[r] = b
    return blocks


def assign_pool(ctx: SimulationContext, out: EngineRun) -> None:
    """Coexistence of offloaded regions from their lifetimes, then first-fit blocks."""
    offloaded = [r for r, c in enumerate(out.codes) if c]
    adjacent: dict[int, set[int]] = {r: set() for r in offloaded}
    intervals = sorted((s, e, r) for r in offloaded for (s, e) in out.lifetimes[r] if e > s)
    active: list[tuple[float, int]] = []
    max_live = 0
    for s, e, r in intervals:
        active = [(ae, ar) for ae, ar in active if ae > s]
        for _, ar in active:
            if ar != r:
                adjacent[r].add(ar)
                adjacent[ar].add(r)
        active.append((e, r))
        max_live = max(max_live, len(active))
    if offloaded and max_live == 0:
        max_live = 1  # regions with empty lifetimes still need a block to exist in
    blocks = first_fit(offloaded, adjacent)
    out.adjacent = adjacent
    out.blocks = [blocks.get(r, -1) for r in range(ctx.num_regions)]
    out.num_blocks = max(blocks.values()) + 1 if blocks else 0
    out.max_live = max_live
    out.pool_bytes = out.num_blocks * ctx.block_size_bytes


def stream_level(ctx: SimulationContext, out: EngineRun, dyn: int) -> int:
    """Dynamic device bytes (above the static bytes and the pool) while the ring of
    streamed-step buffers is held, at most: 0 without streamed steps (see [Note:
    streamed steps]). This step's own window opens once every copy of a host-state
    gradient has landed (without ``host_step_after_backward``) or after backward: the
    ring, the activations of whatever backward is left (device-state regions) and the
    gradients still on their way down, which only leave by then. The previous step's, in
    a gated step, overlaps this step's forward: the ring and the forward's activations at
    their highest in the window (``dyn``, the whole step's, should it reach backward)."""
    slot = ctx.stream_slot_bytes
    level = 0
    if out.stream_window is not None:
        ws, we = out.stream_window
        waiting = sum(nbytes for _, _, copied, nbytes in out.grads if copied > ws)
        level = slot + _activations_max(ctx, out, ws, we) + waiting
    if out.carried_stream_window is not None:
        ws, we = out.carried_stream_window
        n_reg = ctx.num_regions
        if n_reg and we > out.ce_f[n_reg - 1]:
            level = max(level, slot + dyn)
        else:
            level = max(level, slot + _activations_max(ctx, out, ws, we))
    if out.stage_level is not None:
        level = max(level, out.stage_level)
    return level


def _activations_max(ctx: SimulationContext, out: EngineRun, ws: float, we: float) -> int:
    """Highest activation bytes of the step ``out`` in the half-open window ``[ws, we)``,
    as the memory curve counts them: an operation's level while it runs, what remains
    from its end until the next one starts (an instant level at ``ws`` counts)."""
    n_reg = ctx.num_regions
    saved, after_fwd = ctx.saved_prefix_bwd, ctx.saved_after
    act_fwd, act_bwd = ctx.act_fwd, ctx.act_bwd
    best = 0

    def scan(
        r: int, starts: float, offs: Sequence[float], end: float, nxt: float, fwd: bool
    ) -> bool:
        """Region r's operations, forward or backward; False once past ``we``."""
        nonlocal best
        last = len(offs) - 1
        for k, off in enumerate(offs):
            s = starts + off
            if s >= we:
                return False
            e = starts + offs[k + 1] if k < last else end
            if fwd:
                j = ctx.op_start[r] + k
                during, after = act_fwd[j], after_fwd[j]
            else:
                j = ctx.op_end[r] - 1 - k
                during, after = act_bwd[j], saved[j]
            if (e > ws or s >= ws) and during > best:
                best = during
            gap_end = e if k < last else nxt
            if e < we and (gap_end > ws or e >= ws) and after > best:
                best = after
        return True

    for r in range(n_reg):
        nxt = out.cs_f[r + 1] if r + 1 < n_reg else out.cs_b[n_reg - 1]
        if not scan(r, out.cs_f[r], ctx.fwd_offsets[r], out.ce_f[r], nxt, True):
            return best
    for r in range(n_reg - 1, -1, -1):
        nxt = out.cs_b[r - 1] if r > 0 else math.inf
        if not scan(r, out.cs_b[r], out.bwd_offsets[r], out.ce_b[r], nxt, False):
            return best
    return best


def memory_curves(
    ctx: SimulationContext, out: EngineRun
) -> tuple[tuple[MemorySample, ...], tuple[MemorySample, ...]]:
    """The step's memory curves: with offloaded regions in the pool, and counting them only
    while on the device (see :func:`_walk_memory`)."""
    static_pool = out.static_bytes + out.pool_bytes
    static_raw = out.static_bytes
    pool_samples: list[MemorySample] = [MemorySample(0.0, static_pool)]
    raw_samples: list[MemorySample] = [MemorySample(0.0, static_raw)]

    def record(time_s: float, dynamic: int, live: int) -> None:
        pool_samples.append(MemorySample(time_s, static_pool + dynamic))
        raw_samples.append(MemorySample(time_s, static_raw + live + dynamic))

    _walk_memory(ctx, out, record)
    return _compact(pool_samples), _compact(raw_samples)


def curve_levels(ctx: SimulationContext, out: EngineRun, since_s: float) -> tuple[int, int]:
    """The highest dynamic level of the pool memory curve of :func:`memory_curves`
    (activations, gradients and the ring; the static bytes and the pool not included),
    over the step and from ``since_s`` on, without building it (the solvers ask for it
    once per simulated streamed plan)."""
    peak = since = 0

    def record(time_s: float, dynamic: int, live: int) -> None:
        nonlocal peak, since
        if dynamic > peak:
            peak = dynamic
        if time_s >= since_s and dynamic > since:
            since = dynamic

    _walk_memory(ctx, out, record)
    return peak, since


def _walk_memory(
    ctx: SimulationContext, out: EngineRun, record: Callable[[float, int, int], None]
) -> None:
    """Walk the step in execution order, merging gradient and parameter events by time,
    and ``record(time_s, activations + gradients, offloaded bytes on the device)`` after
    every change (the static bytes and the pool not included).

    Events off the compute lane (copies ending, prefetches starting) at or before the
    moment of a compute-lane event are applied before it, removals before additions.
    """
    n_reg = ctx.num_regions
    # Off-lane events: (time, order, delta_grads, delta_params).
    side: list[tuple[float, int, int, int]] = []
    for _, _, copied, nbytes in out.grads:
        side.append((copied, 0, -nbytes, 0))
    if out.stream_window is not None:
        # The ring of streamed-step buffers, counted with the gradients (both curves).
        held = out.stream_window[0] if out.stage_start is None else out.stage_start
        side.append((held, 1, ctx.stream_slot_bytes, 0))
        side.append((out.stream_window[1], 0, -ctx.stream_slot_bytes, 0))
    for r in range(n_reg):
        for s, e in out.lifetimes[r]:
            # Held from its upload's start or prefetch's issue to the end of its compute.
            side.append((s, 1, 0, ctx.size[r]))
            side.append((e, 0, 0, -ctx.size[r]))
    act_host = ctx.act.host
    if any(act_host):
        # HOST activations: on the device from the copy back's start until the region's
        # backward, whose levels count them from its start ([Note: activations]).
        for r in range(n_reg):
            if act_host[r] and out.act_h2d_start[r] > NEVER:
                side.append((out.act_h2d_start[r], 1, ctx.act.saved_bytes[r], 0))
    heapq.heapify(side)
    act = 0
    grads = 0
    live = 0

    def emit(time_s: float) -> None:
        record(time_s, act + grads, live)

    def flush(time_s: float, *, inclusive: bool = True) -> None:
        nonlocal grads, live
        while side and (side[0][0] <= time_s if inclusive else side[0][0] < time_s):
            t, _, dg, dp = heapq.heappop(side)
            grads += dg
            live += dp
            emit(t)

    def forward_levels(
        r: int, start: float, end: float, during: Sequence[int], after: Sequence[int]
    ) -> None:
        """Region r's forward operations from ``start`` (the last ending at ``end``) at
        levels ``during`` and ``after`` (per operation): an operation sees what happened
        up to and including its start; what happens at the instant it ends is applied
        after its level drops."""
        nonlocal act
        offs = ctx.fwd_offsets[r]
        for k, off in enumerate(offs):
            j = ctx.op_start[r] + k
            ts = start + off
            te = start + offs[k + 1] if k + 1 < len(offs) else end
            flush(ts)
            act = during[j]
            emit(ts)
            flush(te, inclusive=False)
            act = after[j]
            emit(te)

    saved, saved_bwd = ctx.saved_prefix, ctx.saved_prefix_bwd
    for r in range(n_reg):
        forward_levels(r, out.cs_f[r], out.ce_f[r], ctx.act_fwd, ctx.saved_after)
        if act_host[r]:
            # Its saved bytes wait for their copy down, counted with the gradients.
            act = saved[ctx.op_start[r]]
            grads += ctx.act.saved_bytes[r]
            emit(out.ce_f[r])
            heapq.heappush(side, (out.act_d2h_end[r], 0, -ctx.act.saved_bytes[r], 0))
    adds = {r: nbytes for r, _, _, nbytes in out.grads}
    for r in range(n_reg - 1, -1, -1):
        if out.recompute_start[r] > NEVER:
            # The forward again, of the region's whole run: its levels as in a forward,
            # each region's saved bytes kept for its backward ([Note: activations]).
            t = out.recompute_start[r]
            for q in range(ctx.act.recompute_from[r], r + 1):
                end = out.cs_b[r] if q == r else t + ctx.fwd_s[q]
                forward_levels(q, t, end, ctx.act.act_rec, ctx.act.saved_after_bwd)
                t = end
        if act_host[r] and out.act_h2d_start[r] > NEVER:
            flush(out.cs_b[r])
            grads -= ctx.act.saved_bytes[r]  # from here on the backward's levels
        start = out.cs_b[r]
        offs = out.bwd_offsets[r]
        for k, off in enumerate(offs):
            j = ctx.op_end[r] - 1 - k
            ts = start + off
            te = start + offs[k + 1] if k + 1 < len(offs) else out.ce_b[r]
            flush(ts)
            act = ctx.act_bwd[j]
            emit(ts)
            flush(te, inclusive=False)
            act = saved_bwd[j]
            emit(te)
        end = out.ce_b[r]
        flush(end)
        if r in adds:
            grads += adds[r]
            emit(end)
    while side:
        flush(side[0][0])


def _compact(samples: list[MemorySample]) -> tuple[MemorySample, ...]:
    """Drop samples that repeat the previous level; keep same-time samples (short peaks)."""
    out: list[MemorySample] = []
    for m in samples:
        if out and out[-1].bytes == m.bytes:
            continue
        out.append(m)
    return tuple(out)


__all__ = [
    "assign_pool",
    "backward_level",
    "curve_levels",
    "first_fit",
    "memory_curves",
    "overlaps",
    "settle_peak",
    "stream_level",
]
