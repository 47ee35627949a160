"""Host-state regions stepped on the device (the plan's ``StatePlacement.STREAMED``).

[Note: streamed steps]
A streamed region keeps its fp32 master and Adam moments in pinned host memory, as a
host-state region does, and its gradient comes down to the host as one's does; but its
Adam step runs on the device. Chunk by chunk (``STREAM_CHUNK_NUMEL`` elements), through a
ring of ``STREAM_SLOTS`` device buffer sets on three streams of its own (made once per
optimizer, :func:`ring_streams`):

- *up* (h2d): master, moments and gradient of the chunk into a free slot;
- *step*: the gradient and narrow moments widened to fp32 work buffers, torch's fused
  Adam(W) (the kernel device-state regions use), the moments narrowed back and, with fp16
  I/O, the new master narrowed into the slot's fp16 copy;
- *down* (d2h): master, moments (and the fp16 copy, into the region's upload copy) back
  to their host buffers; the slot is free again once they land.

Per parameter with bf16 moments and fp16 I/O that is 10 bytes up and 10 down over PCIe
and no host pass at all, against the host kernel's 20 bytes of host-memory traffic. The
host worker issues every streamed region of a step first (issuing blocks on nothing: a
slot's reuse waits on the device), then steps the host regions on the CPU, and between
them publishes each streamed region whose downloads have landed (in forward order). So
the device and the host step different regions at the same time, which is the point:
on the H200, streaming half of W4's host step through the GPU while the host stepped the
other half took 0.75x the time of the host alone (``benchmarks/split_step_bench.py``),
and W4 planned with 30 of its 84 host-state regions streamed ran at 0.96x torchao's step
(BENCHMARKS.md, session 22). With ``OverlapMode.DEVICE_ANSWER`` a region whose gradients
land after the step's answer is stepped by its own hook instead; a streamed one is only
issued there (``HybridAdam.issue_region``), into the same ring and queue, and published
once landed, at a later hook or in the task that ``step()`` queues behind the last hook.
The hook does not wait for the device: the copies of one region take longer than its
host step would.
With ``HybridAdam(issue_thread=True)``, the default, the task hands its streamed
regions to a thread of their own, which issues them in the same order while the host
worker steps the others from the start: issuing is Python and CUDA calls per chunk,
0.4-0.6 ms each in profiled GPU runs (BENCHMARKS.md, session 24), taken off the thread
that bounds host-heavy steps (W2's median step 1-13% shorter and W4's 4%, session 25).
The queue takes entries from that thread under a lock. The ring stays open while the
thread issues: between its host steps the task checks whether the thread is done, and
the ring closes at the first check after that once every streamed region has landed.
``issue_thread=False`` issues on the host worker, before its host steps.

[Note: paced ring]
Unpaced, the ring queues every chunk of a task at once, each slot's next upload waiting
on the device for its last download. The copies sit on the copy engine's queue ahead of
whatever is issued after them, and the runtime's prefetches of the next forward's
parameters are (the h2d stream): on an H200 (session 28) the forward's uploads ran
100-200 ms after they were issued while the ring's 5-20 GB went up first, and the
compute stream idled 130-210 ms per step with its kernels queued (W2, W3 and W4, profiled
steps of ``offload_bench.py``). ``issue(..., paced=True)`` issues a chunk only once its
slot's last download has landed, so at most a slot's worth of copies is queued ahead of
a prefetch. The issuing thread then blocks, so only the issuing thread
(``HybridAdam(issue_thread=True)``, with ``paced_ring=True``: both the default) paces;
the host worker and the hooks never do. One plan run each way (session 28): W3's mean
step 465 -> 439 ms, W2's 393 -> 380 ms, with the longest prefetch wait in W2's profiled
steps 186 -> 17 ms. The planner still models the unpaced ring (every copy up on the H2D
lane in issue order, [Note: streamed steps] in the solver's simulator), so it predicts a
paced step as it would the unpaced one.

[Note: publishing while issuing]
Paced, the issuing thread can still be issuing when step()'s host task has finished its
host steps. The task used to wait for the issuing thread first and only then publish,
so regions that had landed meanwhile stayed unpublished, and the next forward, which
waits for each region's publish, waited with them. In W2's profiled steps on an H200
(session 29, ``benchmarks/results/s29c2_trace_W2.json.gz``), four streamed regions were
published together right after the last issue ended, 15-72 ms after their own issue
ended, where a region published between host steps waited 4-17 ms. Now the task, its
host steps done, keeps publishing what has landed, checking every ``PUBLISH_POLL_S``,
until the issuing thread is done. That is what the planner already assumed: a streamed
region is published when its downloads land.

[Note: the issuing thread publishes]
Between host steps is still late when the host worker is in one: in session 42's
profiled steps on an H200 (``copy_lag.py TRACE --publishes``), W4's 25 streamed regions
were published a median 8 ms after their downloads landed (at most 25 ms;
``benchmarks/results/s42c3_trace_W4_sp_thread.json.gz``) and W2's 11 ms (at most 22;
``s42c4_trace_W2_s.json.gz``), each waiting for the host step in progress to end, and
the next forward waits for each publish. With ``HybridAdam(issuer_publishes=True)``, the
default, the issuing thread publishes too: whatever has landed while it waits for a free
slot, after each region it issues, and then each region as it lands until none is left
(:meth:`StreamedQueue.publish_until_empty`), before it reports itself done. It publishes
only regions whose publish casts nothing on the host: those whose device step wrote
their device parameters, or (fp16 I/O) their upload copy. Any other publish casts the new
master on the host, which would hold up the issuing, so the issuing thread stops at the
first such entry and leaves it, and the entries after it, to the host worker. The queue
takes each entry once and in order whichever thread publishes (one publishes at a time;
the issuing thread skips a round rather than wait for the host worker). The ring is
still closed by the host worker, at its first check after the issuing thread is done.

[Note: yielding the link]
Paced, the ring still has a chunk or two of copies up queued when a prefetch of the next
forward's parameters is issued, and on an H200 the copy engine does not take them in
issue order: in session 37's W3 trace the first prefetch of the forward, issued at
248.3 ms on the runtime's h2d stream, ran at 264.5, after ring chunks issued at 252.9-260.3
ms had gone up (``copy_lag.py benchmarks/results/s37c3_trace_W3.json.gz --window 236:275
--streams 57,65,73``). With ``HybridAdam(ring_yields=True)`` (a ring built with
``after=`` the h2d stream) each chunk's copies up wait on the device for what the h2d
stream had queued when the chunk was issued, so a prefetch or upload issued before a chunk
goes up before it. No cycle: the h2d stream's work waits only for the compute stream's
release of a slot, and the compute stream waits for a streamed region only once its
chunks were issued. The planner's H2D lane is FIFO by issue, as before.

[Note: staging ahead]
A streamed region's copies up (master, moments, gradient) do not depend on the step's
answer: only its device step (the loss scale and clipping coefficient it divides by, and
whether it runs at all) does. Yet they used to be issued only once step()'s task had the
answer and the issuing thread got to them. In session 43's W3 trace on an H200
(``benchmarks/results/s43c3_trace_W3_pub_on2.json.gz``, ``copy_lag.py --window
235:300``), ``step()`` began at 244.2 ms with the h2d lane idle, the first copy up of
streamed region 1 ran at 254.0 (the answer's sync, the task's queueing, the ring's
allocation, the issuing thread's start), and the next forward idled 12 ms for region 1
and 12 ms for region 5 behind it. With
``HybridAdam(stage_ahead=True)`` step() first queues a task that opens the ring and
issues the copies up of the streamed regions' leading chunks, in forward order, into its
free slots (:meth:`StreamRing.stage`, as many chunks as there are slots), and then works
out its answer. The step's task issues the same chunks as before; a chunk that was
staged skips its copies up and steps once they are done. If the step is skipped, the
ring is closed, the staged copies unused (nothing on the host was written). The host
buffers staged are final by then: step() waited for the window's gradient work, and the
streamed regions' last downloads landed in the previous step's task, which ran first.
The planner already issues a streamed region's copies up as step() returns, beside the
device-state steps ([Note: streamed steps] in the solver's simulator), so it predicts the
staged step more closely than the unstaged one. Off by default: on an H200 in session 44
(``benchmarks/results/s44c2_trace_W3_stage_{on2,off1}.json.gz``) W3's first copy up ran
at 238.1 ms staged against 246.9, and the first compute gap at the boundary fell from 29
ms to 19, but the H2D lanes were then busy without a break to about 300 ms either way
(the streamed regions' 14 bytes a parameter and the host-stepped regions' uploads), so
the forward waited later instead: 263-276 ms a step against 264-268. W2 stepped 402-424
ms staged against 383.

[Note: staging the state in backward]
Staged at step(), the copies up run when the H2D link is busiest: in session 44's W3
trace it carried the ring's chunks and the host-stepped regions' uploads without a break
from the step to 60 ms into the next forward. Yet in the last 50 ms of that backward it
was busy for 6.5-9.8 ms (``copy_lag.py benchmarks/results/s43c3_trace_W3_pub_on2.json.gz
--window 195:245``, and ``s44c2_trace_W3_stage_off1.json.gz --window 190:246``), and
most activations are freed by then (backward frees them as it goes). Only the gradient
(2 of a chunk's 14 bytes a parameter, fp32 moments and fp16 gradients) is made by that
backward; the master weights and moments are final once the last step's downloads
landed. With ``HybridAdam(stage_in_backward=True)``, the gradient hook of the first
streamed region to land in the backward before a step (the host worker's, in the last
micro-batch, with overlap) opens the ring and issues the copies up of the master weights
and moments of the streamed regions' leading chunks in forward order, into its free
slots (:meth:`StreamRing.stage` with no gradient). The last step's downloads have landed
by then: its task, which ran first on the host worker, closed its ring only after them;
a ring still open stages nothing. With ``stage_ahead`` too, step()'s own staging finds
the ring open and stages nothing more. The step's task steps those chunks from their
slots, each first copying up its gradient (behind the staged copies, on the same
stream), and copies the rest up as before. A staged chunk is known by its master and
bounds alone, so any gradient the step has for it goes up; asked in another order, the
ring drops the staged chunks and copies up again. Host-state regions stepped in their
hooks after it (bf16 training) publish what has landed, which used to close a ring with
nothing queued: a ring holding staged chunks is now closed only by a waiting publish
(the end of the step's task, or :meth:`HybridAdam.drop_staged`, which a skipped step
calls as ``stage_ahead``'s does). The planner models it when the costs say so
(:func:`streamed_step_costs` with ``stage_in_backward``, :func:`with_stage_in_backward`:
``StreamedStepCosts.staged_chunks``): one copy up of the staged state from the hook, the
ring held from there, and the step's copies up without it ([Note: streamed steps] in
``offload_solver.simulators._engine``). Session 45's H200 measured W3 at 246.0 ms staged
against 255.8 (the medians of the 5-fastest steps on one plan) and W2 the same (373.9
against 371.3), at the same peaks (``benchmarks/results/s45c2_*``, ``s45c3_*``); replayed
with the staging counted (``python benchmarks/replay_bench.py
benchmarks/results/s45c2_W3_bstage_*.json``) W3 replans with 3 streamed regions at 229 ms
against 238, and W2 keeps its 9 at 351 against 352. It is on by default
(:data:`STAGE_IN_BACKWARD`).

[Note: more slots to stage]
The backward stages one chunk per ring slot, so with :data:`STREAM_SLOTS` (3) it stages
3 chunks; the rest of the streamed regions' state goes up at the step boundary. In
session 50's W3 on an H200 (``copy_lag.py benchmarks/results/s50c6_trace_W3_blend1.json.gz
--window 240:320``) the 3 staged chunks held streamed region 1's state, and regions 5
and 11 (48 M parameters each, 3 chunks, 14 bytes a parameter) went up from 278 to 308 ms
behind the host-stepped regions' uploads; the next forward idled 10 and 7 ms waiting
for them, while the H2D link had carried little in the
backward. ``streamed_step_costs(slots=N)`` plans a ring of N slots (chunks as before,
within the budget's tenth, so a small budget gets more, smaller chunks): N chunks staged
in the backward, the ring's N slots of device memory held from the staging hook, which
the planner counts. The optimizer builds its ring as the plan says (:func:`ring_shape`:
``staged_chunks`` slots of ``staged_chunk_numel``). A slot count other than the default
needs staging: a plan that stages nothing records no slot count. Values do not depend on
it. The simulator models the ring unpaced ([Note: paced ring]): the streamed state all
issued at the step, ahead of the forward's uploads on its FIFO H2D lane, and predicts no
change from more slots (W3 227.3 ms for 3 to 6 slots, ``replay_bench.py --stream-slots
N``); whether the paced ring, whose state went up after those uploads, gains from it is
for a GPU to say (``gpu_session.sh slotab``).

[Note: writing resident parameters]
A resident streamed region's parameters live on the device, and its device step has the
new master there. It used to narrow it into the slot's fp16 copy, copy that down into the
region's upload copy and, once the downloads landed and the region was published, upload
it again: 2 bytes per parameter each way, and the next forward waiting for the copy down
and the upload behind whatever else was going up (W3 in session 37:
``benchmarks/results/s37c3_trace_W3.json.gz``, the forward idle 33 ms for two streamed
regions). Now (``StreamedStepCosts.resident_down_bytes_per_param`` set, the default of
:func:`streamed_step_costs`) the step writes the region's device parameters in place
(``StreamPiece.device_out``, cast from the fp32 master on the step stream, as the upload
copy's narrowing rounds), nothing of them comes down, and the region is not uploaded
again. When step()'s host task issues it, the task hands the runtime the step stream's
event after it (``OffloadController.ready_early``): the region's next forward waits for
that on the device instead of for its downloads and publish on the host. The copies down
of master and moments still land, and the region is published (its host state complete)
as before; the next step's work on it waits for that. The device parameters are free to
overwrite then: the region's backward ran before its gradients came down, which the
host saw before issuing. Offloaded regions keep their fp16 copy coming down (their
parameters live on the host).

Values: widening is exact and the narrowing rounds to nearest even, as the host kernels
do, and the update is torch's fused kernel: bit for bit what ``host_kernel="torch"``
computes, and within rounding (about 1e-7 of an update) of ``"single_pass"``. A streamed
region never steps speculatively (it steps after the step's answer, so nothing needs
undoing), and after its step the region's fp32 gradient accumulator still holds the
gradient as it was (loss scale included): the device divided its own copy.

Device memory: the ring's buffers exist only while a task streams: allocated on the step
stream when the task issues its first streamed region, freed as soon as its last
streamed region is published (not at the end of the task: the planner counts the ring
until the last download, and W2 held past it broke its budget in session 22).
:func:`stream_slot_bytes` says how many bytes. Every ring runs on the same streams, so
that the caching allocator hands the next ring the last one's blocks.
On a machine without CUDA the "device" is the CPU and every copy runs at once, in order:
the same values, for tests.

[Note: timing the ring's copies up]
The planner runs the ring's copies up at ``HardwareProfile.stream_up_fraction`` of the
profile's H2D rate (0.78 by default, ``offload_runtime.api.STREAM_UP_FRACTION``). In the
training loop they share the PCIe link with the ring's copies down and the runtime's
uploads, and on an H200 W2's ring went up at 0.62-0.68 of the rate and W4's at 0.62-0.75
(``benchmarks/copy_lag.py`` on the profiled steps of sessions 50-54; BENCHMARKS.md,
session 54); replayed at 0.67 with the loop's host rate, W2's measured plans came to
13-15% under their run means against 18-23% as replanned (``replay_bench.py --hold-plan
--host-rate loop``). A ring built ``timed`` (``HybridAdam``'s
rings on CUDA) records a pair of timing events around each chunk's copies up on its up
stream, the first after the chunk's waits, so the pair spans the copies alone (with
whatever else shares the link then), and the bytes they carry (:class:`UpCopy`). The
issuing code takes them per streamed region (:meth:`StreamRing.take_up_copies`) and
reads them when the region is published, once its downloads (and so its copies up) have
landed (:func:`up_copy_time`: no host sync); :class:`~offload_optim.hybrid_adam.
RegionStepTiming` carries the sums and ``offload_optim.check_stream_rate`` turns a
loop's steps into the fraction to plan with, as ``check_host_rate`` does for the host.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload_optim.kernels import AdamHyper, fused_adam_, scale_tensor
from offload_runtime.streams import Event, Stream
from offload_solver import StreamedStepCosts

STREAM_CHUNK_NUMEL = 16 << 20
"""Elements of a region streamed at a time (one slot of the ring)."""
STREAM_SLOTS = 3
"""Buffer sets in the ring: one uploading, one stepping, one downloading."""
RING_BUDGET_SHARE = 0.1
"""At most this share of the device budget goes to the ring when
:func:`streamed_step_costs` is given the budget (W2's 3 GiB: a 0.3 GiB ring, not 0.81)."""
MIN_CHUNK_NUMEL = 1 << 16
"""The smallest chunk :func:`streamed_step_costs` sizes a ring to."""

MASTER_BYTES = 4


def _sizes(moments_dtype: torch.dtype, fp16_io: bool) -> tuple[int, int]:
    """(bytes of one moment, bytes of the gradient streamed up) per parameter: fp16 I/O
    streams the fp16 gradient from the staging buffer, otherwise the fp32 accumulator."""
    return moments_dtype.itemsize, (2 if fp16_io else 4)


def stream_slot_bytes(
    moments_dtype: torch.dtype,
    fp16_io: bool,
    *,
    chunk_numel: int = STREAM_CHUNK_NUMEL,
    slots: int = STREAM_SLOTS,
) -> int:
    """Device bytes a :class:`StreamRing` holds while it streams: per slot, master,
    moments, gradient (and the fp16 copy with ``fp16_io``) of ``chunk_numel`` elements,
    plus one set of fp32 work buffers for what is narrower than fp32."""
    moment, grad = _sizes(moments_dtype, fp16_io)
    per_slot = MASTER_BYTES + 2 * moment + grad + (2 if fp16_io else 0)
    work = (4 if grad < 4 else 0) + (8 if moment < 4 else 0)
    return chunk_numel * (slots * per_slot + work)


def streamed_step_costs(
    moments_dtype: torch.dtype,
    fp16_io: bool,
    *,
    budget_bytes: int | None = None,
    chunk_numel: int | None = None,
    write_resident: bool = True,
    stage_in_backward: bool | None = None,
    slots: int = STREAM_SLOTS,
) -> StreamedStepCosts:
    """What :class:`StreamRing` moves per parameter and holds on the device, for the
    planner (``memory_optimize(streamed=...)``): pass the ``HybridAdam``'s moments dtype
    and ``fp16_io``, and the device budget in bytes so that the ring takes at most
    ``RING_BUDGET_SHARE`` of it (chunks of ``STREAM_CHUNK_NUMEL`` elements at most,
    ``MIN_CHUNK_NUMEL`` at least). ``chunk_numel`` sets the chunk instead. The optimizer
    builds its rings to the plan's ``slot_bytes`` (:func:`chunk_numel_for`).
    ``write_resident`` (default True): a resident region's device step writes its new
    parameters on the device ([Note: writing resident parameters]); False: they come
    down with its state and go up again after it, as before session 38. The optimizer
    follows the plan's choice. ``stage_in_backward`` (None: :data:`STAGE_IN_BACKWARD`,
    ``HybridAdam``'s default): the optimizer is built with
    ``HybridAdam(stage_in_backward=True)``, so the planner counts the master weights and
    moments of one chunk per ring slot going up in the backward, and the ring held from
    there ([Note: staging the state in backward]). ``slots`` (default
    :data:`STREAM_SLOTS`): buffer sets in the ring, and so, with staging, chunks staged in
    the backward; the optimizer builds its ring with the plan's (``staged_chunks``).
    Another count than the default needs ``stage_in_backward``: a plan without staging
    records no slot count for the optimizer to follow ([Note: more slots to stage])."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
        raise ValueError(f"slots={slots!r} must be an int >= 2 (one copying, one stepping)")
    if chunk_numel is None:
        chunk_numel = STREAM_CHUNK_NUMEL
        if budget_bytes is not None:
            if budget_bytes <= 0:
                raise ValueError(f"budget_bytes={budget_bytes} must be > 0")
            per = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=1, slots=slots)
            cap = int(budget_bytes * RING_BUDGET_SHARE) // per
            chunk_numel = max(MIN_CHUNK_NUMEL, min(chunk_numel, cap))
    up, down = stream_copy_bytes(moments_dtype, fp16_io)
    slot = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=chunk_numel, slots=slots)
    costs = StreamedStepCosts(
        up_bytes_per_param=up,
        down_bytes_per_param=down,
        slot_bytes=slot,
        resident_down_bytes_per_param=resident_down_bytes(moments_dtype)
        if write_resident
        else None,
    )
    stage = STAGE_IN_BACKWARD if stage_in_backward is None else stage_in_backward
    if slots != STREAM_SLOTS and not stage:
        raise ValueError(
            f"slots={slots} needs stage_in_backward: a plan that stages nothing records "
            f"no slot count, so the optimizer would build its ring of {STREAM_SLOTS}"
        )
    return with_stage_in_backward(costs, moments_dtype, fp16_io, stage, slots=slots)


def with_stage_in_backward(
    costs: StreamedStepCosts,
    moments_dtype: torch.dtype,
    fp16_io: bool,
    stage: bool = True,
    *,
    slots: int = STREAM_SLOTS,
) -> StreamedStepCosts:
    """``costs`` as a ``HybridAdam(stage_in_backward=stage)`` with these moments and
    ``fp16_io`` moves them, its ring ``slots`` buffer sets of ``costs.slot_bytes`` in all:
    with ``stage``, one chunk per ring slot (the chunk its ring builds from
    ``costs.slot_bytes``, :func:`chunk_numel_for`) of master weights and moments going up
    in the backward ([Note: staging the state in backward]); without, none."""
    if not stage:
        return dataclasses.replace(
            costs, staged_chunks=0, staged_chunk_numel=0, staged_bytes_per_param=0.0
        )
    return dataclasses.replace(
        costs,
        staged_chunks=slots,
        staged_chunk_numel=chunk_numel_for(costs.slot_bytes, moments_dtype, fp16_io, slots=slots),
        staged_bytes_per_param=float(resident_down_bytes(moments_dtype)),
    )


def ring_shape(
    costs: StreamedStepCosts | None, moments_dtype: torch.dtype, fp16_io: bool
) -> tuple[int, int]:
    """(chunk elements, slots) of the ring a ``HybridAdam`` builds for a plan with these
    streaming ``costs``: a staging plan's ``staged_chunks`` slots of its
    ``staged_chunk_numel`` elements (what the planner counted going up in the backward);
    otherwise :data:`STREAM_SLOTS` slots sized to ``costs.slot_bytes``; with no costs
    (streamed regions set by hand) :data:`STREAM_SLOTS` slots of
    :data:`STREAM_CHUNK_NUMEL`, read at the call (tests make it small)."""
    if costs is None:
        return STREAM_CHUNK_NUMEL, STREAM_SLOTS
    if costs.staged_chunks:
        return costs.staged_chunk_numel, costs.staged_chunks
    return chunk_numel_for(costs.slot_bytes, moments_dtype, fp16_io), STREAM_SLOTS


def chunk_numel_for(
    slot_bytes: int, moments_dtype: torch.dtype, fp16_io: bool, *, slots: int = STREAM_SLOTS
) -> int:
    """The chunk of a ring that holds ``slot_bytes`` device bytes (the inverse of
    :func:`stream_slot_bytes`, rounded down)."""
    per = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=1, slots=slots)
    if slot_bytes < per:
        raise ValueError(
            f"a ring of {slot_bytes} bytes holds no element ({per} bytes per element with "
            f"{slots} slots)"
        )
    return slot_bytes // per


def stream_copy_bytes(moments_dtype: torch.dtype, fp16_io: bool) -> tuple[int, int]:
    """(bytes up, bytes down) per streamed parameter and step: master, moments and
    gradient up; master, moments (and the fp16 copy with ``fp16_io``) down."""
    _, grad = _sizes(moments_dtype, fp16_io)
    state = resident_down_bytes(moments_dtype)
    return state + grad, state + (2 if fp16_io else 0)


def resident_down_bytes(moments_dtype: torch.dtype) -> int:
    """Bytes down per parameter of a resident streamed region whose device step writes
    its parameters on the device: master and moments only (the state every streamed
    region moves each way, :func:`stream_copy_bytes`)."""
    return MASTER_BYTES + 2 * moments_dtype.itemsize


WRITE_RESIDENT = True
"""Whether a ``HybridAdam`` whose plan recorded no streaming costs (streamed regions set
by hand, as tests do) writes resident streamed regions' parameters on the device; with
costs it does what they say (``StreamedStepCosts.resident_down_bytes_per_param``)."""

STAGE_IN_BACKWARD = True
"""``HybridAdam(stage_in_backward=)``'s default, and what :func:`streamed_step_costs` plans
for unless told ([Note: staging the state in backward]). On from session 45, whose H200
measured W3 9.8 ms faster with it (246.0 against 255.8 ms, the medians of the 5-fastest
steps) and W2 the same, at the same peaks, and whose rows the planner, counting it,
replays at 229 ms against 238 (W3) and 351 against 352 (W2)."""

PACE_POLL_S = 1e-4
"""Seconds a paced ring's issuing thread sleeps between checks that a slot is free."""

PUBLISH_POLL_S = 5e-4
"""Seconds step()'s host task waits for the issuing thread between checks for landed
streamed regions, once its host steps are done ([Note: publishing while issuing])."""


def wait_polling(
    event: Event, poll_s: float = PACE_POLL_S, between: Callable[[], None] | None = None
) -> None:
    """Block until ``event`` has happened, sleeping ``poll_s`` between queries: the thread
    gives up its core (``Event.synchronize`` may spin on one that the host Adam uses) and
    the GIL. ``between()``, if given, runs before each sleep (the issuing thread
    publishing landed regions while it waits for a slot)."""
    while not event.query():
        if between is not None:
            between()
        time.sleep(poll_s)


@dataclass(frozen=True)
class UpCopy:
    """One chunk's copies up through a timed ring ([Note: timing the ring's copies up]):
    device events around them on the ring's up stream, and their bytes."""

    start: torch.cuda.Event
    """Recorded after the chunk's waits (its slot free, the h2d stream's queue with
    ``ring_yields``): when the up stream got to its copies."""
    end: torch.cuda.Event
    nbytes: int


def up_copy_time(copies: list[UpCopy]) -> tuple[int, float]:
    """(bytes, seconds) of ``copies`` whose copies have finished on the device; those not
    yet finished are left out (their events cannot be timed yet). Reads the events, no
    host sync."""
    nbytes, seconds = 0, 0.0
    for c in copies:
        if c.end.query():  # type: ignore[no-untyped-call]
            nbytes += c.nbytes
            seconds += c.start.elapsed_time(c.end) / 1e3
    return nbytes, seconds


@dataclass
class _Slot:
    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    half: torch.Tensor | None
    grads: dict[torch.dtype, torch.Tensor]
    """Gradient buffer per gradient dtype streamed (fp16 I/O pieces, fp32 others)."""
    free: Event | None = None
    """When the slot's last download has landed (None: never used)."""


def _chunk_key(
    master: torch.Tensor, grad: torch.Tensor | None, a: int, b: int
) -> tuple[int, int, int, int]:
    """What identifies a chunk to stage and to step: its host master's and gradient's
    data pointers (-1 for a chunk staged without its gradient) and its bounds."""
    return (master.data_ptr(), -1 if grad is None else grad.data_ptr(), a, b)


@dataclass(frozen=True)
class _Staged:
    """A chunk whose copies up were issued ahead of its step (:meth:`StreamRing.stage`)."""

    key: tuple[int, int, int, int]
    """(master's and gradient's data pointers, chunk start, chunk end): what
    :meth:`StreamRing.issue` must be asked to step for the chunk to be used (the
    gradient's -1 when it was staged without: any gradient then)."""
    slot: int
    uploaded: Event
    with_grad: bool = True
    """Whether the gradient went up too; else the step copies it up ([Note: staging the
    state in backward])."""


@dataclass(frozen=True)
class StreamPiece:
    """One host-state slice to step on the device: its host tensors (flat, same length)."""

    master: torch.Tensor
    exp_avg: torch.Tensor
    exp_avg_sq: torch.Tensor
    grad: torch.Tensor
    step: float
    """The step count this step takes (already counted)."""
    hyper: AdamHyper
    half_out: torch.Tensor | None = None
    """fp16 I/O: where the new master's fp16 copy goes (the region's upload copy)."""
    device_out: torch.Tensor | None = None
    """Where the new master goes in the training dtype on the device, written on the
    step stream (a resident region's device parameters; see [Note: writing resident
    parameters]). With it, ``half_out`` is None: nothing of the parameters comes down."""


RingStreams = tuple[Stream, Stream, Stream]
"""(up, step, down): the streams a :class:`StreamRing` runs on."""


def ring_streams(device: torch.device) -> RingStreams:
    """Three new streams for :class:`StreamRing` on ``device`` (no-ops on the CPU). Make
    them once and pass them to every ring: the caching allocator reuses a freed block only
    on the stream it was allocated on, so a ring on new streams each step allocated anew
    each step (session 22: W2's reserved memory reached 15.3 GiB of a 3 GiB budget)."""
    cuda = device.type == "cuda"
    up, step, down = (
        Stream(torch.cuda.Stream(device) if cuda else None)  # type: ignore[no-untyped-call]
        for _ in range(3)
    )
    return up, step, down


class StreamRing:
    """The ring of device buffers that streams host-state pieces through one device step.

    Build one per host-worker task, on the same ``streams`` each time (see
    :func:`ring_streams`), :meth:`issue` pieces, then :meth:`close` (waits for the last
    download and frees the buffers, for the next ring to reuse). Host worker thread only.
    """

    def __init__(
        self,
        device: torch.device,
        moments_dtype: torch.dtype,
        fp16_io: bool,
        *,
        chunk_numel: int = STREAM_CHUNK_NUMEL,
        slots: int = STREAM_SLOTS,
        streams: RingStreams | None = None,
        after: Stream | None = None,
        timed: bool = False,
    ) -> None:
        if chunk_numel < 1 or slots < 1:
            raise ValueError(f"chunk_numel={chunk_numel} and slots={slots} must be >= 1")
        self.device = device
        self.chunk = chunk_numel
        self.up, self.step, self.down = ring_streams(device) if streams is None else streams
        self.after = after
        """With a stream: each chunk's copies up wait for what it had queued when the chunk
        was issued ([Note: yielding the link])."""
        n = chunk_numel
        with self.step.context():  # allocated (and later freed) in the step stream's pool
            self.slots = [
                _Slot(
                    torch.empty(n, dtype=torch.float32, device=device),
                    torch.empty(n, dtype=moments_dtype, device=device),
                    torch.empty(n, dtype=moments_dtype, device=device),
                    torch.empty(n, dtype=torch.float16, device=device) if fp16_io else None,
                    {},
                )
                for _ in range(slots)
            ]
            wide = torch.float32
            self.grad32: torch.Tensor | None = None  # made with the first narrow gradient
            self.moments32 = (
                (
                    torch.empty(n, dtype=wide, device=device),
                    torch.empty(n, dtype=wide, device=device),
                )
                if moments_dtype != wide
                else None
            )
        self._next = 0
        self._last: Event | None = None
        self._staged: deque[_Staged] = deque()
        """Chunks staged ahead, in slot order from ``_next`` ([Note: staging ahead])."""
        self._staged_last: Event | None = None
        """After the last staged chunk's copies up: what :meth:`close` waits for too."""
        self.staged_used = 0
        """Chunks stepped from a staged slot (their copies up issued ahead)."""
        self.paced_wait_s = 0.0
        """Seconds the issuing thread has waited for free slots (``issue(paced=True)``)."""
        self.timed = timed and self.up.cuda is not None
        """Time each chunk's copies up on the device ([Note: timing the ring's copies
        up]); never on the CPU."""
        self._up_copies: list[UpCopy] = []

    def issue(
        self,
        pieces: list[StreamPiece],
        grad_scale: float | None,
        *,
        paced: bool = False,
        between: Callable[[], None] | None = None,
    ) -> Event | None:
        """Queue the device step of ``pieces``; returns the event after their last download
        (None on the CPU, where everything ran already). Blocks on nothing on CUDA unless
        ``paced``: then each chunk is issued only once its slot is free, the calling
        thread polling for it (see [Note: paced ring]) and calling ``between()``, if
        given, while it waits."""
        # Made on the step stream, the only one that reads them (so that their memory is
        # reused in that stream's order).
        with self.step.context():
            scale = scale_tensor(grad_scale, self.device)
        for piece in pieces:
            with self.step.context():
                step = torch.full((), piece.step, dtype=torch.float32, device=self.device)
            total = piece.master.numel()
            for a in range(0, total, self.chunk):
                b = min(total, a + self.chunk)
                self._chunk(piece, a, b, step, scale, paced, between)
        return self._last

    def stage(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor | None,
    ) -> bool:
        """Issue the copies up of a piece's leading chunks (master, moments, gradient:
        the tensors :meth:`issue` will get as a :class:`StreamPiece`) into free slots
        now, ahead of the step's answer ([Note: staging ahead]). ``grad`` None stages
        the master and moments alone, before the gradient exists; the step then copies up
        whatever gradient its piece has ([Note: staging the state in backward]). True
        when every chunk of the piece is staged; False when the slots ran out first (or
        the ring has issued a chunk already: only a fresh ring stages). Blocks on
        nothing."""
        total = master.numel()
        for a in range(0, total, self.chunk):
            if self._last is not None or len(self._staged) >= len(self.slots):
                return False
            b = min(total, a + self.chunk)
            index = (self._next + len(self._staged)) % len(self.slots)
            uploaded = self._upload(self.slots[index], master, exp_avg, exp_avg_sq, grad, a, b)
            key = _chunk_key(master, grad, a, b)
            self._staged.append(_Staged(key, index, uploaded, grad is not None))
            self._staged_last = uploaded
        return True

    def staged(self) -> int:
        """Chunks staged and not yet stepped."""
        return len(self._staged)

    def written(self) -> Event:
        """The event after every device step issued so far (and so after every
        ``device_out`` write): what a forward reading those parameters waits for."""
        return self.step.record()

    def _chunk(
        self,
        piece: StreamPiece,
        a: int,
        b: int,
        step: torch.Tensor,
        scale: torch.Tensor | None,
        paced: bool = False,
        between: Callable[[], None] | None = None,
    ) -> None:
        staged = self._take_staged(piece, a, b)
        slot = self.slots[self._next]
        self._next = (self._next + 1) % len(self.slots)
        if paced and slot.free is not None and not slot.free.query():
            waited = time.perf_counter()
            wait_polling(slot.free, between=between)
            self.paced_wait_s += time.perf_counter() - waited
        n = b - a
        sp, sm, sv = slot.master[:n], slot.exp_avg[:n], slot.exp_avg_sq[:n]
        sg = self._grad_buffer(slot, piece.grad.dtype)[:n]
        if staged is None:
            uploaded = self._upload(
                slot, piece.master, piece.exp_avg, piece.exp_avg_sq, piece.grad, a, b
            )
        elif not staged.with_grad:
            # Behind the staged copies on the same stream: the slot is this chunk's.
            uploaded = self._copy_up(slot, [(sg, piece.grad)], a, b)
            self.staged_used += 1
        else:
            uploaded = staged.uploaded
            self.staged_used += 1
        self.step.wait(uploaded)
        with self.step.context():
            g = (
                sg
                if self.grad32 is None or sg.dtype == torch.float32
                else self.grad32[:n].copy_(sg)
            )
            if self.moments32 is None:
                m, v = sm, sv
            else:
                m, v = self.moments32[0][:n].copy_(sm), self.moments32[1][:n].copy_(sv)
            fused_adam_([sp], [g], [m], [v], [step], piece.hyper, scale)
            if self.moments32 is not None:
                sm.copy_(m)
                sv.copy_(v)
            half = None
            if piece.device_out is not None:
                piece.device_out[a:b].copy_(sp)
            elif piece.half_out is not None:
                assert slot.half is not None, "ring built without fp16 I/O"
                half = slot.half[:n].copy_(sp)
            stepped = self.step.record()
        self.down.wait(stepped)
        with self.down.context():
            for dst, src in ((piece.master, sp), (piece.exp_avg, sm), (piece.exp_avg_sq, sv)):
                dst[a:b].copy_(src, non_blocking=True)
            if half is not None and piece.half_out is not None:
                piece.half_out[a:b].copy_(half, non_blocking=True)
            slot.free = self._last = self.down.record()

    def _take_staged(self, piece: StreamPiece, a: int, b: int) -> _Staged | None:
        """Elements ``a:b`` of ``piece`` staged, if they are the next chunk staged (its
        slot is then the next slot), else None, dropping every staged chunk: steps asked
        in another order than staged upload their chunks again (the staged copies, on the
        same up stream, go before anything copied into those slots later)."""
        if not self._staged:
            return None
        first = self._staged[0]
        grad = piece.grad if first.with_grad else None
        if first.key != _chunk_key(piece.master, grad, a, b):
            self._staged.clear()
            return None
        staged = self._staged.popleft()
        assert staged.slot == self._next, "staged chunks take the slots in issue order"
        return staged

    def _upload(
        self,
        slot: _Slot,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor | None,
        a: int,
        b: int,
    ) -> Event:
        """Issue the copies up of elements ``a:b`` into ``slot`` (after its last
        download), the gradient's unless ``grad`` is None; returns the event after
        them."""
        n = b - a
        pairs = [
            (slot.master[:n], master),
            (slot.exp_avg[:n], exp_avg),
            (slot.exp_avg_sq[:n], exp_avg_sq),
        ]
        if grad is not None:
            pairs.append((self._grad_buffer(slot, grad.dtype)[:n], grad))
        return self._copy_up(slot, pairs, a, b)

    def _copy_up(
        self, slot: _Slot, pairs: list[tuple[torch.Tensor, torch.Tensor]], a: int, b: int
    ) -> Event:
        """Issue the copies up of elements ``a:b`` of each (device buffer, host tensor) of
        ``pairs`` into ``slot``'s buffers, after its last download; returns the event
        after them."""
        self.up.wait(slot.free)
        if self.after is not None:
            self.up.wait(self.after.record())
        with self.up.context():
            if not self.timed:
                for dst, src in pairs:
                    dst.copy_(src[a:b], non_blocking=True)
                return self.up.record()
            start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            start.record(self.up.cuda)
            nbytes = 0
            for dst, src in pairs:
                dst.copy_(src[a:b], non_blocking=True)
                nbytes += (b - a) * src.element_size()
            end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
            end.record(self.up.cuda)
            self._up_copies.append(UpCopy(start, end, nbytes))
            return Event(end)

    def take_up_copies(self) -> list[UpCopy]:
        """The chunks' copies up timed since the last call (staged ones included), and
        forget them: empty unless ``timed``."""
        copies, self._up_copies = self._up_copies, []
        return copies

    def _grad_buffer(self, slot: _Slot, dtype: torch.dtype) -> torch.Tensor:
        buf = slot.grads.get(dtype)
        if buf is None:
            with self.step.context():
                buf = slot.grads[dtype] = torch.empty(self.chunk, dtype=dtype, device=self.device)
                if dtype != torch.float32 and self.grad32 is None:
                    self.grad32 = torch.empty(self.chunk, dtype=torch.float32, device=self.device)
        return buf

    def close(self) -> None:
        """Wait for every queued download and staged upload (a host sync point) and free
        the buffers."""
        for event in (self._last, self._staged_last):
            if event is not None:
                event.synchronize()
        self._staged.clear()
        self.slots = []
        self.grad32 = self.moments32 = None


class StreamedQueue:
    """Streamed regions issued on the host worker, published in issue order once landed.

    Each entry carries its own ``publish(start_s, end_s)``: a step's host task and the
    hooks of regions landing after the step's answer share one queue (and one ring).
    :meth:`add` may run on another thread (``HybridAdam(issue_thread=True)``) while the
    host worker publishes; so may publishing, of entries that cast nothing on the host
    ([Note: the issuing thread publishes])."""

    def __init__(self) -> None:
        self._pending: deque[
            tuple[int, Event | None, float, Callable[[float, float], None], bool]
        ] = deque()
        self._lock = threading.Lock()
        self._publishing = threading.RLock()
        """Held while a thread publishes, so that two publishing threads (the host worker
        and, with ``HybridAdam(issuer_publishes=True)``, the issuing thread) take each
        entry once and in order."""

    def add(
        self,
        r: int,
        landed: Event | None,
        start_s: float,
        publish: Callable[[float, float], None],
        *,
        casts: bool = False,
    ) -> None:
        """Queue region ``r``, issued at ``start_s`` (``time.perf_counter()``), whose
        downloads are done at ``landed``; ``publish(start_s, end_s)`` runs once they are.
        ``casts``: the publish casts the new master on the host (the host worker's work,
        not the issuing thread's)."""
        with self._lock:
            self._pending.append((r, landed, start_s, publish, casts))

    def publish_landed(
        self, wait: bool = False, *, block: bool = True, casting: bool = True
    ) -> None:
        """Publish the regions whose downloads have landed, in issue order; with ``wait``,
        all of them, blocking for each (a host sync point). ``block=False``: return at
        once if another thread is publishing; ``casting=False``: stop at the first entry
        whose publish casts on the host (the issuing thread)."""
        if not self._publishing.acquire(blocking=block):
            return
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    _, landed, start, publish, casts = self._pending[0]
                if casts and not casting:
                    return
                if landed is not None and not landed.query():
                    if not wait:
                        return
                    landed.synchronize()
                with self._lock:
                    self._pending.popleft()
                publish(start, time.perf_counter())
        finally:
            self._publishing.release()

    def publish_until_empty(self, poll_s: float = PUBLISH_POLL_S) -> None:
        """Publish each region as it lands, polling every ``poll_s`` seconds, until none
        is left (entries added meanwhile included) or the first left casts on the host:
        the issuing thread, once it has issued everything ([Note: the issuing thread
        publishes])."""
        while self._castless_head():
            self.publish_landed(block=False, casting=False)
            if self._castless_head():
                time.sleep(poll_s)

    def _castless_head(self) -> bool:
        """Whether an entry is queued and the first one's publish casts nothing."""
        with self._lock:
            return bool(self._pending) and not self._pending[0][4]

    def regions(self) -> list[int]:
        """The regions queued and not yet published, in issue order."""
        with self._lock:
            return [entry[0] for entry in self._pending]
