"""The record of one simulated step: its lanes, the tasks placed on them, and the
per-region times solvers read (:class:`EngineRun`); :class:`Lanes`, the lanes as a step
fills them; the critical-path slack of a step's tasks.

The step model that fills them is [Note: step model] in ``_engine``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from offload_solver.plan import ParamPlacement, Stream

RESIDENT, SYNC, ASYNC = 0, 1, 2
"""Codes of the parameter placements, as a run records them (``EngineRun.codes``; 0 for
RESIDENT, so a code's truth says whether the region is offloaded)."""
CODES = {ParamPlacement.RESIDENT: RESIDENT, ParamPlacement.SYNC: SYNC, ParamPlacement.ASYNC: ASYNC}

LANE_COMPUTE, LANE_H2D, LANE_D2H, LANE_HOST = 0, 1, 2, 3
LANES = (Stream.COMPUTE, Stream.H2D, Stream.D2H, Stream.HOST)
KIND_FWD, KIND_BWD, KIND_UPLOAD, KIND_PREFETCH = 0, 1, 2, 3
KIND_GRAD_OFFLOAD, KIND_HOST_STEP, KIND_DEVICE_STEP, KIND_PARAM_UPLOAD = 4, 5, 6, 7
KIND_GRAD_WIDEN, KIND_PUBLISH = 8, 9
KIND_STREAM_UP, KIND_STREAM_STEP, KIND_STREAM_DOWN, KIND_STREAM_CONTENTION = 10, 11, 12, 13
KIND_STREAM_STAGE = 14
KIND_RECOMPUTE, KIND_ACT_OFFLOAD, KIND_ACT_FETCH = 15, 16, 17
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
    "publish",
    "stream_up",
    "stream_step",
    "stream_down",
    "stream_contention",
    "stream_stage",
    "recompute",
    "act_offload",
    "act_fetch",
)

NEVER = float("-inf")
"""A time before every step: nothing to wait for."""


class EngineRun:
    """The raw outcome of one simulated step (tasks, region times, pool, peak).

    Internal to the solver package: solvers read the per-region times to estimate the
    effect of a change, and :func:`to_result` turns a run into a ``SimulationResult``.
    """

    def __init__(self) -> None:
        self.codes: list[int] = []
        self.device_state: list[bool] = []
        self.bwd_offsets: list[list[float]] = []
        """The context's backward offsets this run used (``SimulationContext.bwd_offsets``
        or, with host-state regions, ``bwd_offsets_beside_host``)."""
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
        self.stepped_early: list[bool] = []
        """Per region, whether its host step ran in its gradient hook while backward ran
        (speculatively)."""
        self.h2d_free_at_reach_f: list[float] = []
        """H2D lane free time when the compute lane reaches region r's forward."""
        self.h2d_free_after_b: list[float] = []
        """H2D lane free time after the issues at region r's backward start."""
        self.h2d_pos_after_b: list[int] = []
        """Number of H2D tasks issued up to and including region r's backward start."""
        self.h2d_order: list[int] = []
        self.recompute_start: list[float] = []
        """Per region, when its forward's recomputation starts before its backward
        (RECOMPUTE, [Note: activations] in ``_activations``); ``-inf`` if none."""
        self.act_d2h_end: list[float] = []
        """Per region, when its activations' copy down ends (HOST); ``-inf`` if none."""
        self.act_h2d_start: list[float] = []
        """Per region, when its activations' copy back starts (HOST); ``-inf`` if none."""
        self.lifetimes: list[list[tuple[float, float]]] = []
        self.grads: list[tuple[int, float, float, int]] = []
        """(region, added, copied, bytes) of each gradient waiting on the device for its copy."""
        self.update_end: list[float] = []
        """Per region, when its host optimizer work (Adam, publish) ends; ``-inf`` if none."""
        self.param_upload_end: list[float] = []
        """Per region, when its post-step upload ends; ``-inf`` if none."""
        self.tail_uploads: list[tuple[float, int]] = []
        """(issue, region) of post-step uploads issued after the compute lane's last issue
        point (region 0's backward start): placed after everything else on the H2D lane
        here, and carried into the next step's forward by :func:`steady_state`."""
        self.h2d_free_before_tail = 0.0
        self.tail_streams: list[tuple[float, int]] = []
        """(issue, region) of this step's streamed steps, in issue order: placed after
        everything else here, and carried whole into the next step by :func:`steady_state`
        (see [Note: streamed steps])."""
        self.stream_window: tuple[float, float] | None = None
        """(first state copy's start, last state copy's end) of this step's own streamed
        steps, while the ring of device buffers is held; ``None`` without any."""
        self.carried_stream_window: tuple[float, float] | None = None
        """The same for the previous step's streamed steps, run in this one (gated steps)."""
        self.stage_start: float | None = None
        """When the backward's first streamed gradient hook opened the ring to send the
        leading chunks' state up (``StreamedStepCosts.staged_chunks``): the ring is held
        from then; ``None`` without staging."""
        self.stage_level: int | None = None
        """Dynamic bytes at most (activations, gradients and the ring) from
        ``stage_start`` on, as the memory curve counts them; ``None`` without staging."""
        self.stream_peak_bytes = 0
        """Peak device bytes while the ring is held, over both windows, at most (0
        without streamed steps; exact but where activations and gradients meet only in
        sequence at one instant): the cold step's own window is in ``peak_bytes`` too, a
        gated step's carried one only here."""
        self.compute_end_s = 0.0
        """When the compute lane finishes (backward, then the device-state optimizer steps
        that ``step()`` queues when it returns): when the next step can start."""
        self.host_free_end = 0.0
        self.d2h_free_end = 0.0
        self.step_time_s = 0.0
        """When the last lane goes idle (the single step's makespan)."""
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


TaskAdder = Callable[[int, int, int, float, float, int, int], int]
"""``add(lane, region, kind, start, end, pred_a, pred_b) -> task index``."""


def task_adder(out: EngineRun) -> TaskAdder:
    """A function that appends one task to ``out``'s task lists and returns its index
    (``pred_a`` / ``pred_b``: the tasks it waits for, -1 for none). A closure over the
    lists' bound ``append`` methods: it runs for every task of every simulation."""
    lane, region, kind = out.lane, out.region, out.kind
    lane_add, region_add, kind_add = lane.append, region.append, kind.append
    start_add, end_add = out.start.append, out.end.append
    pa_add, pb_add = out.pred_a.append, out.pred_b.append

    def add(ln: int, r: int, kd: int, s: float, e: float, pa: int, pb: int) -> int:
        lane_add(ln)
        region_add(r)
        kind_add(kd)
        start_add(s)
        end_add(e)
        pa_add(pa)
        pb_add(pb)
        return len(lane) - 1

    return add


class Lanes:
    """The four lanes of one step as the simulation fills them ([Note: step model] in
    ``_engine``): where each has got to, the last task on each (the next one there waits
    for it), and the post-step parameter uploads issued but not yet on the H2D lane.

    Every lane runs one task at a time in the order tasks are put on it; the compute lane
    is where the host issues from, so its time ``t`` is also the step's issue point.
    """

    def __init__(self, out: EngineRun, upload_s: list[float]) -> None:
        self.add = task_adder(out)
        """Append a task to the run's lists (:func:`task_adder`)."""
        self.end = out.end
        """Per task, its end (``EngineRun.end``)."""
        self.t = 0.0
        """The compute lane's time: when its last task ends, or a wait on the host."""
        self.last_c = -1
        self.h2d_free = 0.0
        self.last_h = -1
        self.d2h_free = 0.0
        self.last_d = -1
        self.host_free = 0.0
        self.last_o = -1
        self.h2d_order = out.h2d_order
        """H2D tasks in the order they were put on the lane."""
        self.upload_s = upload_s
        """Per region, seconds of one upload of its parameters
        (``SimulationContext.upload_s``)."""
        self.pending: deque[tuple[float, int, int]] = deque()
        """Post-step uploads waiting for the H2D lane: (issue time, region, the host task
        they follow), in issue order. They go on the lane at the compute lane's next
        issue point."""
        self.param_upload_end = out.param_upload_end
        """Per region, when its post-step upload ends (``-inf`` if none)."""

    def place_upload(self, issue: float, r: int, pred: int) -> None:
        """Put region r's post-step upload, issued at ``issue`` after task ``pred``, on the
        H2D lane."""
        s = issue if issue > self.h2d_free else self.h2d_free
        e = s + self.upload_s[r]
        self.last_h = self.add(LANE_H2D, r, KIND_PARAM_UPLOAD, s, e, self.last_h, pred)
        self.h2d_order.append(self.last_h)
        self.h2d_free = self.param_upload_end[r] = e

    def drain_uploads(self, until: float) -> None:
        """Put the pending uploads issued at or before ``until`` on the H2D lane."""
        pending = self.pending
        while pending and pending[0][0] <= until:
            issue, r, pred = pending.popleft()
            self.place_upload(issue, r, pred)


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
