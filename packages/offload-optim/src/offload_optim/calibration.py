"""How fast the host optimizer stepped in training, against the rate the plan assumed.

The planner prices every host-state region's step at the hardware profile's rate of the
kernel the plan chose (``HardwareProfile.host_step_params_per_s``, or
``PlanForce.host_step_params_per_s``), slowed by the pinned copies it expects beside it.
That rate is measured once, alone, in seconds; inside the training loop the host shares
memory bandwidth with the copies and cores with the thread issuing kernels, by amounts that
differ from machine to machine, so the loop's host steps can take more or less time than the
plan simulated.

:func:`check_host_rate` sets the host busy time the training loop measured
(:attr:`StepReport.host_step_s`, median over the steps read) beside the time the plan's
simulated host worker is busy in one step (:func:`planned_host_busy_s`), and gives the
rate that would make the two agree (:attr:`HostRateCheck.loop_params_per_s`): plan again
with ``offload_runtime.planning.plan_model(..., force=PlanForce(host_step_params_per_s=...))``
for this machine as it runs. It reads :meth:`AMPOptimizer.recent_steps`, so the optimizer needs
``keep_reports`` of at least the steps to read; leave out the first step or two, which
allocate and warm caches.

:func:`check_stream_rate` does the same for the streamed regions' copies up, which the
planner runs at the cost model's ``stream_up_fraction`` (``Plan.cost_model``) of the
profile's H2D rate: it sets the device time the loop's ring chunks took going up (timed on
CUDA, [Note: timing the ring's copies up] in streamed/ring.py) beside the profile's time for
their bytes, and gives the fraction that makes the two agree
(:attr:`StreamRateCheck.loop_fraction`), for ``PlanForce(cost_model=CostModel(
stream_up_fraction=...))``.

:func:`check_backward_issue` does it for the backward of a plan with host-state regions,
which the planner issues at the cost model's ``backward_issue_factor`` times the profile's
per-operation issue cost ([Note: the backward beside the host] in the solver's
``simulators._context``): it sets the host's time in ``backward(loss)``
(:attr:`StepReport.backward_start_s` to :attr:`~StepReport.backward_end_s`) beside issuing
the plan's traced operations at that cost, and gives the factor at which issuing them
takes as long (:attr:`BackwardIssueCheck.loop_factor`), for ``PlanForce(cost_model=
CostModel(backward_issue_factor=...))``. Issued ahead of the device, a backward
at that factor spans at least the measured time, and no more where its kernels take
longer.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

from offload_optim.amp import AMPOptimizer, StepReport
from offload_solver import Plan, StatePlacement, Stream


def planned_host_busy_s(plan: Plan) -> float:
    """Seconds the simulated host worker is busy in ``plan``'s cold step (its region steps
    and publishes on the host lane)."""
    return float(sum(iv.end_s - iv.start_s for iv in plan.timeline if iv.stream is Stream.HOST))


def _reports_read(optimizer: AMPOptimizer, last: int | None, caller: str) -> list[StepReport]:
    """``optimizer``'s kept step reports, the last ``last`` of them (all for None), for
    ``caller``; ValueError when it keeps none or ``last`` is not an int >= 1."""
    if last is not None and (isinstance(last, bool) or not isinstance(last, int) or last < 1):
        raise ValueError(f"{caller}(last={last!r}): last must be an int >= 1 or None")
    if optimizer.keep_reports < 1:
        raise ValueError(
            f"{caller} reads AMPOptimizer.recent_steps(): construct the optimizer "
            "with keep_reports >= 1 (the steps to read)"
        )
    reports = optimizer.recent_steps()
    return reports if last is None else reports[-last:]


@dataclass(frozen=True)
class HostRateCheck:
    """The host's busy time per step in the loop against the plan's, and the host rate
    that would have matched it."""

    planned_params_per_s: float
    """The host Adam rate the plan was made with, parameters per second."""
    planned_busy_s: float
    """Seconds the plan's simulated host worker is busy in one step."""
    measured_busy_s: float
    """Median over the steps read of their host-state region steps' time on the host,
    seconds (streamed regions, stepped on the device, are not counted)."""
    steps: int
    """How many steps the median is over."""

    @property
    def busy_ratio(self) -> float:
        """Measured host busy time over the planned: above 1, the host ran slower than
        planned."""
        return self.measured_busy_s / self.planned_busy_s

    @property
    def loop_params_per_s(self) -> float:
        """The host Adam rate (parameters per second) at which the plan's simulated host
        would be as busy as the measured one: the planned rate over :attr:`busy_ratio`
        (``python benchmarks/replay_bench.py --host-rate loop`` replays recorded runs
        with it)."""
        return self.planned_params_per_s / self.busy_ratio


def check_host_rate(optimizer: AMPOptimizer, last: int | None = None) -> HostRateCheck | None:
    """The host rate the training loop ran at, from ``optimizer``'s recent step reports.

    Args:
        optimizer: an :class:`AMPOptimizer` over a module the planner built
            (it knows the profile the plan was made with), constructed with
            ``keep_reports`` >= 1.
        last: read only the last ``last`` kept steps (default: all of them). Steps that
            skipped their update (fp16 overflow) or stepped nothing on the host are left
            out.

    Returns:
        None when the module has no hardware profile (a plan not made by
        the planner), the plan's host worker has nothing to do, or no step read
        stepped a region on the host.

    Raises:
        ValueError: when ``optimizer`` keeps no reports, or ``last`` is not positive.
    """
    reports = _reports_read(optimizer, last, "check_host_rate")
    hardware = optimizer.module.hardware
    if hardware is None:
        return None
    planned_busy = planned_host_busy_s(optimizer.module.plan)
    if planned_busy <= 0:
        return None
    busy = [r.host_step_s for r in reports if not r.skipped and r.host_step_s > 0]
    if not busy:
        return None
    return HostRateCheck(
        planned_params_per_s=hardware.host_adam_params_per_s,
        planned_busy_s=planned_busy,
        measured_busy_s=statistics.median(busy),
        steps=len(busy),
    )


@dataclass(frozen=True)
class StreamRateCheck:
    """How fast the ring's copies up of streamed regions ran in the loop, against the
    rate the plan assumed ([Note: timing the ring's copies up] in streamed/ring.py)."""

    planned_fraction: float
    """The plan's ``CostModel.stream_up_fraction`` (``Plan.cost_model``): the share of the
    H2D rate it ran the ring's copies up at."""
    up_bytes: int
    """Median over the steps read of the bytes their streamed regions' ring chunks carried
    up (staged ones included)."""
    measured_s: float
    """Median over the steps read of those copies' device seconds, summed over chunks."""
    profile_s: float
    """Seconds the plan's profile gives ``up_bytes`` at its full pinned H2D rate."""
    steps: int
    """How many steps the medians are over."""

    @property
    def loop_fraction(self) -> float:
        """The ``stream_up_fraction`` at which the simulator's copies up take as long as
        the loop's did: the profile's time over the measured, at most 1. Pass it to
        ``PlanForce(cost_model=CostModel(stream_up_fraction=...))`` to plan
        again for this machine as it runs."""
        return min(1.0, self.profile_s / self.measured_s)


def check_stream_rate(optimizer: AMPOptimizer, last: int | None = None) -> StreamRateCheck | None:
    """The rate the ring's copies up of streamed regions ran at in the training loop, from
    ``optimizer``'s recent step reports (:attr:`RegionStepTiming.up_bytes` and
    :attr:`~RegionStepTiming.up_s`, timed on the device on CUDA).

    Args:
        optimizer: an :class:`AMPOptimizer` over a module the planner built,
            constructed with ``keep_reports`` >= 1.
        last: read only the last ``last`` kept steps (default: all of them).

    Returns:
        None when the module has no hardware profile, or no step read timed a copy up (no
        streamed region, or not on CUDA).

    Raises:
        ValueError: when ``optimizer`` keeps no reports, or ``last`` is not positive.
    """
    reports = _reports_read(optimizer, last, "check_stream_rate")
    hardware = optimizer.module.hardware
    if hardware is None:
        return None
    per_step = [
        (
            sum(t.up_bytes for t in r.region_steps if t.streamed),
            sum(t.up_s for t in r.region_steps if t.streamed),
        )
        for r in reports
    ]
    timed = [(b, s) for b, s in per_step if b > 0 and s > 0]
    if not timed:
        return None
    up_bytes = int(statistics.median(b for b, _ in timed))
    return StreamRateCheck(
        planned_fraction=optimizer.module.plan.cost_model.stream_up_fraction,
        up_bytes=up_bytes,
        measured_s=statistics.median(s for _, s in timed),
        profile_s=hardware.h2d_time_s(up_bytes),
        steps=len(timed),
    )


@dataclass(frozen=True)
class BackwardIssueCheck:
    """The host's time in the loop's backward against issuing the plan's operations at the
    profile's per-operation cost, in a plan with host-state regions."""

    planned_factor: float
    """The plan's ``CostModel.backward_issue_factor`` (``Plan.cost_model``)."""
    operations: int
    """The traced operations the plan's backward issues."""
    op_overhead_s: float
    """The profile's cost of issuing one operation, seconds."""
    measured_s: float
    """Median over the steps read of the host's time in ``backward(loss)``, seconds."""
    steps: int
    """How many steps the median is over."""

    @property
    def loop_factor(self) -> float:
        """The ``backward_issue_factor`` at which issuing :attr:`operations` takes
        :attr:`measured_s`, at least 1 (the runtime's gradient hooks and the host Adam's
        threads slow the thread that issues the backward)."""
        return max(1.0, self.measured_s / (self.operations * self.op_overhead_s))


def check_backward_issue(
    optimizer: AMPOptimizer, last: int | None = None
) -> BackwardIssueCheck | None:
    """How long the training loop's backward kept the host, from ``optimizer``'s recent
    step reports, against issuing the plan's operations at the profile's cost.

    Args:
        optimizer: an :class:`AMPOptimizer` over a module the planner built,
            constructed with ``keep_reports`` >= 1.
        last: read only the last ``last`` kept steps (default: all of them). Skipped
            steps count: their backward ran as any other.

    Returns:
        None when the module has no hardware profile or a profile without an issue cost,
        when no region of the plan keeps its state on the host (the factor prices only
        such steps), or when no step read timed its backward.

    Raises:
        ValueError: when ``optimizer`` keeps no reports, or ``last`` is not positive.
    """
    reports = _reports_read(optimizer, last, "check_backward_issue")
    module = optimizer.module
    hardware = module.hardware
    if hardware is None or hardware.op_overhead_s <= 0:
        return None
    regions = module.plan.regions
    if all(rp.state is StatePlacement.DEVICE for rp in regions):
        return None
    spans = [
        r.backward_end_s - r.backward_start_s
        for r in reports
        if r.backward_start_s is not None and r.backward_end_s is not None
    ]
    if not spans:
        return None
    return BackwardIssueCheck(
        planned_factor=module.plan.cost_model.backward_issue_factor,
        operations=max(rp.region.op_end for rp in regions),
        op_overhead_s=hardware.op_overhead_s,
        measured_s=statistics.median(spans),
        steps=len(spans),
    )
