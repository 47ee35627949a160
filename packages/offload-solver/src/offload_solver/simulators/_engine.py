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
  device until that copy ends. The runtime's host worker (HOST: one FIFO worker) takes
  the regions in copy order, waits for each copy and runs:
  1. ``grad_widen``: the copied gradients widened into the fp32 accumulator, ``numel /
     host_convert_elems_per_s``; none when ``0 < host_grad_bytes_per_param < 4`` is false
     (the runtime sent fp32, widened on the device, or nothing crossed). The region's
     gradient-ready hook runs when this ends (or when the copy lands, with no widening);
  2. ``host_step``: fused Adam, ``numel / host_adam_params_per_s``; a step taken in a
     gradient hook before backward ends costs ``speculative_step_cost`` times that (an
     fp16 speculative step also writes what an undo needs);
  3. ``publish``: the fp32 master cast into the training-dtype copy (pinned host
     parameters, or the upload buffer of a RESIDENT region), ``numel /
     host_convert_elems_per_s``; none when ``host_upload_bytes_per_param >= 4`` (the
     runtime uploads the fp32 master itself and narrows it on the device).
  With ``host_convert_elems_per_s == 0`` (unknown) only the Adam step is charged.
  Pinned copies share host memory with the host work: ``host_copy_contention`` ``c`` is
  the fraction of its rate host Adam keeps while copies run both ways at once, so a copy
  of ``t`` seconds in one direction (half that traffic) costs the host about ``t / 2 *
  (1 / c - 1)``. Each host-state region's Adam step is charged that for its own copies
  of the step (its gradient copy, and its uploads: two for an offloaded region, forward
  and backward, one post-step upload for a resident one), as if every copy overlapped
  host work, which in an offloaded step nearly all do. A step taken in its gradient
  hook while backward still runs is charged instead at the contended rate for all of
  its duration (``speculative_step_cost / c`` times a plain step): the gradient copies
  down and backward's prefetches up stream both ways around it (charged only for their
  own copies, speculating plans are predicted too fast). Where the other copies land in
  time is not modelled, only their total: the period of the repeating step is what it
  moves.
  The conversion passes (``grad_widen``, ``publish``) run at ``c`` times their rate:
  they run as gradients land and right before uploads, while copies stream, and they
  are pure memory traffic.
  When steps 2-3 run (``offload_optim``'s ``AMPOptimizer``; "bwd_end" is the end of the
  compute lane's backward):
  - ``host_step_after_backward`` (fp16: no region may step before the overflow answer,
    which the runtime computes on the device from each region's gradients before their
    copy, so it is known at bwd_end and the host computes no partial): a region whose
    hook runs after bwd_end steps right then, so these step in copy (landing) order;
    the regions whose hooks ran at or before bwd_end step after them, in forward order,
    starting no earlier than bwd_end. ``step()`` returns at bwd_end.
  - otherwise (bf16, fp32, or fp16 speculating): a region whose hook runs before the
    step's last copy has landed steps right then; a later hook leaves its region to
    ``step()``, which waits for every hook and then queues those regions in forward
    order. The hook of the last copy's region is always a later one, and so is every
    hook after it even while backward still computes (regions below it keep their state
    on the device): the runtime's backward-done event is recorded on the D2H stream, so
    it completes when the last copy lands. ``step()`` returns when backward has ended
    and every hook has run. With ``speculation_thread`` (fp16 speculating, the
    optimizer's default) the hooks hand their steps to a thread of their own: hooks then
    run as their gradient work ends, whatever steps are in flight, ``step()`` returns
    without waiting for those steps, and its job issues the streamed regions then,
    before waiting for them (where the hooks run the steps, the compute stream idles
    while ``step()`` waits for the one in flight). The steps still take the
    host lane in turn (they share its cores), and one that would start only after the
    last copy has landed is left to the answer, as the thread skips it then.
  A RESIDENT region's updated parameters go back on H2D after its publish, or after its
  Adam step when there is none (offloaded regions are uploaded by the next forward
  anyway), at the compute lane's next issue point (a region's start). H2D tasks issued
  at the same instant: parameter uploads issued so far, then prefetches (the region
  needed first first).
- Every upload above (sync upload, prefetch, post-step ``param_upload``) is of a
  HOST-state region (offloaded regions always keep their state on the host; device-state
  regions are RESIDENT and never uploaded), and moves ``size_bytes``, or ``numel *
  host_upload_bytes_per_param`` when that is > 0 (4: fp32 masters, narrowed on the
  device into the region's training-dtype buffer). Any device staging buffer the runtime
  narrows from is not charged to memory: only the copy time changes.
- DEVICE-state regions (RESIDENT only) keep ``numel * device_state_bytes_per_param``
  bytes on the device all step; their optimizer steps run on the compute lane from when
  ``step()`` returns, in one batch. The compute lane's end (``compute_end_s``) is when
  the next step can start.
- The single (cold) step ends when the last lane goes idle (``step_time_s``): what the
  timeline and memory curves show. The time per step a training loop measures is the
  period of the repeating step: [Note: steady state].

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

[Note: steady state]
A training loop does not wait for the host: ``step()`` returns at the compute lane's end
(see above) and the host steps of step k run under the forward of step k+1. So the time
per step is the period of a repeating schedule, not the single step's span. Step k+1
starts when step k's compute lane ends (``compute_end_s``) and differs from a cold step
in two ways:
- lanes carry over: the host worker, D2H and H2D start busy with step k's remaining
  work; step k's post-step uploads not yet on H2D at its last issue point (region 0's
  backward start) join step k+1's forward prefetches on the lane in issue order;
- a region's forward waits for step k's update of it: the runtime's ``begin_forward``,
  ``upload`` and ``prefetch`` of region r block the host (``wait_update``) until r's Adam
  step (and publish) is done. A SYNC region's upload therefore starts after it; a
  RESIDENT host-state region's forward also waits for its post-step upload (the device
  waits for that copy's event); the forward prefetch of region q is called before
  region q-1's first operation (``offload_runtime.passes``), so the compute lane waits
  there, and the prefetch starts after it. Backward needs nothing of step k.
:func:`steady_state` runs the cold step, then gated steps, each started from what the
previous one left (:func:`carry_from`, times shifted by its ``compute_end_s``), until a
step leaves the next one what it started from (:func:`same_carry`: lane-free times,
gates and carried uploads, each within :data:`STEADY_REL_TOL` of the span; at most
:data:`STEADY_MAX_STEPS` steps). A step is a function of its carry, so that step repeats
and its compute-lane span is the period. Comparing spans alone could stop early: a gated
step may match the one before in span while a lane still ends later each time. On every
profile tried the first gated step already repeats (it is simulated, then checked).
Memory is the cold step's: gated steps run the same operations in the same compute-lane
order, only later, so lifetimes overlap alike and the pool is the same; a gated step's
gradients can wait longer for a D2H lane still busy with the previous step's copies (not
seen on the workloads measured). Solvers rank candidates on the cold step (its slack)
and compare steady-state periods where they accept a change of step time (optimizer
placement).

[Note: streamed steps]
A STREAMED region (``StatePlacement.STREAMED``, costs in ``SimulationContext.streamed``,
a :class:`~offload_solver.model.StreamedStepCosts`) keeps its master weights and moments
in pinned host memory, as a HOST region does (no device state; it may be offloaded or
resident), but is stepped on the device, as ``offload_optim``'s ``HybridAdam`` does it:
- Its gradient goes down and its host gradient work runs exactly as a HOST region's
  (``grad_offload``, ``grad_widen``), and its gradient-ready hook runs when that ends.
- It never steps speculatively and takes no speculative buffers (``may_speculate`` skips
  it when counting ``speculative_params``). Where its host step would run were it a HOST
  region outside the speculating set (in its hook once backward has ended with
  ``host_step_after_backward``, else queued in forward order when ``step()`` has seen
  every hook), the host lane gets a ``stream_contention`` task instead: what its pinned
  copies of the step (gradient down, its parameter uploads as a HOST region's, state up
  and down) cost the host, ``t / 2 * (1 / c - 1)`` per second of copy as above, times
  the hardware's ``stream_host_charge`` ``s`` (1 unless set). It stands for the slower
  host steps of the other regions while those copies run; none when ``c`` is 1 or ``s``
  is 0. Host memory slows both sides, so the charge can be split: with ``s`` below 1 the
  host takes that share and the copies up the rest, through ``stream_up_fraction``
  (``offload_runtime``'s defaults for the two are fitted: ``STREAM_HOST_CHARGE``).
- The host worker issues a streamed region's device step where it would step it were it
  a HOST region outside the speculating set, without waiting for it: in its hook when
  that runs after backward with ``host_step_after_backward``; otherwise at the start of
  the job that ``step()`` queues for the deferred regions, once the worker has done
  everything queued before it (the hooks, and the steps taken in them), all of the job's
  streamed regions at once, in forward order, before its host steps. (bf16 and fp32 need
  no answer and could issue earlier, as gradients land; that is not modelled: the runtime
  leaves them to ``step()`` too.) Each gets three tasks, every lane FIFO by issue:
  1. ``stream_up`` on H2D, ``numel * up_bytes_per_param`` bytes at the hardware's
     ``stream_up_fraction`` of its H2D rate, issued then and put on the lane as
     post-step uploads are, at the next issue point (after uploads issued at the same
     instant);
  2. ``stream_step`` on COMPUTE, ``device_step_s``, at the first compute-lane issue point
     after the copy up ends (or as soon as both are free while the compute lane waits on
     the host or after the step's compute has ended): the forward is not held behind a
     copy still running;
  3. ``stream_down`` on D2H, ``numel * down_bytes_per_param`` bytes, after the step.
  The region is then published as a HOST region is after its host step: a RESIDENT
  region's post-step ``param_upload`` is issued when the copy down ends, and its next
  forward waits for that upload; an offloaded region's next upload or prefetch waits for
  the copy down. Nothing else serializes them (a ring of 2-3 slots keeps up with equal
  copy rates up and down). With ``StreamedStepCosts.resident_down_bytes_per_param`` set,
  a RESIDENT region's device step writes its parameters on the device: its copy down is
  ``numel * resident_down_bytes_per_param`` bytes, it has no ``param_upload``, and its
  next forward waits (on the device) for the ``stream_step`` alone, the copy down running
  beside the forward.
- Staging in the backward (``StreamedStepCosts.staged_chunks``; ``offload_optim``'s
  ``HybridAdam(stage_in_backward=True)``): the gradient hook of the last streamed region
  in forward order, the first to run in the backward, opens the ring and sends up the
  master weights and moments (``staged_bytes_per_param``) of the streamed regions'
  leading ``staged_chunks`` chunks of ``staged_chunk_numel`` parameters, in forward
  order. One ``stream_stage`` task on H2D at the copy-up rate above, issued when that
  region's hook runs on the host worker (after its gradient work; the worker's own
  timeline with the speculation thread) and put on the lane at the next issue point
  (with ``host_step_after_backward``, whose hooks are placed after the backward, behind
  what the backward put there); each staged region's ``stream_up`` at the step then
  carries the rest of its bytes (its gradient, and the state of chunks not staged), and
  comes after the stage task on the FIFO lane. Not modelled: the host's share of those
  copies, and a ring still open from the previous step when the hook runs (the runtime
  then stages nothing). A micro-batch that only accumulates stages nothing.
- Memory: the runtime holds a ring of ``slot_bytes`` device bytes from the first copy
  up's start to the last copy down's end of a step's streamed regions. The cold step
  places its streamed work after its device-state steps, where the ring shows in its
  memory curve and peak (with the gradients still on their way down). In the repeating
  step that work runs under the next step's forward instead, which the forward's
  activations share: a gated step records that window (``carried_stream_window``) and
  ``stream_peak_bytes``, the ring plus the forward's activations at their highest in it,
  and the peak a simulation or plan reports is the larger of the two (the memory curve
  stays the cold step's). With staging the ring is held from the hook on: the memory curve
  holds it from then, and the highest level from then on (``stage_level``: the backward's
  activations and gradients left with it) counts in ``stream_peak_bytes`` too.
- Steady state: a step's streamed work is carried whole (``Carry.streams``: issue times)
  and runs in the next step, each region's forward waiting for its own (the host blocks;
  the lanes run the streamed work queued before it meanwhile); the lane-free times
  carried are those before it.

[Note: micro-batches]
With gradient accumulation an optimizer step runs ``micro_batches`` forward and backward
passes and steps once, after the last. The step modelled above is then the last
micro-batch; each of the others is simulated as a cold micro-batch that only accumulates
(``run(..., optimizer_step=False)``): the same placements, uploads, prefetches and
gradient copies, with host-state regions' gradients widened (as above) and added into
their accumulators on the host (one more pass at the conversion rate under copies) as
they land, no host or device step, and no post-step upload. The period is the steady
state's plus ``micro_batches - 1`` such micro-batches' compute-lane spans. Where the host
steps of one step run into the next step's forward, the first micro-batch is the one that
waits for them, and the steady state above already counts that wait once. Memory is the
same in every micro-batch: device-state regions' fp32 gradients are part of their state.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from offload_solver.model import (
    HardwareProfile,
    MemorySample,
    ModelProfile,
    ParamPlacement,
    Region,
    StatePlacement,
    Stream,
    StreamedStepCosts,
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
KIND_GRAD_WIDEN, KIND_PUBLISH = 8, 9
KIND_STREAM_UP, KIND_STREAM_STEP, KIND_STREAM_DOWN, KIND_STREAM_CONTENTION = 10, 11, 12, 13
KIND_STREAM_STAGE = 14
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
)

# [Note: issuing ahead]
# The host issues a pass's operations one after another, each costing it about
# ``op_overhead_s`` (Python, dispatcher, autograd recording, the launch); the device runs
# each operation once it is issued and the one before it is done (:func:`issued_starts`).
# With small kernels the device waits for the host and the pass takes the issue costs;
# with large ones the host runs ahead and the pass takes the kernels' time, operations
# that launch nothing (views, transposes, splits) costing the device nothing. A pass is
# priced so only in [Note: the backward beside the host]; every other pass prices each
# operation at the largest of its compute, its traffic and its issue cost, one after
# another, which charges views their issue cost even where the device is the bound.


# [Note: the backward beside the host]
# In a step with host-state regions the backward is issued beside work the probe behind
# ``op_overhead_s`` does not have: the regions' gradient hooks (per parameter, a copy down
# and its stream bookkeeping; per region, the overflow check's norms) and the host Adam's
# threads on every core, which slow the thread issuing the backward.
# ``HardwareProfile.backward_issue_factor`` scales the backward's issue cost in such steps,
# and that backward is issued ahead of the device ([Note: issuing ahead]): priced per
# operation at the factor, a backward bound by its kernels would also pay the factor for
# views its kernels hide. A step whose regions all keep their state on the device keeps
# ``op_overhead_s``. The backward beside the host takes the longer of that pass and the
# pass priced alone (work beside it only slows the host; region by region the longer
# would count twice the views' issue that the loaded pass moves from one region to the
# next), so its price rises continuously from the factor 1, where the two agree. Not
# modelled: where in the backward the host steps run (the factor applies to the whole
# pass), and the forward beside the host.


def issued_starts(device_s: Sequence[float], issue_s: float) -> tuple[list[float], float]:
    """Start of each operation (device seconds ``device_s``, in the order they run) from
    the start of issuing, and the end of the last, when each is issued ``issue_s`` after
    the one before it and runs once issued and after the one before it ([Note: issuing
    ahead]). With ``issue_s`` 0 the operations run back to back."""
    starts: list[float] = []
    issued = done = 0.0
    for d in device_s:
        issued += issue_s
        start = max(done, issued)
        starts.append(start)
        done = start + d
    return starts, max(done, issued)


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


def check_speculative_params(value: int | None) -> int | None:
    """``value`` when it is a valid ``speculative_params`` (None, or a number of host-state
    parameters >= 0), else ValueError. Shared with offload_optim's ``AMPOptimizer``, which
    takes the same limit."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"speculative_params must be None or an int >= 0, got {value!r}")
    return value


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
        speculative_step_cost: float = 1.0,
        micro_batches: int = 1,
        speculative_params: int | None = None,
        streamed: StreamedStepCosts | None = None,
        speculation_thread: bool = False,
    ):
        if not 1.0 <= speculative_step_cost < math.inf:
            raise ValueError(
                f"speculative_step_cost is {speculative_step_cost}; must be a finite ratio >= 1"
            )
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise ValueError(f"micro_batches must be an int, got {micro_batches!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches is {micro_batches}; an optimizer step needs >= 1")
        if streamed is not None and not isinstance(streamed, StreamedStepCosts):
            raise ValueError(f"streamed must be None or a StreamedStepCosts, got {streamed!r}")
        self.streamed = streamed
        """What the runtime moves and holds for a STREAMED region's device step (None: no
        region may be STREAMED). See [Note: streamed steps]."""
        self.micro_batches = micro_batches
        """Forward and backward passes per optimizer step (gradient accumulation): see
        [Note: micro-batches]."""
        self.profile = profile
        self.host_step_after_backward = host_step_after_backward
        """Host optimizer steps wait for the end of backward: what an optimizer does when
        the step needs a global answer first (the fp16 overflow check, computed on the
        device as backward runs). Regions whose gradients land after that step as they
        land, then the others in forward order. Otherwise each starts when its gradients
        land."""
        self.speculative_step_cost = speculative_step_cost
        """Cost of a host step taken in a gradient hook before backward ends, relative to a
        plain one: 1 when such steps are exact (bf16, fp32); an fp16 speculative step that
        also writes its undo data costs more (measure it with the optimizer's kernel)."""
        self.speculative_params = check_speculative_params(speculative_params)
        """Without ``host_step_after_backward``: how many host-state parameters may step
        in their gradient hooks (None: all). Host-state regions qualify in the order their
        gradients land (the last in forward order first) until the first that would pass
        the limit; the others step after the last hook, as the runtime does for regions
        without speculative buffers (``AMPOptimizer(speculative_params=)``)."""
        if not isinstance(speculation_thread, bool):
            raise ValueError(f"speculation_thread must be a bool, got {speculation_thread!r}")
        self.speculation_thread = speculation_thread
        """Without ``host_step_after_backward``: the runtime runs the steps its gradient
        hooks take early on a thread of their own (``offload_optim``'s
        ``HybridAdam(speculation_thread=True)``, its default), so the hooks, and
        ``step()`` after them, do not wait for them. See [Note: step model]."""
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
        self.copy_contention = (1.0 / hw.host_copy_contention - 1.0) / 2.0
        """Host seconds a second of one-directional pinned copy costs (see the note)."""
        self.stream_copy_contention = self.copy_contention * hw.stream_host_charge
        """The same for a STREAMED region's copies: ``stream_host_charge`` of it (see
        [Note: streamed steps])."""
        # Host conversion passes of a host-state region (see the note); zero when the rate
        # is unknown, so the engine can skip them with one test.
        # They run as gradients land and right before uploads, so under copies: charged at
        # the contended rate (see the note).
        slow = 1.0 / hw.host_copy_contention
        widens = 0 < profile.host_grad_bytes_per_param < 4
        self.widen_s = [hw.host_convert_time_s(n) * slow if widens else 0.0 for n in self.numel]
        # Uploading fp32 masters (narrowed on the device) leaves nothing to publish.
        self.publishes = hw.host_convert_elems_per_s > 0 and per_elem < 4
        """Whether host-state regions get a ``publish`` host task after their Adam step."""
        self.publish_s = [
            hw.host_convert_time_s(n) * slow if self.publishes else 0.0 for n in self.numel
        ]
        self.grad_work = [((KIND_GRAD_WIDEN, w),) if w > 0.0 else () for w in self.widen_s]
        """Per region, the host tasks (kind, seconds) run as its gradients land."""
        add_s = [
            hw.host_convert_time_s(n) * slow if hw.host_convert_elems_per_s > 0 else 0.0
            for n in self.numel
        ]
        self.accumulate_work = [
            ((KIND_GRAD_WIDEN, w + a),) if w + a > 0.0 else ()
            for w, a in zip(self.widen_s, add_s, strict=True)
        ]
        """Per region, the host tasks run as its gradients land in a micro-batch that only
        accumulates: widening (as above) and adding into the accumulator, one more pass
        at the conversion rate under copies."""
        self.host_work_s = [
            a + b + c
            for a, b, c in zip(self.widen_s, self.host_step_s, self.publish_s, strict=True)
        ]
        """Per region, all host-lane seconds of its optimizer work when its state is on
        the host: widening, Adam and publish."""
        self.device_step_s = [n / hw.device_adam_params_per_s for n in self.numel]
        self.state_bytes = [n * profile.device_state_bytes_per_param for n in self.numel]
        # STREAMED regions (see [Note: streamed steps]): the state's copies up and down; the
        # device step is ``device_step_s``.
        up_pp = streamed.up_bytes_per_param if streamed is not None else 0.0
        down_pp = streamed.down_bytes_per_param if streamed is not None else 0.0
        self.stream_up_s = [
            hw.h2d_time_s(math.ceil(n * up_pp)) / hw.stream_up_fraction for n in self.numel
        ]
        """Per region, seconds of a STREAMED step's state copy up (0 without costs), at
        ``stream_up_fraction`` of the H2D rate."""
        self.stream_down_s = [hw.d2h_time_s(math.ceil(n * down_pp)) for n in self.numel]
        """Per region, seconds of a STREAMED step's state copy down (0 without costs)."""
        resident_pp = streamed.resident_down_bytes_per_param if streamed is not None else None
        self.stream_writes_resident = resident_pp is not None
        """Whether a RESIDENT streamed region's device step writes its parameters in place
        (``StreamedStepCosts.resident_down_bytes_per_param``): no post-step upload, and its
        forward waits for the device step only."""
        self.stream_down_resident_s = (
            self.stream_down_s
            if resident_pp is None
            else [hw.d2h_time_s(math.ceil(n * resident_pp)) for n in self.numel]
        )
        """Per region, seconds of a RESIDENT streamed region's copy down."""
        self.stream_slot_bytes = streamed.slot_bytes if streamed is not None else 0
        """Device bytes of the ring of buffers held while streamed steps are in flight."""

        # Every operation takes at least its issue cost ([Note: issuing ahead]).
        fwd_op = [max(hw.operation_device_s(op), hw.op_overhead_s) for op in ops]
        bwd_dev = [hw.operation_device_s(op, backward=True) for op in ops]
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

        def backward_issued_ahead(issue_s: float) -> list[float]:
            """Per operation, backward seconds from its start to the next one's (in
            reverse operation order) when each costs the host ``issue_s`` to issue and
            the host issues ahead of the device ([Note: issuing ahead])."""
            # Operation starts over the whole pass, in reverse operation order; a
            # region's offsets from its first operation's.
            at_rev, end = issued_starts(bwd_dev[::-1], issue_s)
            at = at_rev[::-1]
            # The first operation of a pass also waits for its own issue.
            return [b - a for a, b in zip([*at[:-1], 0.0], [end, *at[:-1]], strict=True)]

        # Start offsets of each region's operations from the region's compute start:
        # forward in operation order, backward in reverse operation order.
        self.fwd_offsets: list[list[float]] = []
        self.fwd_s: list[float] = []
        self.act_bwd_region_max: list[int] = []
        for reg in regions:
            acc, offs = 0.0, []
            for j in range(reg.op_start, reg.op_end):
                offs.append(acc)
                acc += fwd_op[j]
            self.fwd_offsets.append(offs)
            self.fwd_s.append(acc)
            self.act_bwd_region_max.append(max(self.act_bwd[reg.op_start : reg.op_end], default=0))

        def backward_regions(eff: list[float]) -> tuple[list[list[float]], list[float]]:
            offsets: list[list[float]] = []
            spans: list[float] = []
            for reg in regions:
                acc, offs = 0.0, []
                for j in range(reg.op_end - 1, reg.op_start - 1, -1):
                    offs.append(acc)
                    acc += eff[j]
                offsets.append(offs)
                spans.append(acc)
            return offsets, spans

        self.bwd_offsets, self.bwd_s = backward_regions([max(d, hw.op_overhead_s) for d in bwd_dev])
        """Per region, its backward operations' start offsets from the region's backward
        start, and its backward's seconds, in a step with every region's state on the
        device."""
        self.bwd_offsets_beside_host, self.bwd_s_beside_host = self.bwd_offsets, self.bwd_s
        """The same in a step with host-state regions: with each backward operation issued
        ahead at ``backward_issue_factor`` times ``op_overhead_s`` where that makes the
        pass longer than the price above ([Note: the backward beside the host]); the same
        lists when that factor is 1."""
        if hw.backward_issue_factor != 1.0:
            loaded_offsets, loaded_s = backward_regions(
                backward_issued_ahead(hw.op_overhead_s * hw.backward_issue_factor)
            )
            if sum(loaded_s) > sum(self.bwd_s):
                self.bwd_offsets_beside_host, self.bwd_s_beside_host = loaded_offsets, loaded_s

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
        speculative_step_cost: float = 1.0,
        micro_batches: int = 1,
        speculative_params: int | None = None,
        streamed: StreamedStepCosts | None = None,
        speculation_thread: bool = False,
    ) -> SimulationContext:
        """Linearise ``profile`` into regions (see ``offload_solver.regions``) and cost them."""
        layout = build_regions(
            profile, step_bytes=block_search_step_bytes, range_bytes=block_search_range_bytes
        )
        return cls(
            profile,
            hardware,
            layout,
            host_step_after_backward=host_step_after_backward,
            speculative_step_cost=speculative_step_cost,
            micro_batches=micro_batches,
            speculative_params=speculative_params,
            streamed=streamed,
            speculation_thread=speculation_thread,
        )

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
            if a.state is StatePlacement.STREAMED and self.streamed is None:
                raise ValueError(
                    f"region {r} is streamed, but the simulation has no StreamedStepCosts; "
                    "build the SimulationContext with streamed=StreamedStepCosts(...)"
                )
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


@dataclass(frozen=True)
class Carry:
    """What one step leaves to the next, in the next step's time (it starts at 0, when
    the previous step's compute lane finished). See [Note: steady state]."""

    host_free_s: float
    """When the host worker finishes the previous step's work."""
    d2h_free_s: float
    """When the device-to-host lane finishes the previous step's gradient copies."""
    h2d_free_s: float
    """When the host-to-device lane finishes the copies the previous step placed on it."""
    gate_s: tuple[float, ...]
    """Per region, when the previous step's update makes it usable (``-inf``: nothing to
    wait for): an offloaded region's Adam step (and publish) end; a resident host-state
    region's post-step upload end, or, when that upload is in ``uploads``, its issue."""
    uploads: tuple[tuple[float, int], ...]
    """(issue time, region) of the previous step's post-step uploads not yet on the H2D
    lane, in issue order: they share it with this step's forward prefetches."""
    streams: tuple[tuple[float, int], ...] = ()
    """(issue time, region) of the previous step's streamed steps, in issue order: all
    of their work (state up, device step, state down, post-step upload) runs in this
    step, and each region's forward waits for its own ([Note: streamed steps])."""


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


_NEVER = float("-inf")


def run(
    ctx: SimulationContext,
    assignment: Sequence[RegionAssignment],
    carry: Carry | None = None,
    *,
    optimizer_step: bool = True,
) -> EngineRun:
    """Simulate one step of an already validated ``assignment`` (see [Note: step model]).

    Without ``carry`` the step starts on an idle machine (a cold step); with it, it starts
    as the previous step left things (see [Note: steady state]). ``optimizer_step=False``
    simulates a micro-batch that only accumulates gradients (see [Note: micro-batches]):
    host-state regions' gradients are copied and accumulated on the host, and nothing
    steps. STREAMED regions: [Note: streamed steps].
    """
    n_reg = ctx.num_regions
    out = EngineRun()
    codes = [_CODES[a.placement] for a in assignment]
    device = [a.state is StatePlacement.DEVICE for a in assignment]
    streamed = [a.state is StatePlacement.STREAMED for a in assignment]
    pf_at = [a.prefetch_at if a.prefetch_at is not None else -1 for a in assignment]
    out.codes, out.device_state, out.prefetch_at = codes, device, pf_at
    up, fwd_s = ctx.upload_s, ctx.fwd_s
    # [Note: the backward beside the host]: host-state regions slow the backward's issue.
    if all(device):
        bwd_s, out.bwd_offsets = ctx.bwd_s, ctx.bwd_offsets
    else:
        bwd_s, out.bwd_offsets = ctx.bwd_s_beside_host, ctx.bwd_offsets_beside_host

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
    update_end = [_NEVER] * n_reg
    param_upload_end = [_NEVER] * n_reg
    out.update_end, out.param_upload_end = update_end, param_upload_end

    # Post-step uploads waiting for the H2D lane: (issue time, region, host task), in
    # issue order. They go on the lane at the compute lane's next issue point.
    pending: deque[tuple[float, int, int]] = deque()
    h2d_free = d2h_free = host_free = 0.0
    last_h = last_d = -1
    t = 0.0
    last_c = -1

    # Streamed steps (see [Note: streamed steps]): state copies up not yet on the H2D lane,
    # (issue, region); device steps whose state is up, (up end, region, up task); and
    # post-step uploads of RESIDENT streamed regions, (issue: the copy down's end, region,
    # down task). Each in issue order; ``s_gate[r]``: when region r's copy down ends (inf
    # until it is placed).
    s_ups: deque[tuple[float, int]] = deque()
    s_steps: deque[tuple[float, int, int]] = deque()
    s_pub: deque[tuple[float, int, int]] = deque()
    s_gate = [math.inf] * n_reg
    # With ``stream_writes_resident``: when a RESIDENT streamed region's device step, which
    # wrote its parameters, ends (inf until placed); its forward waits for that instead.
    s_ready = [math.inf] * n_reg
    writes_resident = ctx.stream_writes_resident
    sdown_res = ctx.stream_down_resident_s
    s_pred = [-1] * n_reg  # the task each state copy up waits for (its region's hook)
    s_late: list[tuple[float, int]] = []  # (issue, region) of those issued in their hooks
    s_win = [math.inf, _NEVER]  # (first copy up's start, last copy down's end)
    sup, sdown, dstep = ctx.stream_up_s, ctx.stream_down_s, ctx.device_step_s
    # Staging in the backward (see the note): the region whose hook opens the ring, and
    # the step's copies up of the staged regions less what went up then.
    stage_hook, stage_first, stage_s = -1, -1, 0.0
    if ctx.streamed is not None and ctx.streamed.staged_chunks and any(streamed):
        stage_hook, stage_first, stage_s, sup = _stage_split(ctx, ctx.streamed, streamed)

    def stream_step() -> None:
        """Put the first device step whose state is up on the compute lane, as soon as both
        are free, and its state's copy down on D2H after it."""
        nonlocal t, last_c, d2h_free, last_d
        ue, pr, ut = s_steps.popleft()
        cf = t_end[last_c] if last_c >= 0 else 0.0
        s = ue if ue > cf else cf
        e = s + dstep[pr]
        last_c = add(LANE_COMPUTE, pr, KIND_STREAM_STEP, s, e, last_c, ut)
        if e > t:
            t = e
        resident = codes[pr] == RESIDENT
        if resident and writes_resident:
            s_ready[pr] = e
        s = e if e > d2h_free else d2h_free
        e = s + (sdown_res if resident else sdown)[pr]
        last_d = add(LANE_D2H, pr, KIND_STREAM_DOWN, s, e, last_d, last_c)
        d2h_free = s_gate[pr] = e
        if e > s_win[1]:
            s_win[1] = e
        if resident and not writes_resident:
            s_pub.append((e, pr, last_d))

    def stream_drain(until: float) -> None:
        """:func:`drain` while streamed work is queued: the device steps whose state is up
        by ``until``, then the H2D task issued first (post-step uploads before streamed
        ones, and those before copies up, on ties), until none issued by ``until`` is
        left."""
        nonlocal h2d_free, last_h
        while True:
            if s_steps and s_steps[0][0] <= until:
                stream_step()
                continue
            first, src = until, 0
            if pending and pending[0][0] <= first:
                first, src = pending[0][0], 1
            if s_pub and s_pub[0][0] <= first and (src == 0 or s_pub[0][0] < first):
                first, src = s_pub[0][0], 2
            if s_ups and s_ups[0][0] <= first and (src == 0 or s_ups[0][0] < first):
                src = 3
            if src == 0:
                return
            if src == 3:
                issue, pr = s_ups.popleft()
                s = issue if issue > h2d_free else h2d_free
                e = s + sup[pr]
                last_h = add(LANE_H2D, pr, KIND_STREAM_UP, s, e, last_h, s_pred[pr])
                h2d_order.append(last_h)
                h2d_free = e
                s_steps.append((e, pr, last_h))
                if s < s_win[0]:
                    s_win[0] = s
                continue
            issue, pr, ht = pending.popleft() if src == 1 else s_pub.popleft()
            s = issue if issue > h2d_free else h2d_free
            e = s + up[pr]
            last_h = add(LANE_H2D, pr, KIND_PARAM_UPLOAD, s, e, last_h, ht)
            h2d_order.append(last_h)
            h2d_free = param_upload_end[pr] = e

    def settle(r: int) -> None:
        """The host blocks until region r's streamed step, carried from the previous step,
        is back down; meanwhile the lanes run the streamed work queued before it. A
        RESIDENT region whose device step wrote its parameters (``writes_resident``) waits,
        on the device, for that step only."""
        nonlocal t
        until = s_ready if writes_resident and codes[r] == RESIDENT else s_gate
        while until[r] == math.inf and (s_steps or s_ups):
            if s_steps:
                stream_step()
            else:
                stream_drain(s_ups[0][0])
        if until[r] > t:
            t = until[r]

    def drain(until: float) -> None:
        """Put the pending uploads issued at or before ``until`` on the H2D lane."""
        nonlocal h2d_free, last_h
        if s_ups or s_steps or s_pub:
            stream_drain(until)
            return
        while pending and pending[0][0] <= until:
            issue, pr, ht = pending.popleft()
            s = issue if issue > h2d_free else h2d_free
            e = s + up[pr]
            last_h = add(LANE_H2D, pr, KIND_PARAM_UPLOAD, s, e, last_h, ht)
            h2d_order.append(last_h)
            h2d_free = param_upload_end[pr] = e

    gated = carry is not None
    gate: Sequence[float] = ()
    s_carried = [False] * n_reg  # regions whose streamed step of the previous step runs now
    carried_any = False
    if carry is not None:
        h2d_free, d2h_free, host_free = carry.h2d_free_s, carry.d2h_free_s, carry.host_free_s
        gate = carry.gate_s
        pending.extend((s, r, -1) for s, r in carry.uploads)
        if carry.streams:
            s_ups.extend(carry.streams)
            for _, r in carry.streams:
                s_carried[r] = True
            carried_any = True

    # ---- forward
    pf_issue = [0.0] * n_reg  # when each region's current prefetch was issued
    if n_reg and codes[0] == ASYNC:
        if gated:
            # The prefetch call blocks the host until the region's update is done.
            if gate[0] > t:
                t = gate[0]
            if carried_any and s_carried[0]:
                settle(0)
            drain(t)
        s = t if t > h2d_free else h2d_free
        e = s + up[0]
        last_h = pf_f_task[0] = add(LANE_H2D, 0, KIND_PREFETCH, s, e, last_h, -1)
        h2d_order.append(last_h)
        h2d_free = e
        pf_issue[0] = t
    for r in range(n_reg):
        q = r + 1
        prefetch_q = q < n_reg and codes[q] == ASYNC
        c = codes[r]
        if gated:
            # The host blocks before issuing region r's forward while the updates that
            # its upload (SYNC r) and region q's prefetch (issued before r's first
            # operation) read are still running: the compute lane cannot pass either.
            if c == SYNC and gate[r] > t:
                t = gate[r]
            if prefetch_q and gate[q] > t:
                t = gate[q]
            if carried_any:
                if c == SYNC and s_carried[r]:
                    settle(r)
                if prefetch_q and s_carried[q]:
                    settle(q)
            drain(t)
        reach = t
        reach_f[r] = reach
        free_at_reach_f[r] = h2d_free
        if prefetch_q:
            pf_issue[q] = reach
            s = reach if reach > h2d_free else h2d_free
            e = s + up[q]
            last_h = pf_f_task[q] = add(LANE_H2D, q, KIND_PREFETCH, s, e, last_h, last_c)
            h2d_order.append(last_h)
            h2d_free = e
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
        elif gated:
            # A resident host-state region waits (on the host) for its update, then
            # (on the device) for the upload that update issued.
            if gate[r] > t:
                t = gate[r]
            if carried_any and s_carried[r]:
                settle(r)
            drain(t)
            if param_upload_end[r] > t:
                t = param_upload_end[r]
        cs_f[r] = t
        e = t + fwd_s[r]
        last_c = f_task[r] = add(LANE_COMPUTE, r, KIND_FWD, t, e, last_c, wait_task)
        t = ce_f[r] = e
        if c:
            lifetimes[r].append((life_start, e))
    if gated:
        # This step's own post-step uploads are told apart from the carried ones by these.
        param_upload_end[:] = [_NEVER] * n_reg
    if carried_any and s_win[1] > _NEVER:
        out.carried_stream_window = (s_win[0], s_win[1])
        s_win[:] = [math.inf, _NEVER]

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
    stepped_early = [False] * n_reg
    free_after_b = [0.0] * n_reg
    pos_after_b = [0] * n_reg
    last_o = -1
    in_flight: deque[tuple[float, int]] = deque()  # (copy end, bytes), in copy order
    level = 0
    dyn = ctx.act_fwd_max
    size, numel = ctx.size, ctx.numel
    gd, hs = ctx.grad_d2h_s, ctx.host_step_s
    grad_work, publish_s = ctx.grad_work, ctx.publish_s
    accumulate_work = ctx.accumulate_work
    publishes = ctx.publishes
    saved_prefix, op_start, op_end = ctx.saved_prefix, ctx.op_start, ctx.op_end
    bwd_offsets, region_max = out.bwd_offsets, ctx.act_bwd_region_max
    grads = out.grads
    after_backward = ctx.host_step_after_backward
    # Host-state regions whose gradients are copied and whose host work is not placed yet:
    # (region, copy end, d2h task), in copy order (the host worker's FIFO order).
    landed: deque[tuple[int, float, int]] = deque()
    deferred: list[int] = []  # regions whose step waits to be queued in forward order
    hooks_ran = False
    # Regions from this index down still copy gradients after their backward; below it
    # the last copy is known (``d2h_free``) and may already have landed at an issue point,
    # as when only device-state regions remain.
    last_copier = next((r for r in range(n_reg) if not device[r] and numel[r] > 0), -1)

    # With the speculation thread, the host worker's own timeline: its gradient work and
    # hooks, not the speculative steps those hand over (which stay on the host lane,
    # whose cores they share). It decides when hooks run and when step() returns.
    spec_thread = ctx.speculation_thread and optimizer_step and not after_backward
    worker_free = host_free
    # Staging (see the note): when the hook opens the ring, and the task it follows.
    stage_issue, stage_pred = math.inf, -1

    def grad_work_of(r: int, land: float, ready: int) -> tuple[float, int]:
        """Place region r's gradient work on the host worker; returns (when its
        gradient-ready hook runs: that work's end, the task its step waits for). The worker
        takes regions in copy order and waits for each copy, even with no work to do."""
        nonlocal host_free, last_o, worker_free, stage_issue, stage_pred
        e = land if land > host_free else host_free
        w_end = land if land > worker_free else worker_free
        for task_kind, w in (grad_work if optimizer_step else accumulate_work)[r]:
            s, e = e, e + w
            w_end += w
            last_o = ready = add(LANE_HOST, r, task_kind, s, e, last_o, ready)
        host_free = e
        worker_free = w_end
        if r == stage_hook and optimizer_step:
            # Its hook opens the ring and stages (see the note).
            stage_issue, stage_pred = (w_end if spec_thread else e), ready
        return e, ready

    early_cost = ctx.speculative_step_cost / ctx.hardware.host_copy_contention
    # Regions that may step in their hooks: with a parameter limit, the host-state
    # regions from the last one down until the first that would pass it.
    # STREAMED regions never step speculatively and need no undo buffers.
    stream_any = optimizer_step and any(streamed)
    may_speculate = [not x for x in streamed] if stream_any else [True] * n_reg
    if ctx.speculative_params is not None:
        left = ctx.speculative_params
        for r in range(n_reg - 1, -1, -1):
            if device[r] or numel[r] == 0 or streamed[r]:
                continue
            if numel[r] > left:
                may_speculate[: r + 1] = [False] * (r + 1)
                break
            left -= numel[r]
    contention = ctx.copy_contention
    stream_contention = ctx.stream_copy_contention

    def update(r: int, ready_s: float, pred: int, early: bool = False) -> None:
        """Place region r's Adam step (and publish), and queue its post-step upload.

        A step after backward costs its plain duration plus what its own copies of the step
        cost the host. An ``early`` one, taken in its gradient hook while backward runs,
        costs ``speculative_step_cost`` times the plain duration, all of it at the
        contended rate: see [Note: step model]."""
        nonlocal host_free, last_o
        s = ready_s if ready_s > host_free else host_free
        if early:
            e = s + hs[r] * early_cost
            stepped_early[r] = True
        else:
            e = s + hs[r]
            if contention:
                e += contention * (gd[r] + (1 if codes[r] == RESIDENT else 2) * up[r])
        last_o = host_task[r] = add(LANE_HOST, r, KIND_HOST_STEP, s, e, last_o, pred)
        host_free = e
        if publishes:
            e = e + publish_s[r]
            last_o = add(LANE_HOST, r, KIND_PUBLISH, host_free, e, last_o, -1)
            host_free = e
        update_end[r] = e
        if codes[r] == RESIDENT:
            pending.append((e, r, last_o))

    def stream_host(r: int, ready_s: float, pred: int) -> None:
        """Where a STREAMED region's host step would run: the host seconds its pinned copies
        of the step take from host work (see [Note: streamed steps]); none without
        contention."""
        nonlocal host_free, last_o
        if not stream_contention:
            return
        s = ready_s if ready_s > host_free else host_free
        resident = codes[r] == RESIDENT
        uploads = (0 if writes_resident else 1) if resident else 2
        copies = gd[r] + uploads * up[r] + sup[r] + (sdown_res if resident else sdown)[r]
        e = s + stream_contention * copies
        last_o = host_task[r] = add(LANE_HOST, r, KIND_STREAM_CONTENTION, s, e, last_o, pred)
        host_free = e

    def hooked(r: int, task: int) -> None:
        """Record the task that ends streamed region r's gradient work (its hook runs then)."""
        s_pred[r] = task

    def hooks_before(limit: float) -> None:
        """Without ``after_backward``: step, as their gradient work ends, the landed regions
        whose gradient-ready hook runs before ``limit`` (a moment known to come no later
        than the last copy's landing)."""
        while landed:
            r, land, ready = landed[0]
            # When the step would start: with the speculation thread too, the thread
            # skips a step that would start after the last copy has landed (the region
            # then steps after the answer), and the steps take the host lane in turn.
            h = land if land > host_free else host_free
            for _, w in grad_work[r]:
                h += w
            if h >= limit:
                return
            landed.popleft()
            e, ready = grad_work_of(r, land, ready)
            if may_speculate[r]:
                update(r, e, ready, early=True)
            else:
                if stream_any and streamed[r]:
                    hooked(r, ready)
                deferred.append(r)  # no speculative buffers: steps after the last hook

    def place_stage() -> None:
        """Put the staged state's copy up on the H2D lane, issued at ``stage_issue``."""
        nonlocal h2d_free, last_h, stage_issue
        s = stage_issue if stage_issue > h2d_free else h2d_free
        e = s + stage_s
        last_h = add(LANE_H2D, stage_first, KIND_STREAM_STAGE, s, e, last_h, stage_pred)
        h2d_order.append(last_h)
        h2d_free = e
        out.stage_start = stage_issue
        stage_issue = math.inf

    for r in range(n_reg - 1, -1, -1):
        reach = t
        reach_b[r] = reach
        if landed and optimizer_step and not after_backward:
            # While a copy is still to come it lands at or after this issue point; once none
            # is, the hooks that run after the last one (even before this point) leave their
            # regions to step(): the runtime's backward-done event is on the d2h stream.
            hooks_before(reach if r >= last_copier else d2h_free)
        if pending and pending[0][0] <= reach:
            drain(reach)
        if stage_issue <= reach:
            place_stage()
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
            # Host work is placed by hooks_before at the next issue points, or after this
            # loop: whether a region steps as it lands depends on when backward ends.
            landed.append((r, e, last_d))
            hooks_ran = True
        gap = saved_prefix[op_start[r]] + level
        if gap > dyn:
            dyn = gap
        if c:
            lifetimes[r].append((life_start, end))
    bwd_end, bwd_task = t, last_c
    if not optimizer_step:
        for r, land, ready in landed:
            grad_work_of(r, land, ready)
        first_s, first_pred = bwd_end, bwd_task
    elif after_backward:
        # The global answer is known when backward ends: regions whose gradients are ready
        # after that step as they land; the others then, in forward order.
        for r, land, ready in landed:
            e, ready = grad_work_of(r, land, ready)
            if stream_any and streamed[r]:
                hooked(r, ready)
                if e > bwd_end:
                    # Issued in its hook, where a host-state region would step.
                    s_late.append((e, r))
                    stream_host(r, e, ready)
                else:
                    deferred.append(r)
            elif e > bwd_end:
                update(r, e, ready)
            else:
                deferred.append(r)
        first_s, first_pred = bwd_end, bwd_task
    else:
        # A hook that runs once the last copy has landed leaves its region to step(),
        # which waits for every hook and then queues those regions in forward order.
        last_copy = d2h_free
        hooks_before(last_copy)
        for r, land, ready in landed:
            e, ready = grad_work_of(r, land, ready)
            if stream_any and streamed[r]:
                hooked(r, ready)
            deferred.append(r)
        first_s, first_pred = host_free, last_o
    landed.clear()
    if stage_issue < math.inf:  # the hook ran after the last issue point
        drain(stage_issue)
        place_stage()
    # When step() returns, having queued the device-state steps (on the compute lane) and
    # the deferred host steps: at the end of backward, whose overflow answer it syncs on;
    # without after_backward, once every gradient-ready hook of this step has run.
    released = t
    hooks_end = worker_free if spec_thread else host_free
    if optimizer_step and not after_backward and hooks_ran and hooks_end > t:
        released = hooks_end
    # The deferred regions' job starts on the host worker once it is free: it issues the
    # streamed ones first, in forward order, then steps the others (see the note). With
    # the speculation thread it starts when step() returns, and waits for the
    # speculative steps only after issuing the streamed regions.
    job_s = released if spec_thread else (first_s if first_s > host_free else host_free)
    for r in sorted(deferred):
        if stream_any and streamed[r]:
            stream_host(r, job_s if spec_thread else first_s, first_pred)
        else:
            update(r, first_s, first_pred)
    own = s_late + [(job_s, r) for r in sorted(deferred) if stream_any and streamed[r]]
    out.h2d_free_before_tail = h2d_free
    out.tail_uploads = [(issue, pr) for issue, pr, _ in pending]
    d2h_carried = d2h_free
    if not own:
        drain(float("inf"))
    t = released
    for r in range(n_reg):
        if device[r] and optimizer_step:
            e = t + ctx.device_step_s[r]
            last_c = add(LANE_COMPUTE, r, KIND_DEVICE_STEP, t, e, last_c, -1)
            t = e
    compute_end = t
    if own:
        # After the device-state steps on the compute lane; in the steady state all of it
        # runs in the next step instead (carried as ``tail_streams``).
        out.tail_streams = own
        s_ups.extend(own)
        drain(float("inf"))
        out.stream_window = (s_win[0], s_win[1])
    stream_end, t = t, compute_end

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
    out.stepped_early = stepped_early
    out.h2d_free_at_reach_f = free_at_reach_f
    out.h2d_free_after_b, out.h2d_pos_after_b = free_after_b, pos_after_b
    out.compute_end_s = t
    out.host_free_end, out.d2h_free_end = host_free, d2h_carried
    out.step_time_s = max(t, stream_end, h2d_free, d2h_free, host_free)
    out.dyn_peak_bytes = dyn
    out.static_bytes = sum(
        (ctx.state_bytes[r] if device[r] else 0) + (size[r] if codes[r] == RESIDENT else 0)
        for r in range(n_reg)
    )
    _assign_pool(ctx, out)
    curve_dyn = -1  # the memory curve's highest dynamic level, once walked
    if out.stage_start is not None:
        curve_dyn, out.stage_level = _curve_levels(ctx, out, out.stage_start)
    stream_dyn = _stream_level(ctx, out, dyn)
    out.peak_bytes = out.static_bytes + out.pool_bytes + max(dyn, stream_dyn)
    if stream_dyn:
        out.stream_peak_bytes = out.static_bytes + out.pool_bytes + stream_dyn
        if not gated:
            # The cold step's peak is its memory curve's, exactly: the level above can add
            # activations and gradients that meet only in sequence at one instant.
            if curve_dyn < 0:
                curve_dyn = _curve_levels(ctx, out, math.inf)[0]
            out.peak_bytes = out.static_bytes + out.pool_bytes + curve_dyn
    return out


def _stage_split(
    ctx: SimulationContext, costs: StreamedStepCosts, streamed: Sequence[bool]
) -> tuple[int, int, float, list[float]]:
    """Staging in the backward (see [Note: streamed steps]): (the streamed region whose
    gradient hook opens the ring: the last in forward order; the first staged region;
    seconds of the staged state's copy up; each region's copy up at the step, the staged
    chunks' state taken out). The leading ``costs.staged_chunks`` chunks of the streamed
    regions in forward order, each region cut into chunks of ``costs.staged_chunk_numel``."""
    hw = ctx.hardware
    numel = ctx.numel
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
        sup[r] = hw.h2d_time_s(math.ceil(n * up_pp - staged * pp)) / hw.stream_up_fraction
    return hook, first, hw.h2d_time_s(math.ceil(total * pp)) / hw.stream_up_fraction, sup


def _stream_level(ctx: SimulationContext, out: EngineRun, dyn: int) -> int:
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
    saved, act_fwd, act_bwd = ctx.saved_prefix, ctx.act_fwd, ctx.act_bwd
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
                during, after = act_fwd[j], saved[j + 1]
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


STEADY_MAX_STEPS = 12
"""Gated steps :func:`steady_state` simulates at most after the cold one."""
STEADY_REL_TOL = 1e-3
""":func:`steady_state` stops when a gated step leaves what it started from, every time
within this fraction of its span."""


@dataclass(frozen=True)
class SteadyState:
    """The repeating step (see [Note: steady state])."""

    period_s: float
    """Seconds per step once steps repeat: what a training loop measures per step."""
    periods_s: tuple[float, ...]
    """Compute-lane spans of the steps simulated, the cold step first."""
    converged: bool
    """Whether the last step left the next one what it had started from (within
    :data:`STEADY_REL_TOL`), so that every later step repeats it; if not, ``period_s`` is
    the mean of the last two spans (a schedule alternating between two spans repeats
    every two steps)."""
    last: EngineRun
    """The last step simulated (the cold one when nothing carries over)."""


def carry_from(prev: EngineRun, period_s: float) -> Carry:
    """What ``prev`` leaves to a step that starts ``period_s`` after it did."""
    gate = [u - period_s for u in prev.update_end]
    # A streamed step runs again in the next step, which waits for it there.
    tail = {r for _, r in prev.tail_uploads} | {r for _, r in prev.tail_streams}
    for r, e in enumerate(prev.param_upload_end):
        if e != _NEVER and r not in tail:
            gate[r] = e - period_s
    return Carry(
        host_free_s=prev.host_free_end - period_s,
        d2h_free_s=prev.d2h_free_end - period_s,
        h2d_free_s=prev.h2d_free_before_tail - period_s,
        gate_s=tuple(gate),
        uploads=tuple((s - period_s, r) for s, r in prev.tail_uploads),
        streams=tuple((s - period_s, r) for s, r in prev.tail_streams),
    )


def _effective_times(carry: Carry) -> list[float]:
    """The times of ``carry`` that :func:`run` can tell apart. Every step event is at or
    after the step's start (0), so an earlier lane-free time or gate acts as 0; the H2D
    lane's free time is only compared with prefetch issues (at or after 0) and with the
    first carried upload's issue."""
    floor = 0.0
    if carry.uploads:
        floor = min(floor, carry.uploads[0][0])
    if carry.streams:
        floor = min(floor, carry.streams[0][0])
    return [
        max(carry.host_free_s, 0.0),
        max(carry.d2h_free_s, 0.0),
        max(carry.h2d_free_s, floor),
        *(max(g, 0.0) for g in carry.gate_s),
        *(issue for issue, _ in carry.uploads),
        *(issue for issue, _ in carry.streams),
    ]


def same_carry(a: Carry, b: Carry, tol_s: float) -> bool:
    """Whether steps started from ``a`` and from ``b`` run alike: the same carried uploads,
    and every time :func:`run` reads within ``tol_s`` seconds (equal ones: the same step)."""
    if [r for _, r in a.uploads] != [r for _, r in b.uploads]:
        return False
    if [r for _, r in a.streams] != [r for _, r in b.streams]:
        return False
    return all(
        abs(x - y) <= tol_s for x, y in zip(_effective_times(a), _effective_times(b), strict=True)
    )


def steady_state(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], cold: EngineRun
) -> SteadyState:
    """Iterate steps from the cold step ``cold`` of ``assignment`` until one leaves the
    next what it started from (see [Note: steady state]). With several micro-batches per
    step, the period also counts the others (see [Note: micro-batches])."""
    found = _steady_state(ctx, assignment, cold)
    if ctx.micro_batches == 1:
        return found
    accumulate = run(ctx, assignment, optimizer_step=False).compute_end_s
    extra = (ctx.micro_batches - 1) * accumulate
    return SteadyState(found.period_s + extra, found.periods_s, found.converged, found.last)


def _steady_state(
    ctx: SimulationContext, assignment: Sequence[RegionAssignment], cold: EngineRun
) -> SteadyState:
    period = cold.compute_end_s
    numel, device = ctx.numel, cold.device_state
    if not any(numel[r] > 0 and not device[r] for r in range(ctx.num_regions)):
        # Nothing runs off the compute lane, so nothing carries over.
        return SteadyState(period, (period,), True, cold)
    periods = [period]
    prev = cold
    carry = carry_from(cold, period)
    for _ in range(STEADY_MAX_STEPS):
        prev = run(ctx, assignment, carry)
        span = prev.compute_end_s
        periods.append(span)
        # A step is a function of its carry alone: one that leaves what it started from
        # repeats forever. Equal spans are not enough: a gated step can match the cold one
        # (or its predecessor) in span while a lane still runs later each step.
        nxt = carry_from(prev, span)
        if same_carry(carry, nxt, STEADY_REL_TOL * span):
            return SteadyState(span, tuple(periods), True, prev)
        carry = nxt
    return SteadyState((periods[-1] + periods[-2]) / 2, tuple(periods), False, prev)


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
    pool_curve, raw_curve = _memory_curves(ctx, out)
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


def _memory_curves(
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


def _curve_levels(ctx: SimulationContext, out: EngineRun, since_s: float) -> tuple[int, int]:
    """The highest dynamic level of the pool memory curve of :func:`_memory_curves`
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
        offs = out.bwd_offsets[r]
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


def _compact(samples: list[MemorySample]) -> tuple[MemorySample, ...]:
    """Drop samples that repeat the previous level; keep same-time samples (short peaks)."""
    out: list[MemorySample] = []
    for m in samples:
        if out and out[-1].bytes == m.bytes:
            continue
        out.append(m)
    return tuple(out)
