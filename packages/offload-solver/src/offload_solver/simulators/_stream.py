"""STREAMED regions' work in a simulated step: their state's copies up and down around a
device step, the ring of device buffers, staging in the backward, and what their copies
cost the host ([Note: streamed steps] in ``_engine``).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

from offload_solver.plan import StreamedStepCosts
from offload_solver.simulators._context import SimulationContext
from offload_solver.simulators._timeline import (
    KIND_STREAM_CONTENTION,
    KIND_STREAM_DOWN,
    KIND_STREAM_STAGE,
    KIND_STREAM_STEP,
    KIND_STREAM_UP,
    LANE_COMPUTE,
    LANE_D2H,
    LANE_H2D,
    LANE_HOST,
    NEVER,
    RESIDENT,
    EngineRun,
    Lanes,
)


class StreamWork:
    """The streamed regions' work of one step as it is put on the lanes, in the order of
    [Note: streamed steps] in ``_engine``, and the H2D lane's queue it shares with the
    post-step uploads (:meth:`drain`)."""

    def __init__(
        self, ctx: SimulationContext, out: EngineRun, lanes: Lanes, streamed: Sequence[bool]
    ) -> None:
        n_reg = ctx.num_regions
        self.out = out
        self.lanes = lanes
        self.codes = out.codes
        self.ups: deque[tuple[float, int]] = deque()
        """State copies up not yet on the H2D lane: (issue, region), in issue order."""
        self.steps: deque[tuple[float, int, int]] = deque()
        """Device steps whose state is up: (copy up's end, region, copy up's task)."""
        self.pubs: deque[tuple[float, int, int]] = deque()
        """Post-step uploads of RESIDENT streamed regions: (issue: the copy down's end,
        region, copy down's task)."""
        self.gate = [math.inf] * n_reg
        """Per region, when its copy down ends (inf until it is placed)."""
        self.ready = [math.inf] * n_reg
        """With ``writes_resident``: when a RESIDENT streamed region's device step, which
        wrote its parameters, ends (inf until placed); its forward waits for that."""
        self.writes_resident = ctx.stream_writes_resident
        self.down_resident_s = ctx.stream_down_resident_s
        self.pred = [-1] * n_reg
        """Per region, the task its state's copy up waits for (its gradient hook's)."""
        self.late: list[tuple[float, int]] = []
        """(issue, region) of the streamed steps issued in their hooks."""
        self.window = [math.inf, NEVER]
        """(first copy up's start, last copy down's end)."""
        self.up_s = ctx.stream_up_s
        self.down_s = ctx.stream_down_s
        self.device_step_s = ctx.device_step_s
        self.grad_d2h_s = ctx.grad_d2h_s
        self.upload_s = ctx.upload_s
        self.contention = ctx.stream_copy_contention
        # Staging in the backward (see the note): the region whose hook opens the ring,
        # the first staged region, the staged state's copy up, and when and after which
        # task the hook issues it (inf: not yet).
        self.stage_hook, self.stage_first, self.stage_s = -1, -1, 0.0
        self.stage_issue, self.stage_pred = math.inf, -1
        if ctx.streamed is not None and ctx.streamed.staged_chunks and any(streamed):
            self.stage_hook, self.stage_first, self.stage_s, self.up_s = stage_split(
                ctx, ctx.streamed, streamed
            )
        self.carried = [False] * n_reg
        """Per region, whether the previous step's streamed step of it runs in this one."""
        self.carried_any = False

    def carry_in(self, streams: Sequence[tuple[float, int]]) -> None:
        """Queue the previous step's streamed steps, (issue, region) in issue order: all of
        their work runs in this step."""
        if streams:
            self.ups.extend(streams)
            for _, r in streams:
                self.carried[r] = True
            self.carried_any = True

    def queued(self) -> bool:
        """Whether streamed work waits for a lane."""
        return bool(self.ups or self.steps or self.pubs)

    def step_next(self) -> None:
        """Put the first device step whose state is up on the compute lane, as soon as both
        are free, and its state's copy down on D2H after it."""
        lanes = self.lanes
        ue, pr, ut = self.steps.popleft()
        cf = lanes.end[lanes.last_c] if lanes.last_c >= 0 else 0.0
        s = ue if ue > cf else cf
        e = s + self.device_step_s[pr]
        lanes.last_c = lanes.add(LANE_COMPUTE, pr, KIND_STREAM_STEP, s, e, lanes.last_c, ut)
        if e > lanes.t:
            lanes.t = e
        resident = self.codes[pr] == RESIDENT
        if resident and self.writes_resident:
            self.ready[pr] = e
        s = e if e > lanes.d2h_free else lanes.d2h_free
        e = s + (self.down_resident_s if resident else self.down_s)[pr]
        lanes.last_d = lanes.add(LANE_D2H, pr, KIND_STREAM_DOWN, s, e, lanes.last_d, lanes.last_c)
        lanes.d2h_free = self.gate[pr] = e
        if e > self.window[1]:
            self.window[1] = e
        if resident and not self.writes_resident:
            self.pubs.append((e, pr, lanes.last_d))

    def drain(self, until: float) -> None:
        """Put what is queued for the H2D lane and issued by ``until`` on it: the post-step
        uploads alone (:meth:`Lanes.drain_uploads`) unless streamed work is queued."""
        if self.ups or self.steps or self.pubs:
            self._drain_streamed(until)
        else:
            self.lanes.drain_uploads(until)

    def _drain_streamed(self, until: float) -> None:
        """:meth:`drain` while streamed work is queued: the device steps whose state is up
        by ``until``, then the H2D task issued first (post-step uploads before streamed
        ones, and those before copies up, on ties), until none issued by ``until`` is
        left."""
        lanes = self.lanes
        pending, pubs, ups, steps = lanes.pending, self.pubs, self.ups, self.steps
        while True:
            if steps and steps[0][0] <= until:
                self.step_next()
                continue
            first, src = until, 0
            if pending and pending[0][0] <= first:
                first, src = pending[0][0], 1
            if pubs and pubs[0][0] <= first and (src == 0 or pubs[0][0] < first):
                first, src = pubs[0][0], 2
            if ups and ups[0][0] <= first and (src == 0 or ups[0][0] < first):
                src = 3
            if src == 0:
                return
            if src == 3:
                issue, pr = ups.popleft()
                s = issue if issue > lanes.h2d_free else lanes.h2d_free
                e = s + self.up_s[pr]
                lanes.last_h = lanes.add(
                    LANE_H2D, pr, KIND_STREAM_UP, s, e, lanes.last_h, self.pred[pr]
                )
                lanes.h2d_order.append(lanes.last_h)
                lanes.h2d_free = e
                steps.append((e, pr, lanes.last_h))
                if s < self.window[0]:
                    self.window[0] = s
                continue
            issue, pr, ht = pending.popleft() if src == 1 else pubs.popleft()
            lanes.place_upload(issue, pr, ht)

    def settle(self, r: int) -> None:
        """The host blocks until region r's streamed step, carried from the previous step,
        is back down; meanwhile the lanes run the streamed work queued before it. A
        RESIDENT region whose device step wrote its parameters (``writes_resident``) waits,
        on the device, for that step only."""
        until = self.ready if self.writes_resident and self.codes[r] == RESIDENT else self.gate
        while until[r] == math.inf and (self.steps or self.ups):
            if self.steps:
                self.step_next()
            else:
                self._drain_streamed(self.ups[0][0])
        if until[r] > self.lanes.t:
            self.lanes.t = until[r]

    def place_stage(self) -> None:
        """Put the staged state's copy up on the H2D lane, issued at ``stage_issue``."""
        lanes = self.lanes
        issue = self.stage_issue
        s = issue if issue > lanes.h2d_free else lanes.h2d_free
        e = s + self.stage_s
        lanes.last_h = lanes.add(
            LANE_H2D, self.stage_first, KIND_STREAM_STAGE, s, e, lanes.last_h, self.stage_pred
        )
        lanes.h2d_order.append(lanes.last_h)
        lanes.h2d_free = e
        self.out.stage_start = issue
        self.stage_issue = math.inf

    def charge_host(self, r: int, ready_s: float, pred: int) -> None:
        """Where a STREAMED region's host step would run: the host seconds its pinned copies
        of the step take from host work (see the note); none without contention."""
        if not self.contention:
            return
        lanes = self.lanes
        s = ready_s if ready_s > lanes.host_free else lanes.host_free
        resident = self.codes[r] == RESIDENT
        uploads = (0 if self.writes_resident else 1) if resident else 2
        down = (self.down_resident_s if resident else self.down_s)[r]
        copies = self.grad_d2h_s[r] + uploads * self.upload_s[r] + self.up_s[r] + down
        e = s + self.contention * copies
        lanes.last_o = self.out.host_task[r] = lanes.add(
            LANE_HOST, r, KIND_STREAM_CONTENTION, s, e, lanes.last_o, pred
        )
        lanes.host_free = e


def stage_split(
    ctx: SimulationContext, costs: StreamedStepCosts, streamed: Sequence[bool]
) -> tuple[int, int, float, list[float]]:
    """Staging in the backward (see [Note: streamed steps] in ``_engine``): (the streamed
    region whose gradient hook opens the ring: the last in forward order; the first staged
    region; seconds of the staged state's copy up; each region's copy up at the step, the
    staged chunks' state taken out). The leading ``costs.staged_chunks`` chunks of the
    streamed regions in forward order, each region cut into chunks of
    ``costs.staged_chunk_numel``."""
    hw = ctx.hardware
    fraction = ctx.cost_model.stream_up_fraction
    numel = ctx.trainable
    hook = max((r for r, n in enumerate(numel) if streamed[r] and n > 0), default=-1)
    sup = list(ctx.stream_up_s)
    if hook < 0:
        return -1, -1, 0.0, sup
    chunk, left = costs.staged_chunk_numel, costs.staged_chunks
    pp, up_pp = costs.staged_bytes_per_param, costs.up_bytes_per_param
    first, total = -1, 0
    for r, n in enumerate(numel):
        if left == 0:
            break
        if not streamed[r] or n == 0:
            continue
        k = min(left, -(-n // chunk))
        staged = min(n, k * chunk)
        left -= k
        if first < 0:
            first = r
        total += staged
        sup[r] = hw.h2d_time_s(math.ceil(n * up_pp - staged * pp)) / fraction
    return hook, first, hw.h2d_time_s(math.ceil(total * pp)) / fraction, sup


__all__ = ["StreamWork", "stage_split"]
