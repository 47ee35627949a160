"""One simulated training step: the forward, the backward, and the host work and device
steps that follow ([Note: step model] in ``_engine``; repeating steps: [Note: steady
state] in ``_steady``; STREAMED regions: [Note: streamed steps] in ``_engine``).

:func:`run` simulates one step of an assignment with a :class:`_Step`, which puts each
task on its lane (:class:`~offload_solver.simulators._timeline.Lanes`) in issue order.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING

from offload_solver.plan import StatePlacement
from offload_solver.simulators._context import RegionAssignment, SimulationContext
from offload_solver.simulators._memory import backward_level, settle_peak
from offload_solver.simulators._stream import StreamWork
from offload_solver.simulators._timeline import (
    ASYNC,
    CODES,
    KIND_ACT_FETCH,
    KIND_ACT_OFFLOAD,
    KIND_BWD,
    KIND_DEVICE_STEP,
    KIND_FWD,
    KIND_GRAD_OFFLOAD,
    KIND_HOST_STEP,
    KIND_PREFETCH,
    KIND_PUBLISH,
    KIND_RECOMPUTE,
    KIND_UPLOAD,
    LANE_COMPUTE,
    LANE_D2H,
    LANE_H2D,
    LANE_HOST,
    NEVER,
    RESIDENT,
    SYNC,
    EngineRun,
    Lanes,
)

if TYPE_CHECKING:
    from offload_solver.simulators._steady import Carry


def run(
    ctx: SimulationContext,
    assignment: Sequence[RegionAssignment],
    carry: Carry | None = None,
    *,
    optimizer_step: bool = True,
) -> EngineRun:
    """Simulate one step of an already validated ``assignment`` (see [Note: step model] in
    ``_engine``).

    Without ``carry`` the step starts on an idle machine (a cold step); with it, it starts
    as the previous step left things (see [Note: steady state] in ``_steady``).
    ``optimizer_step=False`` simulates a micro-batch that only accumulates gradients (see
    [Note: micro-batches] in ``_engine``): host-state regions' gradients are copied and
    accumulated on the host, and nothing steps. STREAMED regions: [Note: streamed steps]
    in ``_engine``.
    """
    step = _Step(ctx, assignment, carry, optimizer_step)
    step.forward()
    step.backward()
    step.after_backward()
    return step.out


class _Step:
    """One step being simulated: the lanes, the streamed work, and the per-region times it
    records in :attr:`out` as it goes."""

    def __init__(
        self,
        ctx: SimulationContext,
        assignment: Sequence[RegionAssignment],
        carry: Carry | None,
        optimizer_step: bool,
    ) -> None:
        n_reg = ctx.num_regions
        self.ctx = ctx
        self.n_reg = n_reg
        self.optimizer_step = optimizer_step
        out = self.out = EngineRun()
        out.codes = [CODES[a.placement] for a in assignment]
        out.device_state = [a.state is StatePlacement.DEVICE for a in assignment]
        self.streamed = [a.state is StatePlacement.STREAMED for a in assignment]
        out.prefetch_at = [a.prefetch_at if a.prefetch_at is not None else -1 for a in assignment]
        # [Note: the backward beside the host]: host-state regions slow the backward's issue.
        if all(out.device_state):
            self.bwd_s, out.bwd_offsets = ctx.bwd_s, ctx.bwd_offsets
        else:
            self.bwd_s, out.bwd_offsets = ctx.bwd_s_beside_host, ctx.bwd_offsets_beside_host
        out.lifetimes = [[] for _ in range(n_reg)]
        out.reach_f, out.cs_f, out.ce_f = [0.0] * n_reg, [0.0] * n_reg, [0.0] * n_reg
        out.f_task, out.pf_f_task = [-1] * n_reg, [-1] * n_reg
        out.h2d_free_at_reach_f = [0.0] * n_reg
        out.reach_b, out.cs_b, out.ce_b = [0.0] * n_reg, [0.0] * n_reg, [0.0] * n_reg
        out.b_task, out.pf_b_task, out.host_task = [-1] * n_reg, [-1] * n_reg, [-1] * n_reg
        out.stepped_early = [False] * n_reg
        out.h2d_free_after_b, out.h2d_pos_after_b = [0.0] * n_reg, [0] * n_reg
        out.update_end = [NEVER] * n_reg
        out.param_upload_end = [NEVER] * n_reg
        out.recompute_start = [NEVER] * n_reg
        out.act_d2h_end = [NEVER] * n_reg
        out.act_h2d_start = [NEVER] * n_reg
        self.act_fetch_task = [-1] * n_reg
        """Per HOST region, the task copying its activations back ([Note: activations])."""
        self.pf_issue = [0.0] * n_reg
        """When each region's current prefetch was issued."""
        self.lanes = Lanes(out, ctx.upload_s)
        self.streams = StreamWork(ctx, out, self.lanes, self.streamed)
        self.landed: deque[tuple[int, float, int]] = deque()
        """Host-state regions whose gradients are copied and whose host work is not placed
        yet: (region, copy end, d2h task), in copy order (the host worker's FIFO order)."""
        self.deferred: list[int] = []
        """Regions whose step waits to be queued in forward order."""
        self.hooks_ran = False
        """Whether a gradient hook ran in this step."""
        self.dyn = 0
        """The step's dynamic peak once the backward is placed: activations plus the
        gradients waiting for their copy."""
        self.gated = carry is not None
        self.gate: Sequence[float] = ()
        if carry is not None:
            lanes = self.lanes
            lanes.h2d_free, lanes.d2h_free = carry.h2d_free_s, carry.d2h_free_s
            lanes.host_free = carry.host_free_s
            self.gate = carry.gate_s
            lanes.pending.extend((s, r, -1) for s, r in carry.uploads)
            self.streams.carry_in(carry.streams)

    # ---- forward

    def forward(self) -> None:
        """Issue every region's forward in order, with its upload or prefetch, and the
        next region's forward prefetch; a gated step first waits for the previous step's
        updates (see [Note: steady state] in ``_steady``)."""
        ctx, out, lanes, streams = self.ctx, self.out, self.lanes, self.streams
        n_reg, gated, gate = self.n_reg, self.gated, self.gate
        codes, up, add = out.codes, ctx.upload_s, lanes.add
        pf_issue, pf_f_task, h2d_order = self.pf_issue, out.pf_f_task, lanes.h2d_order
        carried, carried_any = streams.carried, streams.carried_any
        if n_reg and codes[0] == ASYNC:
            if gated:
                # The prefetch call blocks the host until the region's update is done.
                if gate[0] > lanes.t:
                    lanes.t = gate[0]
                if carried_any and carried[0]:
                    streams.settle(0)
                streams.drain(lanes.t)
            t = lanes.t
            s = t if t > lanes.h2d_free else lanes.h2d_free
            e = s + up[0]
            lanes.last_h = pf_f_task[0] = add(LANE_H2D, 0, KIND_PREFETCH, s, e, lanes.last_h, -1)
            h2d_order.append(lanes.last_h)
            lanes.h2d_free = e
            pf_issue[0] = t
        for r in range(n_reg):
            q = r + 1
            prefetch_q = q < n_reg and codes[q] == ASYNC
            c = codes[r]
            if gated:
                # The host blocks before issuing region r's forward while the updates that
                # its upload (SYNC r) and region q's prefetch (issued before r's first
                # operation) read are still running: the compute lane cannot pass either.
                if c == SYNC and gate[r] > lanes.t:
                    lanes.t = gate[r]
                if prefetch_q and gate[q] > lanes.t:
                    lanes.t = gate[q]
                if carried_any:
                    if c == SYNC and carried[r]:
                        streams.settle(r)
                    if prefetch_q and carried[q]:
                        streams.settle(q)
                streams.drain(lanes.t)
            reach = lanes.t
            out.reach_f[r] = reach
            out.h2d_free_at_reach_f[r] = lanes.h2d_free
            if prefetch_q:
                pf_issue[q] = reach
                s = reach if reach > lanes.h2d_free else lanes.h2d_free
                e = s + up[q]
                lanes.last_h = pf_f_task[q] = add(
                    LANE_H2D, q, KIND_PREFETCH, s, e, lanes.last_h, lanes.last_c
                )
                h2d_order.append(lanes.last_h)
                lanes.h2d_free = e
            self._forward_region(r, c, reach)
        if gated:
            # This step's own post-step uploads are told apart from the carried ones by these.
            out.param_upload_end[:] = [NEVER] * n_reg
        window = streams.window
        if carried_any and window[1] > NEVER:
            out.carried_stream_window = (window[0], window[1])
            window[:] = [math.inf, NEVER]

    def _forward_region(self, r: int, c: int, reach: float) -> None:
        """Region r's forward (placement code ``c``) issued at ``reach``: its upload on
        the compute lane (SYNC), the wait for its prefetch (ASYNC) or, in a gated step,
        for its update (a RESIDENT host-state region), then its operations."""
        out, lanes = self.out, self.lanes
        wait_task = -1
        life_start = reach
        if c == SYNC:
            e = lanes.t + self.ctx.upload_s[r]
            lanes.last_c = lanes.add(LANE_COMPUTE, r, KIND_UPLOAD, lanes.t, e, lanes.last_c, -1)
            lanes.t = e
        elif c == ASYNC:
            wait_task = out.pf_f_task[r]
            life_start = self.pf_issue[r]
            pe = lanes.end[wait_task]
            if pe > lanes.t:
                lanes.t = pe
        elif self.gated:
            # A resident host-state region waits (on the host) for its update, then
            # (on the device) for the upload that update issued.
            streams = self.streams
            if self.gate[r] > lanes.t:
                lanes.t = self.gate[r]
            if streams.carried_any and streams.carried[r]:
                streams.settle(r)
            streams.drain(lanes.t)
            if out.param_upload_end[r] > lanes.t:
                lanes.t = out.param_upload_end[r]
        t = out.cs_f[r] = lanes.t
        e = t + self.ctx.fwd_s[r]
        lanes.last_c = out.f_task[r] = lanes.add(
            LANE_COMPUTE, r, KIND_FWD, t, e, lanes.last_c, wait_task
        )
        lanes.t = out.ce_f[r] = e
        if c:
            out.lifetimes[r].append((life_start, e))
        act = self.ctx.act
        if act.host[r]:
            # Its activations go down after its forward ([Note: activations]).
            s = e if e > lanes.d2h_free else lanes.d2h_free
            d = s + act.d2h_s[r]
            lanes.last_d = lanes.add(
                LANE_D2H, r, KIND_ACT_OFFLOAD, s, d, lanes.last_d, out.f_task[r]
            )
            lanes.d2h_free = out.act_d2h_end[r] = d

    # ---- backward

    def backward(self) -> None:
        """Issue every region's backward in reverse order, with its upload or backward
        prefetch and the prefetches it issues; copy host-state regions' gradients down
        and run their hooks as the step model says (see [Note: step model] in
        ``_engine``), tracking the activations' and waiting gradients' peak."""
        ctx, out, lanes, streams = self.ctx, self.out, self.lanes, self.streams
        n_reg, codes, device, numel = self.n_reg, out.codes, out.device_state, ctx.trainable
        optimizer_step = self.optimizer_step
        after_backward = ctx.host_step_after_backward
        up, bwd_s, add = ctx.upload_s, self.bwd_s, lanes.add
        saved_prefix, op_start, op_end = ctx.saved_prefix_bwd, ctx.op_start, ctx.op_end
        region_max, pf_issue = ctx.act_bwd_region_max, self.pf_issue
        recompute, act_host = ctx.act.recompute, ctx.act.host
        act_host_any = any(act_host)
        by_host: list[list[int]] = [[] for _ in range(n_reg)]
        for i in range(n_reg - 1, -1, -1):
            if codes[i] == ASYNC:
                by_host[out.prefetch_at[i]].append(i)
        # Gradients waiting on the device for their copy, (copy end, bytes) in copy order;
        # their bytes; the dynamic peak so far (activations plus waiting gradients).
        in_flight: deque[tuple[float, int]] = deque()
        level, dyn = 0, ctx.act_fwd_max
        landed = self.landed
        # Regions from this index down still copy gradients after their backward; below it
        # the last copy is known (``d2h_free``) and may already have landed at an issue
        # point, as when only device-state regions remain.
        last_copier = next((r for r in range(n_reg) if not device[r] and numel[r] > 0), -1)
        self._plan_host_work()
        for r in range(n_reg - 1, -1, -1):
            reach = lanes.t
            out.reach_b[r] = reach
            if landed and optimizer_step and not after_backward:
                # While a copy is still to come it lands at or after this issue point; once
                # none is, the hooks that run after the last one (even before this point)
                # leave their regions to step(): the runtime's backward-done event is on
                # the d2h stream.
                self.hooks_before(reach if r >= last_copier else lanes.d2h_free)
            if lanes.pending and lanes.pending[0][0] <= reach:
                streams.drain(reach)
            if streams.stage_issue <= reach:
                streams.place_stage()
            for i in by_host[r]:
                pf_issue[i] = reach
                s = reach if reach > lanes.h2d_free else lanes.h2d_free
                e = s + up[i]
                lanes.last_h = out.pf_b_task[i] = add(
                    LANE_H2D, i, KIND_PREFETCH, s, e, lanes.last_h, lanes.last_c
                )
                lanes.h2d_order.append(lanes.last_h)
                lanes.h2d_free = e
            if act_host_any:
                # Activations of HOST regions come back one region ahead, after the
                # parameter prefetches issued here; the last region's at its own start.
                if r == n_reg - 1 and act_host[r]:
                    self._fetch_activations(r, reach)
                if r > 0 and act_host[r - 1]:
                    self._fetch_activations(r - 1, reach)
            out.h2d_free_after_b[r] = lanes.h2d_free
            out.h2d_pos_after_b[r] = len(lanes.h2d_order)
            c = codes[r]
            wait_task = -1
            life_start = reach
            if c == SYNC:
                e = lanes.t + up[r]
                lanes.last_c = add(LANE_COMPUTE, r, KIND_UPLOAD, lanes.t, e, lanes.last_c, -1)
                lanes.t = e
            elif c == ASYNC:
                wait_task = out.pf_b_task[r]
                life_start = pf_issue[r]
                pe = lanes.end[wait_task]
                if pe > lanes.t:
                    lanes.t = pe
            if act_host_any and act_host[r]:
                fetch = self.act_fetch_task[r]
                if lanes.end[fetch] > lanes.t:
                    lanes.t = lanes.end[fetch]
                    wait_task = fetch
            if recompute[r]:
                # The forward again (of its whole run), parameters on the device
                # ([Note: activations]).
                e = lanes.t + ctx.recompute_s[r]
                out.recompute_start[r] = lanes.t
                lanes.last_c = add(
                    LANE_COMPUTE, r, KIND_RECOMPUTE, lanes.t, e, lanes.last_c, wait_task
                )
                lanes.t = e
                wait_task = -1
            start = out.cs_b[r] = lanes.t
            end = start + bwd_s[r]
            lanes.last_c = out.b_task[r] = add(
                LANE_COMPUTE, r, KIND_BWD, start, end, lanes.last_c, wait_task
            )
            lanes.t = out.ce_b[r] = end
            # Activations of this region's backward plus gradients still waiting for their
            # copy; a copy ending at or before an operation's start frees its bytes for it.
            if in_flight and in_flight[0][0] <= end:
                level, dyn = backward_level(
                    ctx, out.bwd_offsets[r], in_flight, r, start, end, level, dyn
                )
            elif op_end[r] > op_start[r]:
                m = region_max[r] + level
                if m > dyn:
                    dyn = m
            if not device[r] and numel[r] > 0:
                waiting = self._copy_gradient(r, end)
                if waiting:
                    in_flight.append((lanes.d2h_free, waiting))
                    level += waiting
            gap = saved_prefix[op_start[r]] + level
            if gap > dyn:
                dyn = gap
            if c:
                out.lifetimes[r].append((life_start, end))
        self.dyn = dyn

    def _fetch_activations(self, r: int, reach: float) -> None:
        """Issue the copy back of HOST region r's activations at ``reach``, on the H2D
        lane, no earlier than its copy down's end ([Note: activations])."""
        lanes, out = self.lanes, self.out
        s = reach if reach > lanes.h2d_free else lanes.h2d_free
        if out.act_d2h_end[r] > s:
            s = out.act_d2h_end[r]
        e = s + self.ctx.act.h2d_s[r]
        lanes.last_h = self.act_fetch_task[r] = lanes.add(
            LANE_H2D, r, KIND_ACT_FETCH, s, e, lanes.last_h, lanes.last_c
        )
        lanes.h2d_order.append(lanes.last_h)
        lanes.h2d_free = e
        out.act_h2d_start[r] = s

    def _copy_gradient(self, r: int, end: float) -> int:
        """Region r's gradient copy down after its backward ends at ``end``; returns the
        bytes that wait on the device until the copy ends (0 for a copy that takes no
        time). Its host work is placed by :meth:`hooks_before` at the next issue points,
        or after the backward: whether a region steps as it lands depends on when the
        backward ends."""
        lanes, size = self.lanes, self.ctx.grad_bytes[r]
        s = end if end > lanes.d2h_free else lanes.d2h_free
        e = s + self.ctx.grad_d2h_s[r]
        lanes.last_d = lanes.add(LANE_D2H, r, KIND_GRAD_OFFLOAD, s, e, lanes.last_d, lanes.last_c)
        lanes.d2h_free = e
        self.landed.append((r, e, lanes.last_d))
        self.hooks_ran = True
        if size and e > end:
            self.out.grads.append((r, end, e, size))
            return size
        return 0

    # ---- host work

    def _plan_host_work(self) -> None:
        """What the host worker's placements read: which regions may step in their hooks,
        and what those steps and copies cost (see [Note: step model] in ``_engine``)."""
        ctx, out = self.ctx, self.out
        n_reg, device, numel, streamed = self.n_reg, out.device_state, ctx.trainable, self.streamed
        # With the speculation thread, the host worker's own timeline: its gradient work
        # and hooks, not the speculative steps those hand over (which stay on the host
        # lane, whose cores they share). It decides when hooks run and when step() returns.
        self.spec_thread = (
            ctx.speculation_thread and self.optimizer_step and not ctx.host_step_after_backward
        )
        self.worker_free = self.lanes.host_free
        self.early_cost = ctx.speculative_step_cost / ctx.hardware.host_copy_contention
        # Regions that may step in their hooks: with a parameter limit, the host-state
        # regions from the last one down until the first that would pass it.
        # STREAMED regions never step speculatively and need no undo buffers.
        self.stream_any = self.optimizer_step and any(streamed)
        may_speculate = [not x for x in streamed] if self.stream_any else [True] * n_reg
        if ctx.speculative_params is not None:
            left = ctx.speculative_params
            for r in range(n_reg - 1, -1, -1):
                if device[r] or numel[r] == 0 or streamed[r]:
                    continue
                if numel[r] > left:
                    may_speculate[: r + 1] = [False] * (r + 1)
                    break
                left -= numel[r]
        self.may_speculate = may_speculate

    def grad_work_of(self, r: int, land: float, ready: int) -> tuple[float, int]:
        """Place region r's gradient work on the host worker; returns (when its
        gradient-ready hook runs: that work's end, the task its step waits for). The worker
        takes regions in copy order and waits for each copy, even with no work to do."""
        ctx, lanes, streams = self.ctx, self.lanes, self.streams
        e = land if land > lanes.host_free else lanes.host_free
        w_end = land if land > self.worker_free else self.worker_free
        for task_kind, w in (ctx.grad_work if self.optimizer_step else ctx.accumulate_work)[r]:
            s, e = e, e + w
            w_end += w
            lanes.last_o = ready = lanes.add(LANE_HOST, r, task_kind, s, e, lanes.last_o, ready)
        lanes.host_free = e
        self.worker_free = w_end
        if r == streams.stage_hook and self.optimizer_step:
            # Its hook opens the ring and stages (see [Note: streamed steps] in ``_engine``).
            streams.stage_issue, streams.stage_pred = (w_end if self.spec_thread else e), ready
        return e, ready

    def update(self, r: int, ready_s: float, pred: int, early: bool = False) -> None:
        """Place region r's Adam step (and publish), and queue its post-step upload.

        A step after backward costs its plain duration plus what its own copies of the step
        cost the host. An ``early`` one, taken in its gradient hook while backward runs,
        costs ``speculative_step_cost`` times the plain duration, all of it at the
        contended rate: see [Note: step model] in ``_engine``."""
        ctx, lanes, out = self.ctx, self.lanes, self.out
        s = ready_s if ready_s > lanes.host_free else lanes.host_free
        if early:
            e = s + ctx.host_step_s[r] * self.early_cost
            out.stepped_early[r] = True
        else:
            e = s + ctx.host_step_s[r]
            contention = ctx.copy_contention
            if contention:
                uploads = 1 if out.codes[r] == RESIDENT else 2
                e += contention * (ctx.grad_d2h_s[r] + uploads * ctx.upload_s[r])
        lanes.last_o = out.host_task[r] = lanes.add(
            LANE_HOST, r, KIND_HOST_STEP, s, e, lanes.last_o, pred
        )
        lanes.host_free = e
        if ctx.publishes:
            e = e + ctx.publish_s[r]
            lanes.last_o = lanes.add(
                LANE_HOST, r, KIND_PUBLISH, lanes.host_free, e, lanes.last_o, -1
            )
            lanes.host_free = e
        out.update_end[r] = e
        if out.codes[r] == RESIDENT:
            lanes.pending.append((e, r, lanes.last_o))

    def hooks_before(self, limit: float) -> None:
        """Without ``host_step_after_backward``: step, as their gradient work ends, the
        landed regions whose gradient-ready hook runs before ``limit`` (a moment known to
        come no later than the last copy's landing)."""
        landed, grad_work, lanes = self.landed, self.ctx.grad_work, self.lanes
        while landed:
            r, land, ready = landed[0]
            # When the step would start: with the speculation thread too, the thread
            # skips a step that would start after the last copy has landed (the region
            # then steps after the answer), and the steps take the host lane in turn.
            h = land if land > lanes.host_free else lanes.host_free
            for _, w in grad_work[r]:
                h += w
            if h >= limit:
                return
            landed.popleft()
            e, ready = self.grad_work_of(r, land, ready)
            if self.may_speculate[r]:
                self.update(r, e, ready, early=True)
            else:
                if self.stream_any and self.streamed[r]:
                    self.streams.pred[r] = ready
                self.deferred.append(r)  # no speculative buffers: steps after the last hook

    def _place_landed(self, bwd_end: float, bwd_task: int) -> tuple[float, int]:
        """Place the host work of the regions whose gradients landed but whose hooks have
        not run by the backward's end ``bwd_end`` (task ``bwd_task``); returns (when the
        deferred regions' job may start, the task it follows)."""
        lanes, streams, streamed = self.lanes, self.streams, self.streamed
        stream_any, deferred = self.stream_any, self.deferred
        if not self.optimizer_step:
            for r, land, ready in self.landed:
                self.grad_work_of(r, land, ready)
            return bwd_end, bwd_task
        if self.ctx.host_step_after_backward:
            # The global answer is known when backward ends: regions whose gradients are
            # ready after that step as they land; the others then, in forward order.
            for r, land, ready in self.landed:
                e, ready = self.grad_work_of(r, land, ready)
                if stream_any and streamed[r]:
                    streams.pred[r] = ready
                    if e > bwd_end:
                        # Issued in its hook, where a host-state region would step.
                        streams.late.append((e, r))
                        streams.charge_host(r, e, ready)
                    else:
                        deferred.append(r)
                elif e > bwd_end:
                    self.update(r, e, ready)
                else:
                    deferred.append(r)
            return bwd_end, bwd_task
        # A hook that runs once the last copy has landed leaves its region to step(),
        # which waits for every hook and then queues those regions in forward order.
        self.hooks_before(lanes.d2h_free)
        for r, land, ready in self.landed:
            e, ready = self.grad_work_of(r, land, ready)
            if stream_any and streamed[r]:
                streams.pred[r] = ready
            deferred.append(r)
        return lanes.host_free, lanes.last_o

    def after_backward(self) -> None:
        """What follows the backward: the remaining hooks, ``step()``'s job for the
        deferred regions (streamed ones issued first), the device-state steps on the
        compute lane, the streamed work, and the step's ends and memory."""
        ctx, out, lanes, streams = self.ctx, self.out, self.lanes, self.streams
        first_s, first_pred = self._place_landed(lanes.t, lanes.last_c)
        self.landed.clear()
        if streams.stage_issue < math.inf:  # the hook ran after the last issue point
            streams.drain(streams.stage_issue)
            streams.place_stage()
        # When step() returns, having queued the device-state steps (on the compute lane)
        # and the deferred host steps: at the end of backward, whose overflow answer it
        # syncs on; without after_backward, once every gradient-ready hook of this step
        # has run.
        spec_thread, stream_any, streamed = self.spec_thread, self.stream_any, self.streamed
        released = lanes.t
        hooks_end = self.worker_free if spec_thread else lanes.host_free
        if (
            self.optimizer_step
            and not ctx.host_step_after_backward
            and self.hooks_ran
            and hooks_end > lanes.t
        ):
            released = hooks_end
        # The deferred regions' job starts on the host worker once it is free: it issues
        # the streamed ones first, in forward order, then steps the others (see
        # [Note: streamed steps] in ``_engine``). With the speculation thread it starts
        # when step() returns, and waits for the speculative steps only after issuing the
        # streamed regions.
        if spec_thread:
            job_s = released
        else:
            job_s = first_s if first_s > lanes.host_free else lanes.host_free
        for r in sorted(self.deferred):
            if stream_any and streamed[r]:
                streams.charge_host(r, job_s if spec_thread else first_s, first_pred)
            else:
                self.update(r, first_s, first_pred)
        own = streams.late + [
            (job_s, r) for r in sorted(self.deferred) if stream_any and streamed[r]
        ]
        out.h2d_free_before_tail = lanes.h2d_free
        out.tail_uploads = [(issue, pr) for issue, pr, _ in lanes.pending]
        d2h_carried = lanes.d2h_free
        if not own:
            streams.drain(math.inf)
        lanes.t = released
        if self.optimizer_step:
            for r in range(self.n_reg):
                if out.device_state[r] and ctx.trainable[r]:
                    e = lanes.t + ctx.device_step_s[r]
                    lanes.last_c = lanes.add(
                        LANE_COMPUTE, r, KIND_DEVICE_STEP, lanes.t, e, lanes.last_c, -1
                    )
                    lanes.t = e
        compute_end = lanes.t
        if own:
            # After the device-state steps on the compute lane; in the steady state all of
            # it runs in the next step instead (carried as ``tail_streams``).
            out.tail_streams = own
            streams.ups.extend(own)
            streams.drain(math.inf)
            out.stream_window = (streams.window[0], streams.window[1])
        stream_end = lanes.t
        out.compute_end_s = compute_end
        out.host_free_end, out.d2h_free_end = lanes.host_free, d2h_carried
        out.step_time_s = max(
            compute_end, stream_end, lanes.h2d_free, lanes.d2h_free, lanes.host_free
        )
        out.dyn_peak_bytes = self.dyn
        settle_peak(ctx, out, self.dyn, cold=not self.gated)


__all__ = ["run"]
