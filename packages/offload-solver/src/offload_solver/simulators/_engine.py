"""The discrete-event model of one training step, shared by every simulator strategy.

[Note: step model]
One step runs the forward of regions 0..R-1, then their backward R-1..0, over four lanes:
COMPUTE (the device's compute stream), H2D and D2H (copy streams), HOST (the CPU running
the optimizer). Every lane runs one task at a time, in the order tasks were issued.

- RESIDENT parameters stay on the device.
- SYNC parameters are uploaded on the compute lane right before the region's forward and
  again right before its backward, and released after each.
- ASYNC parameters are prefetched on the H2D lane. Forward: region i's prefetch is issued
  when the compute lane reaches region i-1 (region 0's at the step start). Backward: it is
  issued when the compute lane reaches the backward of region ``prefetch_at`` (> i).
  Region i's compute waits for its prefetch. They are released like SYNC ones.
- After region i's backward, a HOST-state region copies its gradients to the host on D2H
  (``numel * host_grad_bytes_per_param``); its gradient (``size_bytes``) stays on the
  device until that copy ends. Then, on HOST (one worker: each task waits for the lane
  and for the one before it of the same region), as the runtime's host worker runs them:
  1. ``grad_widen``: the copied gradients widened into the fp32 accumulator, ``numel /
     host_convert_elems_per_s``; none when ``0 < host_grad_bytes_per_param < 4`` is false
     (the runtime sent fp32, widened on the device, or nothing crossed);
  2. ``grad_partial`` (only with ``host_step_after_backward``): the region's share of the
     global answer (overflow check or gradient norm), a pass reading the 4-byte fp32
     gradient, charged as one more conversion pass (``numel / host_convert_elems_per_s``).
     On the H200 (gpt2_xl, 1.48 G host-state parameters, 11e9 elements/s) widening plus
     partial charged this way take ~270 ms, as the measured host gradient work did: it ran
     through backward (137-164 ms) and ~130 ms past its end;
  3. ``host_step``: fused Adam, ``numel / host_adam_params_per_s``;
  4. ``publish``: the fp32 master cast into the training-dtype copy (pinned host
     parameters, or the upload buffer of a RESIDENT region), ``numel /
     host_convert_elems_per_s``; none when ``host_upload_bytes_per_param >= 4`` (the
     runtime uploads the fp32 master itself and narrows it on the device).
  Steps 1-2 run as the copy lands even when the step waits for the global answer; steps
  3-4 then run after the whole backward, in forward order. With
  ``host_convert_elems_per_s == 0`` (unknown) only the Adam step is charged. A RESIDENT
  region's updated parameters go back on H2D after its publish, or after its Adam step
  when there is none (offloaded regions are uploaded by the next forward anyway). H2D
  tasks issued at the same instant: parameter uploads issued so far, then prefetches
  (the region needed first first).
- Every upload above (sync upload, prefetch, post-step ``param_upload``) is of a
  HOST-state region (offloaded regions always keep their state on the host; device-state
  regions are RESIDENT and never uploaded), and moves ``size_bytes``, or ``numel *
  host_upload_bytes_per_param`` when that is > 0 (4: fp32 masters, narrowed on the
  device into the region's training-dtype buffer). Any device staging buffer the runtime
  narrows from is not charged to memory: only the copy time changes.
- DEVICE-state regions (RESIDENT only) keep ``numel * device_state_bytes_per_param``
  bytes on the device all step; their optimizer steps run on the compute lane after the
  whole backward.
- The step ends when the last lane goes idle.

Memory follows [Note: memory model] in ``offload_solver.model``. Offloaded regions live in
a device pool allocated once for the step: each takes one block of the layout's block size.
Two offloaded regions coexist when their device lifetimes overlap. A lifetime runs from
the moment a sync upload starts or a prefetch is issued (its block must be free then, even
if the H2D lane starts the copy later) to the end of the compute that uses the region, and
is half-open: a block released at an instant can be claimed at that instant. Issues and
releases are compute-lane moments, so a runtime sees them in this order. Blocks are
assigned by first fit in region order over the coexistence relation, opening another block
whenever no existing one is free, so placement never fails (the pool is then larger than
the lower bound, the most regions alive at once). The predicted peak is the
maximum over time of static bytes (resident parameters, device optimizer state, the pool)
+ activations + gradients waiting for their copy. The raw curve counts each offloaded
region only during its lifetimes, instead of the pool.

Compute is accounted per region (the sum of its operations' times); memory per operation,
so a gradient copy that ends in the middle of a region lowers the level of the operations
that start after it. An event at the same instant as an operation's start is seen by it.
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from offload_solver.model import (
    HardwareProfile,
    MemorySample,
    ModelProfile,
    ParamPlacement,
    Region,
    StatePlacement,
    Stream,
    TimelineInterval,
)
from offload_solver.regions import (
    BLOCK_SEARCH_RANGE_BYTES,
    BLOCK_SEARCH_STEP_BYTES,
    RegionLayout,
    build_regions,
)

RESIDENT, SYNC, ASYNC = 0, 1, 2
_CODES = {ParamPlacement.RESIDENT: RESIDENT, ParamPlacement.SYNC: SYNC, ParamPlacement.ASYNC: ASYNC}

LANE_COMPUTE, LANE_H2D, LANE_D2H, LANE_HOST = 0, 1, 2, 3
LANES = (Stream.COMPUTE, Stream.H2D, Stream.D2H, Stream.HOST)
KIND_FWD, KIND_BWD, KIND_UPLOAD, KIND_PREFETCH = 0, 1, 2, 3
KIND_GRAD_OFFLOAD, KIND_HOST_STEP, KIND_DEVICE_STEP, KIND_PARAM_UPLOAD = 4, 5, 6, 7
KIND_GRAD_WIDEN, KIND_GRAD_PARTIAL, KIND_PUBLISH = 8, 9, 10
KINDS = (
    "fwd",
    "bwd",
    "upload",
    "prefetch",
    "grad_offload",
    "host_step",
    "device_step",
    "param_upload",
    "grad_widen",
    "grad_partial",
    "publish",
)


@dataclass(frozen=True)
class RegionAssignment:
    """What a simulation is told about one region (a plan's decision without the pool)."""

    placement: ParamPlacement = ParamPlacement.RESIDENT
    state: StatePlacement = StatePlacement.HOST
    prefetch_at: int | None = None
    """ASYNC only: the region whose backward start issues this region's backward prefetch."""


@dataclass(frozen=True)
class SimulationResult:
    """Everything a simulation of one step predicts."""

    peak_bytes: int
    """Peak device bytes with offloaded regions held in the pool."""
    step_time_s: float
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


class SimulationContext:
    """Per-region and per-operation costs of one profile on one machine, computed once.

    Build it with :meth:`build`; simulators and solvers share it across many simulations.
    """

    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareProfile,
        layout: RegionLayout,
        *,
        host_step_after_backward: bool = False,
    ):
        self.profile = profile
        self.host_step_after_backward = host_step_after_backward
        """Host optimizer steps wait for the end of backward (then run in forward order):
        what an optimizer does when the step needs a global answer first (fp16 overflow
        check, global-norm clipping), whose per-region partial is then charged on the host
        as the gradients land. Otherwise each starts when its gradients land."""
        self.hardware = hardware
        self.layout = layout
        self.regions: tuple[Region, ...] = layout.regions
        self.block_size_bytes = layout.block_size_bytes
        regions = self.regions
        n_reg = len(regions)
        self.num_regions = n_reg
        ops = profile.operations
        hw = hardware

        self.size = [r.size_bytes for r in regions]
        self.numel = [r.numel for r in regions]
        self.pinned = [r.pinned for r in regions]
        self.op_start = [r.op_start for r in regions]
        self.op_end = [r.op_end for r in regions]
        # Only host-state regions are ever uploaded (see the note), so one list serves every
        # upload kind: the training-dtype copy, or what the runtime sends per element.
        per_elem = profile.host_upload_bytes_per_param
        self.upload_bytes = [n * per_elem for n in self.numel] if per_elem > 0 else list(self.size)
        """Per region, bytes one upload of its parameters moves host-to-device."""
        self.upload_s = [hw.h2d_time_s(b) for b in self.upload_bytes]
        self.grad_d2h_s = [hw.d2h_time_s(n * profile.host_grad_bytes_per_param) for n in self.numel]
        self.host_step_s = [n / hw.host_adam_params_per_s for n in self.numel]
        # Host conversion passes of a host-state region (see the note); zero when the rate
        # is unknown, so the engine can skip them with one test.
        widens = 0 < profile.host_grad_bytes_per_param < 4
        self.widen_s = [hw.host_convert_time_s(n) if widens else 0.0 for n in self.numel]
        self.partial_s = [
            hw.host_convert_time_s(n) if host_step_after_backward else 0.0 for n in self.numel
        ]
        # Uploading fp32 masters (narrowed on the device) leaves nothing to publish.
        self.publishes = hw.host_convert_elems_per_s > 0 and per_elem < 4
        """Whether host-state regions get a ``publish`` host task after their Adam step."""
        self.publish_s = [hw.host_convert_time_s(n) if self.publishes else 0.0 for n in self.numel]
        self.grad_work = [
            tuple((k, w) for k, w in ((KIND_GRAD_WIDEN, a), (KIND_GRAD_PARTIAL, b)) if w > 0.0)
            for a, b in zip(self.widen_s, self.partial_s, strict=True)
        ]
        """Per region, the host tasks (kind, seconds) run as its gradients land."""
        self.host_work_s = [
            a + b + c + d
            for a, b, c, d in zip(
                self.widen_s, self.partial_s, self.host_step_s, self.publish_s, strict=True
            )
        ]
        """Per region, all host-lane seconds of its optimizer work when its state is on
        the host: widening, partial, Adam and publish."""
        self.device_step_s = [n / hw.device_adam_params_per_s for n in self.numel]
        self.state_bytes = [n * profile.device_state_bytes_per_param for n in self.numel]

        fwd_op = [hw.op_time_s(op.fwd_flop) for op in ops]
        bwd_op = [hw.op_time_s(op.bwd_flop) for op in ops]
        saved = [0]
        for op in ops:
            saved.append(saved[-1] + op.saved_bytes)
        self.saved_prefix = saved
        """``saved_prefix[j]``: saved bytes of operations before ``j``."""
        self.act_fwd = [saved[j] + op.fwd_out_bytes + op.fwd_tmp_bytes for j, op in enumerate(ops)]
        self.act_bwd = [
            saved[j + 1] + op.bwd_out_bytes + op.bwd_tmp_bytes for j, op in enumerate(ops)
        ]
        self.act_fwd_max = max(self.act_fwd)

        # Start offsets of each region's operations from the region's compute start:
        # forward in operation order, backward in reverse operation order.
        self.fwd_offsets: list[list[float]] = []
        self.bwd_offsets: list[list[float]] = []
        self.fwd_s: list[float] = []
        self.bwd_s: list[float] = []
        self.act_bwd_region_max: list[int] = []
        for reg in regions:
            acc, offs = 0.0, []
            for j in range(reg.op_start, reg.op_end):
                offs.append(acc)
                acc += fwd_op[j]
            self.fwd_offsets.append(offs)
            self.fwd_s.append(acc)
            acc, offs = 0.0, []
            for j in range(reg.op_end - 1, reg.op_start - 1, -1):
                offs.append(acc)
                acc += bwd_op[j]
            self.bwd_offsets.append(offs)
            self.bwd_s.append(acc)
            self.act_bwd_region_max.append(max(self.act_bwd[reg.op_start : reg.op_end], default=0))
        self.fwd_op_s = fwd_op
        self.bwd_op_s = bwd_op

        # Sparse table for range maxima of backward activation levels.
        table = [self.act_bwd]
        width = 1
        while 2 * width <= len(ops):
            prev = table[-1]
            table.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2
        self._rmq = table

    @classmethod
    def build(
        cls,
        profile: ModelProfile,
        hardware: HardwareProfile,
        *,
        block_search_step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
        block_search_range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
        host_step_after_backward: bool = False,
    ) -> SimulationContext:
        """Linearise ``profile`` into regions (see ``offload_solver.regions``) and cost them."""
        layout = build_regions(
            profile, step_bytes=block_search_step_bytes, range_bytes=block_search_range_bytes
        )
        return cls(profile, hardware, layout, host_step_after_backward=host_step_after_backward)

    def act_bwd_max(self, lo: int, hi: int) -> int:
        """Largest backward activation level of operations ``lo..hi-1`` (``lo < hi``)."""
        k = (hi - lo).bit_length() - 1
        row = self._rmq[k]
        a, b = row[lo], row[hi - (1 << k)]
        return a if a >= b else b

    def validate(self, assignment: Sequence[RegionAssignment], *, allow_async: bool) -> None:
        """Raise ``ValueError`` naming the region when ``assignment`` cannot be simulated."""
        n = self.num_regions
        if len(assignment) != n:
            raise ValueError(
                f"assignment has {len(assignment)} entries; the layout has {n} regions"
            )
        for r, a in enumerate(assignment):
            if a.placement is not ParamPlacement.RESIDENT:
                if self.pinned[r]:
                    raise ValueError(
                        f"region {r} is pinned (it owns a parameter used outside its operations) "
                        f"and cannot be {a.placement.value}; keep it resident"
                    )
                if a.state is StatePlacement.DEVICE:
                    raise ValueError(
                        f"region {r} is {a.placement.value} with device optimizer state; "
                        "device state is only allowed for resident regions"
                    )
            if a.placement is ParamPlacement.ASYNC:
                if not allow_async:
                    raise ValueError(
                        f"region {r} is async, which this simulator does not model; "
                        "use the 'async' simulator"
                    )
                p = a.prefetch_at
                if r == n - 1:
                    raise ValueError(
                        f"region {r} is the last region and cannot be prefetched in backward; "
                        "make it sync"
                    )
                if not isinstance(p, int) or isinstance(p, bool) or not r < p < n:
                    raise ValueError(
                        f"region {r} is async with prefetch_at={p!r}; it must be a later "
                        f"region index in {r + 1}..{n - 1}"
                    )
            elif a.prefetch_at is not None:
                raise ValueError(
                    f"region {r} is {a.placement.value} but has prefetch_at={a.prefetch_at}; "
                    "only async regions are prefetched"
                )


class EngineRun:
    """The raw outcome of one simulated step (tasks, region times, pool, peak).

    Internal to the solver package: solvers read the per-region times to estimate the
    effect of a change, and :func:`to_result` turns a run into a ``SimulationResult``.
    """

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.device_state: list[bool] = []
        self.prefetch_at: list[int] = []
        # Tasks, in an order where every task comes after its predecessors.
        self.lane: list[int] = []
        self.region: list[int] = []
        self.kind: list[int] = []
        self.start: list[float] = []
        self.end: list[float] = []
        self.pred_a: list[int] = []
        self.pred_b: list[int] = []
        # Per region.
        self.reach_f: list[float] = []
        self.cs_f: list[float] = []
        self.ce_f: list[float] = []
        self.reach_b: list[float] = []
        self.cs_b: list[float] = []
        self.ce_b: list[float] = []
        self.f_task: list[int] = []
        self.b_task: list[int] = []
        self.pf_f_task: list[int] = []
        self.pf_b_task: list[int] = []
        self.host_task: list[int] = []
        self.h2d_free_at_reach_f: list[float] = []
        """H2D lane free time when the compute lane reaches region r's forward."""
        self.h2d_free_after_b: list[float] = []
        """H2D lane free time after the issues at region r's backward start."""
        self.h2d_pos_after_b: list[int] = []
        """Number of H2D tasks issued up to and including region r's backward start."""
        self.h2d_order: list[int] = []
        self.lifetimes: list[list[tuple[float, float]]] = []
        self.grads: list[tuple[int, float, float, int]] = []
        """(region, added, copied, bytes) of each gradient waiting on the device for its copy."""
        self.step_time_s = 0.0
        self.dyn_peak_bytes = 0
        self.static_bytes = 0
        """Resident parameters + device optimizer state (the pool not included)."""
        self.blocks: list[int] = []
        """Per region, its pool block (-1 for resident regions)."""
        self.num_blocks = 0
        self.max_live = 0
        self.adjacent: dict[int, set[int]] = {}
        self.pool_bytes = 0
        self.peak_bytes = 0


def run(ctx: SimulationContext, assignment: Sequence[RegionAssignment]) -> EngineRun:
    """Simulate one step of an already validated ``assignment`` (see [Note: step model])."""
    n_reg = ctx.num_regions
    out = EngineRun()
    codes = [_CODES[a.placement] for a in assignment]
    device = [a.state is StatePlacement.DEVICE for a in assignment]
    pf_at = [a.prefetch_at if a.prefetch_at is not None else -1 for a in assignment]
    out.codes, out.device_state, out.prefetch_at = codes, device, pf_at
    up, fwd_s, bwd_s = ctx.upload_s, ctx.fwd_s, ctx.bwd_s

    lane, region, kind = out.lane, out.region, out.kind
    t_start, t_end, pred_a, pred_b = out.start, out.end, out.pred_a, out.pred_b
    # Bound methods looked up once: ``add`` runs for every task of every simulation.
    lane_add, region_add, kind_add = lane.append, region.append, kind.append
    start_add, end_add, pa_add, pb_add = t_start.append, t_end.append, pred_a.append, pred_b.append

    def add(ln: int, r: int, kd: int, s: float, e: float, pa: int, pb: int) -> int:
        lane_add(ln)
        region_add(r)
        kind_add(kd)
        start_add(s)
        end_add(e)
        pa_add(pa)
        pb_add(pb)
        return len(lane) - 1

    lifetimes: list[list[tuple[float, float]]] = [[] for _ in range(n_reg)]
    out.lifetimes = lifetimes
    reach_f = [0.0] * n_reg
    cs_f = [0.0] * n_reg
    ce_f = [0.0] * n_reg
    f_task = [-1] * n_reg
    pf_f_task = [-1] * n_reg
    free_at_reach_f = [0.0] * n_reg
    h2d_order = out.h2d_order

    # ---- forward
    t = 0.0
    last_c = -1
    h2d_free = 0.0
    last_h = -1
    pf_issue = [0.0] * n_reg  # when each region's current prefetch was issued
    if n_reg and codes[0] == ASYNC:
        e = up[0]
        last_h = pf_f_task[0] = add(LANE_H2D, 0, KIND_PREFETCH, 0.0, e, -1, -1)
        h2d_order.append(last_h)
        h2d_free = e
    for r in range(n_reg):
        reach = t
        reach_f[r] = reach
        free_at_reach_f[r] = h2d_free
        q = r + 1
        if q < n_reg and codes[q] == ASYNC:
            pf_issue[q] = reach
            s = reach if reach > h2d_free else h2d_free
            e = s + up[q]
            last_h = pf_f_task[q] = add(LANE_H2D, q, KIND_PREFETCH, s, e, last_h, last_c)
            h2d_order.append(last_h)
            h2d_free = e
        c = codes[r]
        wait_task = -1
        life_start = reach
        if c == SYNC:
            e = t + up[r]
            last_c = add(LANE_COMPUTE, r, KIND_UPLOAD, t, e, last_c, -1)
            t = e
        elif c == ASYNC:
            wait_task = pf_f_task[r]
            life_start = pf_issue[r]
            pe = t_end[wait_task]
            if pe > t:
                t = pe
        cs_f[r] = t
        e = t + fwd_s[r]
        last_c = f_task[r] = add(LANE_COMPUTE, r, KIND_FWD, t, e, last_c, wait_task)
        t = ce_f[r] = e
        if c:
            lifetimes[r].append((life_start, e))

    # ---- backward
    by_host: list[list[int]] = [[] for _ in range(n_reg)]
    for i in range(n_reg - 1, -1, -1):
        if codes[i] == ASYNC:
            by_host[pf_at[i]].append(i)
    reach_b = [0.0] * n_reg
    cs_b = [0.0] * n_reg
    ce_b = [0.0] * n_reg
    b_task = [-1] * n_reg
    pf_b_task = [-1] * n_reg
    host_task = [-1] * n_reg
    free_after_b = [0.0] * n_reg
    pos_after_b = [0] * n_reg
    pending: deque[tuple[float, int, int]] = deque()  # (issue time, region, host task)
    d2h_free = host_free = 0.0
    last_d = last_o = -1
    in_flight: deque[tuple[float, int]] = deque()  # (copy end, bytes), in copy order
    level = 0
    dyn = ctx.act_fwd_max
    size, numel = ctx.size, ctx.numel
    gd, hs = ctx.grad_d2h_s, ctx.host_step_s
    grad_work, publish_s = ctx.grad_work, ctx.publish_s
    publishes = ctx.publishes
    saved_prefix, op_start, op_end = ctx.saved_prefix, ctx.op_start, ctx.op_end
    bwd_offsets, region_max = ctx.bwd_offsets, ctx.act_bwd_region_max
    grads = out.grads
    after_backward = ctx.host_step_after_backward
    deferred: list[tuple[int, float, int]] = []  # (region, gradients landed, d2h task)
    for r in range(n_reg - 1, -1, -1):
        reach = t
        reach_b[r] = reach
        while pending and pending[0][0] <= reach:
            issue, pr, ht = pending.popleft()
            s = issue if issue > h2d_free else h2d_free
            e = s + up[pr]
            last_h = add(LANE_H2D, pr, KIND_PARAM_UPLOAD, s, e, last_h, ht)
            h2d_order.append(last_h)
            h2d_free = e
        for i in by_host[r]:
            pf_issue[i] = reach
            s = reach if reach > h2d_free else h2d_free
            e = s + up[i]
            last_h = pf_b_task[i] = add(LANE_H2D, i, KIND_PREFETCH, s, e, last_h, last_c)
            h2d_order.append(last_h)
            h2d_free = e
        free_after_b[r] = h2d_free
        pos_after_b[r] = len(h2d_order)
        c = codes[r]
        wait_task = -1
        life_start = reach
        if c == SYNC:
            e = t + up[r]
            last_c = add(LANE_COMPUTE, r, KIND_UPLOAD, t, e, last_c, -1)
            t = e
        elif c == ASYNC:
            wait_task = pf_b_task[r]
            life_start = pf_issue[r]
            pe = t_end[wait_task]
            if pe > t:
                t = pe
        start = cs_b[r] = t
        end = start + bwd_s[r]
        last_c = b_task[r] = add(LANE_COMPUTE, r, KIND_BWD, start, end, last_c, wait_task)
        t = ce_b[r] = end

        # Activations of this region's backward plus gradients still waiting for their copy;
        # a copy ending at or before an operation's start frees its bytes for that operation.
        if in_flight and in_flight[0][0] <= end:
            offs = bwd_offsets[r]
            n_ops = len(offs)
            hi_op = op_end[r]
            pos = 0
            while in_flight and in_flight[0][0] <= end:
                g_end, g_bytes = in_flight.popleft()
                if g_end > start:
                    # First operation (in backward order) starting at or after g_end.
                    lo_k, hi_k = pos, n_ops
                    while lo_k < hi_k:
                        mid = (lo_k + hi_k) // 2
                        if g_end <= start + offs[mid]:
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
        elif op_end[r] > op_start[r]:
            m = region_max[r] + level
            if m > dyn:
                dyn = m

        if not device[r] and numel[r] > 0:
            s = end if end > d2h_free else d2h_free
            e = s + gd[r]
            last_d = add(LANE_D2H, r, KIND_GRAD_OFFLOAD, s, e, last_d, last_c)
            d2h_free = e
            if size[r] and e > end:  # a copy that takes no time leaves nothing waiting
                in_flight.append((e, size[r]))
                grads.append((r, end, e, size[r]))
                level += size[r]
            ready = last_d  # the task after which the region's gradients are usable
            # Gradient work on the host worker as the copy lands, even when the step itself
            # waits for the end of backward.
            for task_kind, w in grad_work[r]:
                s = e if e > host_free else host_free
                e = s + w
                last_o = ready = add(LANE_HOST, r, task_kind, s, e, last_o, ready)
                host_free = e
            if after_backward:
                deferred.append((r, e, ready))
            else:
                s = e if e > host_free else host_free
                e = s + hs[r]
                last_o = host_task[r] = add(LANE_HOST, r, KIND_HOST_STEP, s, e, last_o, ready)
                host_free = e
                if publishes:
                    e = e + publish_s[r]
                    last_o = add(LANE_HOST, r, KIND_PUBLISH, host_free, e, last_o, -1)
                    host_free = e
                if c == RESIDENT:
                    pending.append((e, r, last_o))
        gap = saved_prefix[op_start[r]] + level
        if gap > dyn:
            dyn = gap
        if c:
            lifetimes[r].append((life_start, end))
    # Host steps that waited for the global answer: after backward, in forward order.
    bwd_end, bwd_task = t, last_c
    for r, landed, ready in sorted(deferred):
        s = max(landed, bwd_end, host_free)
        e = s + hs[r]
        last_o = host_task[r] = add(
            LANE_HOST, r, KIND_HOST_STEP, s, e, last_o, ready if landed > bwd_end else bwd_task
        )
        host_free = e
        if publishes:
            e = e + publish_s[r]
            last_o = add(LANE_HOST, r, KIND_PUBLISH, host_free, e, last_o, -1)
            host_free = e
        if codes[r] == RESIDENT:
            pending.append((e, r, last_o))
    while pending:
        issue, pr, ht = pending.popleft()
        s = issue if issue > h2d_free else h2d_free
        e = s + up[pr]
        last_h = add(LANE_H2D, pr, KIND_PARAM_UPLOAD, s, e, last_h, ht)
        h2d_order.append(last_h)
        h2d_free = e
    for r in range(n_reg):
        if device[r]:
            e = t + ctx.device_step_s[r]
            last_c = add(LANE_COMPUTE, r, KIND_DEVICE_STEP, t, e, last_c, -1)
            t = e

    out.reach_f, out.cs_f, out.ce_f, out.f_task, out.pf_f_task = (
        reach_f,
        cs_f,
        ce_f,
        f_task,
        pf_f_task,
    )
    out.reach_b, out.cs_b, out.ce_b, out.b_task, out.pf_b_task = (
        reach_b,
        cs_b,
        ce_b,
        b_task,
        pf_b_task,
    )
    out.host_task = host_task
    out.h2d_free_at_reach_f = free_at_reach_f
    out.h2d_free_after_b, out.h2d_pos_after_b = free_after_b, pos_after_b
    out.step_time_s = max(t, h2d_free, d2h_free, host_free)
    out.dyn_peak_bytes = dyn
    out.static_bytes = sum(
        (ctx.state_bytes[r] if device[r] else 0) + (size[r] if codes[r] == RESIDENT else 0)
        for r in range(n_reg)
    )
    _assign_pool(ctx, out)
    out.peak_bytes = out.static_bytes + out.pool_bytes + dyn
    return out


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


def _assign_pool(ctx: SimulationContext, out: EngineRun) -> None:
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


def slack(out: EngineRun) -> list[float]:
    """Per task, how much later it could start without ending the step later.

    Critical-path analysis over the run's tasks with their issue order fixed: each task
    depends on the previous task of its lane and on the task it waits for.
    """
    n = len(out.start)
    horizon = out.step_time_s
    latest_finish = [horizon] * n
    result = [0.0] * n
    start, end, pa, pb = out.start, out.end, out.pred_a, out.pred_b
    for x in range(n - 1, -1, -1):
        ls = latest_finish[x] - (end[x] - start[x])
        sl = ls - start[x]
        result[x] = sl if sl > 0.0 else 0.0
        a = pa[x]
        if a >= 0 and ls < latest_finish[a]:
            latest_finish[a] = ls
        b = pb[x]
        if b >= 0 and ls < latest_finish[b]:
            latest_finish[b] = ls
    return result


def to_result(ctx: SimulationContext, out: EngineRun) -> SimulationResult:
    """Expand a run into per-lane intervals and per-operation memory curves."""
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
    pool_curve, raw_curve = _memory_curves(ctx, out)
    pairs = sorted((a, b) for a, nbrs in out.adjacent.items() for b in nbrs if a < b)
    raw_peak = max(m.bytes for m in raw_curve)
    return SimulationResult(
        peak_bytes=out.peak_bytes,
        step_time_s=out.step_time_s,
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


def _memory_curves(
    ctx: SimulationContext, out: EngineRun
) -> tuple[tuple[MemorySample, ...], tuple[MemorySample, ...]]:
    """Walk the step in execution order, merging gradient and parameter events by time.

    Events off the compute lane (copies ending, prefetches starting) at or before the
    moment of a compute-lane event are applied before it, removals before additions.
    """
    n_reg = ctx.num_regions
    static_pool = out.static_bytes + out.pool_bytes
    static_raw = out.static_bytes
    # Off-lane events: (time, order, delta_grads, delta_params).
    side: list[tuple[float, int, int, int]] = []
    for _, _, copied, nbytes in out.grads:
        side.append((copied, 0, -nbytes, 0))
    for r in range(n_reg):
        for s, e in out.lifetimes[r]:
            # Held from its upload's start or prefetch's issue to the end of its compute.
            side.append((s, 1, 0, ctx.size[r]))
            side.append((e, 0, 0, -ctx.size[r]))
    heapq.heapify(side)
    act = 0
    grads = 0
    live = 0
    pool_samples: list[MemorySample] = [MemorySample(0.0, static_pool)]
    raw_samples: list[MemorySample] = [MemorySample(0.0, static_raw)]

    def emit(time_s: float) -> None:
        pool_samples.append(MemorySample(time_s, static_pool + act + grads))
        raw_samples.append(MemorySample(time_s, static_raw + live + act + grads))

    def flush(time_s: float, *, inclusive: bool = True) -> None:
        nonlocal grads, live
        while side and (side[0][0] <= time_s if inclusive else side[0][0] < time_s):
            t, _, dg, dp = heapq.heappop(side)
            grads += dg
            live += dp
            emit(t)

    # An operation sees what happened up to and including its start; what happens at the
    # instant it ends is applied after its level drops.
    saved = ctx.saved_prefix
    for r in range(n_reg):
        start = out.cs_f[r]
        offs = ctx.fwd_offsets[r]
        for k, off in enumerate(offs):
            j = ctx.op_start[r] + k
            ts = start + off
            te = start + offs[k + 1] if k + 1 < len(offs) else out.ce_f[r]
            flush(ts)
            act = ctx.act_fwd[j]
            emit(ts)
            flush(te, inclusive=False)
            act = saved[j + 1]
            emit(te)
    adds = {r: nbytes for r, _, _, nbytes in out.grads}
    for r in range(n_reg - 1, -1, -1):
        start = out.cs_b[r]
        offs = ctx.bwd_offsets[r]
        for k, off in enumerate(offs):
            j = ctx.op_end[r] - 1 - k
            ts = start + off
            te = start + offs[k + 1] if k + 1 < len(offs) else out.ce_b[r]
            flush(ts)
            act = ctx.act_bwd[j]
            emit(ts)
            flush(te, inclusive=False)
            act = saved[j]
            emit(te)
        end = out.ce_b[r]
        flush(end)
        if r in adds:
            grads += adds[r]
            emit(end)
    while side:
        flush(side[0][0])
    return _compact(pool_samples), _compact(raw_samples)


def _compact(samples: list[MemorySample]) -> tuple[MemorySample, ...]:
    """Drop samples that repeat the previous level; keep same-time samples (short peaks)."""
    out: list[MemorySample] = []
    for m in samples:
        if out and out[-1].bytes == m.bytes:
            continue
        out.append(m)
    return tuple(out)
