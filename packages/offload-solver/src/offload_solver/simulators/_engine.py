"""The discrete-event model of one training step, shared by every simulator strategy.

The model is written down here, once; its parts live in modules of their own:

- ``_context``: what a simulation is told, costed once per profile, machine and cost
  model (``SimulationContext``, ``RegionAssignment``; [Note: issuing ahead] and [Note:
  the backward beside the host]);
- ``_timeline``: the lanes, the tasks put on them and the per-region times of a run
  (``EngineRun``, ``Lanes``, ``KINDS``), and the tasks' critical-path ``slack``;
- ``_step``: one step, forward, backward and the host work after it (``run``);
- ``_stream``: STREAMED regions' work in a step (``StreamWork``);
- ``_activations``: what recomputing a region's activations or sending them to the host
  does to the step's levels and tasks ([Note: activations]);
- ``_steady``: the repeating step (``steady_state``; [Note: steady state]);
- ``_memory``: the pool, the peak and the memory curves;
- ``_result``: what a simulation predicts (``SimulationResult``, ``to_result``).

This module re-exports the names solvers and tools use from them.

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
- Optimizer work counts a region's trainable parameters only (``Region.stepped_numel``;
  ``numel`` below stands for it wherever it prices gradients, state or steps): a region
  without any copies no gradient, holds no state and takes no step, on either side.
- After region i's backward, a HOST-state region copies its gradients to the host on D2H
  (``numel * host_grad_bytes_per_param``); its gradient (``stepped_size_bytes``) stays on
  the device until that copy ends. The runtime's host worker (HOST: one FIFO worker) takes
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
  period of the repeating step: [Note: steady state] in ``_steady``.

Memory follows [Note: memory model] in ``offload_solver.profile``. Offloaded regions live in
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

Activations are kept from forward to backward unless the context says otherwise
(``SimulationContext.activations``): a RECOMPUTE region runs its forward again on the
compute lane before its backward, a HOST region copies its saved bytes down after its
forward and back before its backward ([Note: activations] in ``_activations``).

Compute is accounted per region (the sum of its operations' times); memory per operation,
so a gradient copy that ends in the middle of a region lowers the level of the operations
that start after it. An event at the same instant as an operation's start is seen by it.


[Note: streamed steps]
A STREAMED region (``StatePlacement.STREAMED``, costs in ``SimulationContext.streamed``,
a :class:`~offload_solver.plan.StreamedStepCosts`) keeps its master weights and moments
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
  the cost model's ``stream_host_charge`` ``s``. It stands for the slower host steps of
  the other regions while those copies run; none when ``c`` is 1 or ``s`` is 0. Host
  memory slows both sides, so the charge can be split: with ``s`` below 1 the host takes
  that share and the copies up the rest, through ``stream_up_fraction`` (both fitted:
  ``offload_solver.cost_model.CostModel``).
- The host worker issues a streamed region's device step where it would step it were it
  a HOST region outside the speculating set, without waiting for it: in its hook when
  that runs after backward with ``host_step_after_backward``; otherwise at the start of
  the job that ``step()`` queues for the deferred regions, once the worker has done
  everything queued before it (the hooks, and the steps taken in them), all of the job's
  streamed regions at once, in forward order, before its host steps. (bf16 and fp32 need
  no answer and could issue earlier, as gradients land; that is not modelled: the runtime
  leaves them to ``step()`` too.) Each gets three tasks, every lane FIFO by issue:
  1. ``stream_up`` on H2D, ``numel * up_bytes_per_param`` bytes at the cost model's
     ``stream_up_fraction`` of the H2D rate, issued then and put on the lane as
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
- Staging in the backward (``StreamedStepCosts.staged_chunks``; a plan's
  ``PlanOptions.stage_in_backward``): the gradient hook of the last streamed region
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
waits for them, and the steady state ([Note: steady state] in ``_steady``) already
counts that wait once. Memory is the same in every micro-batch: device-state regions'
fp32 gradients are part of their state.
"""

from __future__ import annotations

from offload_solver.simulators._context import (
    RegionAssignment,
    SimulationContext,
    check_speculative_params,
    issued_starts,
)
from offload_solver.simulators._memory import first_fit, overlaps
from offload_solver.simulators._result import SimulationResult, to_result
from offload_solver.simulators._steady import (
    STEADY_MAX_STEPS,
    STEADY_REL_TOL,
    Carry,
    SteadyState,
    carry_from,
    same_carry,
    steady_state,
)
from offload_solver.simulators._step import run
from offload_solver.simulators._timeline import (
    ASYNC,
    KIND_HOST_STEP,
    KINDS,
    LANES,
    RESIDENT,
    SYNC,
    EngineRun,
    slack,
)

__all__ = [
    "ASYNC",
    "KINDS",
    "KIND_HOST_STEP",
    "LANES",
    "RESIDENT",
    "STEADY_MAX_STEPS",
    "STEADY_REL_TOL",
    "SYNC",
    "Carry",
    "EngineRun",
    "RegionAssignment",
    "SimulationContext",
    "SimulationResult",
    "SteadyState",
    "carry_from",
    "check_speculative_params",
    "first_fit",
    "issued_starts",
    "overlaps",
    "run",
    "same_carry",
    "slack",
    "steady_state",
    "to_result",
]
