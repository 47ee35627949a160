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
and no host pass at all, against the host kernel's 20 bytes of host-memory traffic. So
the device and the host step different regions at the same time, which is the point:
the host is the bound of a step whose state is mostly on the host, and the PCIe link is
mostly idle while the host steps (BENCHMARKS.md, Decisions, "Streamed host state").

step()'s host task hands its streamed regions to a thread of their own, the *issuing
thread* (made at the first use), which issues them in forward order while the host
worker steps the other host-state regions from the start: issuing is Python and CUDA
calls per chunk, taken off the thread that bounds host-heavy steps. The issuing thread
paces the ring ([Note: paced ring]) and publishes what lands ([Note: the issuing thread
publishes]). The queue takes entries from that thread under a lock. The ring stays open
while the thread issues: between its host steps the task checks whether the thread is
done, and the ring closes at the first check after that once every streamed region has
landed. With ``OverlapMode.DEVICE_ANSWER`` a region whose gradients land after the
step's answer is stepped by its own hook instead; a streamed one is only issued there,
on the host worker (``HybridAdam.issue_region``, unpaced), into the same ring and queue,
and published once landed, at a later hook or in the task that ``step()`` queues behind
the last hook. The hook does not wait for the device: the copies of one region take
longer than its host step would.

[Note: paced ring]
Unpaced, the ring would queue every chunk of a task at once, each slot's next upload
waiting on the device for its last download. The copies would sit on the copy engine's
queue ahead of whatever is issued after them, the runtime's prefetches of the next
forward's parameters (the h2d stream) included, and that forward would wait for the
whole ring's bytes. ``issue(..., paced=True)`` issues a chunk only once its slot's last
download has landed, so at most a slot's worth of copies is queued ahead of a prefetch.
A paced issue blocks its thread, so only the issuing thread paces; the host worker and
the hooks never do. The planner models the ring unpaced (every copy up on the H2D lane
in issue order, [Note: streamed steps] in the solver's simulator), so it predicts a
paced step as it would the unpaced one.

[Note: publishing while issuing]
Paced, the issuing thread can still be issuing when step()'s host task has finished its
host steps. The task then keeps publishing what has landed, checking every
``PUBLISH_POLL_S``, until the issuing thread is done, rather than waiting for the thread
first: the next forward waits for each region's publish, and a region that has landed
should not wait for a later one's issue. That is what the planner assumes: a streamed
region is published when its downloads land.

[Note: the issuing thread publishes]
Between host steps is still late when the host worker is in one: a region that lands
during a host step would wait for that step to end. So the issuing thread publishes too:
whatever has landed while it waits for a free slot, after each region it issues, and
then each region as it lands until none is left (:meth:`StreamedQueue.publish_until_empty`),
before it reports itself done. It publishes only regions whose publish casts nothing on
the host: those whose device step wrote their device parameters, or (fp16 I/O) their
upload copy. Any other publish casts the new master on the host, which would hold up the
issuing, so the issuing thread stops at the first such entry and leaves it, and the
entries after it, to the host worker. The queue takes each entry once and in order
whichever thread publishes (one publishes at a time; the issuing thread skips a round
rather than wait for the host worker). The ring is still closed by the host worker, at
its first check after the issuing thread is done.

[Note: staging the state in backward]
At the step boundary the H2D link carries the ring's chunks and the host-stepped
regions' uploads, while late in the backward it is mostly idle and most activations are
freed (backward frees them as it goes). Of a chunk's copies up only the gradient (2 of
its 14 bytes a parameter, fp32 moments and fp16 gradients) is made by that backward; the
master weights and moments are final once the last step's downloads landed. With
``HybridAdam(stage_in_backward=True)`` (the default, :data:`STAGE_IN_BACKWARD`), the
gradient hook of the first streamed region to land in the backward before a step (the
host worker's, in the last micro-batch, with overlap) opens the ring and issues the
copies up of the master weights and moments of the streamed regions' leading chunks in
forward order, into its free slots (:meth:`StreamRing.stage`). The last step's downloads
have landed by then: its task, which ran first on the host worker, closed its ring only
after them; a ring still open stages nothing. The step's task steps those chunks from
their slots, each first copying up its gradient (behind the staged copies, on the same
stream), and copies the rest up in full. A staged chunk is known by its master and
bounds, so any gradient the step has for it goes up; asked in another order, the ring
drops the staged chunks and copies up again. Host-state regions stepped in their hooks
after it (bf16 training) publish what has landed: a ring holding staged chunks and
nothing else is closed only by a waiting publish (the end of the step's task, or
:meth:`HybridAdam.drop_staged`, which a skipped step calls). The planner models it when
the costs say so (:func:`streamed_step_costs` with ``stage_in_backward``,
:func:`with_stage_in_backward`: ``StreamedStepCosts.staged_chunks``): one copy up of the
staged state from the hook, the ring held from there, and the step's copies up without
it ([Note: streamed steps] in ``offload_solver.simulators._engine``). Measured:
BENCHMARKS.md, Decisions, "Staging streamed state in backward".

[Note: more slots to stage]
The backward stages one chunk per ring slot, so with :data:`STREAM_SLOTS` (3) it stages
3 chunks; the rest of the streamed regions' state goes up at the step boundary.
``streamed_step_costs(slots=N)`` plans a ring of N slots (chunks of the same size,
within the budget's tenth, so a small budget gets more, smaller chunks): N chunks staged
in the backward, the ring's N slots of device memory held from the staging hook, which
the planner counts. The optimizer builds its ring as the plan says (:func:`ring_shape`:
``staged_chunks`` slots of ``staged_chunk_numel``). A slot count other than the default
needs staging: a plan that stages nothing records no slot count. Values do not depend on
it. The simulator models the ring unpaced ([Note: paced ring]) and so predicts no change
from more slots (``python benchmarks/replay_bench.py --stream-slots N`` replays recorded
runs with N slots); whether the paced ring gains from them is for a GPU run to say.

[Note: writing resident parameters]
A resident streamed region's parameters live on the device, and its device step has the
new master there. With ``StreamedStepCosts.resident_down_bytes_per_param`` set (the
default of :func:`streamed_step_costs`), the step writes the region's device parameters
in place (``StreamPiece.device_out``, cast from the fp32 master on the step stream, as
the upload copy's narrowing rounds): nothing of them comes down, and the region is not
uploaded again. Otherwise (``write_resident=False``) the new master is narrowed into the
slot's fp16 copy, copied down into the region's upload copy and uploaded once the region
is published: 2 more bytes per parameter each way, and the next forward waits for the
copy down and the upload. When step()'s host task issues a written region, it hands the
runtime the step stream's event after the write (``OffloadController.ready_early``): the
region's next forward waits for that on the device instead of for its downloads and
publish on the host. The copies down of master and moments still land, and the region
is published (its host state complete); the next step's work on it waits for that. The
device parameters are free to overwrite then: the region's backward ran before its
gradients came down, which the host saw before issuing. Offloaded regions keep their
fp16 copy coming down (their parameters live on the host).

Values: widening is exact and the narrowing rounds to nearest even, as the host kernels
do, and the update is torch's fused kernel: bit for bit what ``host_kernel="torch"``
computes, and within rounding (about 1e-7 of an update) of ``"single_pass"``. A streamed
region never steps speculatively (it steps after the step's answer, so nothing needs
undoing), and after its step the region's fp32 gradient accumulator still holds the
gradient as it was (loss scale included): the device divided its own copy.

Device memory: the ring's buffers exist only while a task streams: allocated on the step
stream when the task issues its first streamed region (or the backward stages), freed as
soon as its last streamed region is published (not at the end of the task: the planner
counts the ring until the last download, and a ring held into the next forward would
add to that forward's peak). :func:`stream_slot_bytes` says how many bytes. Every ring
runs on the same streams, so that the caching allocator hands the next ring the last
one's blocks. On a machine without CUDA the "device" is the CPU and every copy runs at
once, in order: the same values, for tests.

[Note: timing the ring's copies up]
The planner runs the ring's copies up at ``HardwareProfile.stream_up_fraction`` of the
profile's H2D rate (``offload_runtime.api.STREAM_UP_FRACTION`` by default). In the
training loop they share the PCIe link with the ring's copies down and the runtime's
uploads, so the fraction they reach depends on the plan and the machine. A ring built
``timed`` (``HybridAdam``'s rings on CUDA) records a pair of timing events around each
chunk's copies up on its up stream, the first after the chunk's wait for its slot, so
the pair spans the copies alone (with whatever else shares the link then), and the bytes
they carry (:class:`UpCopy`). The issuing code takes them per streamed region
(:meth:`StreamRing.take_up_copies`) and reads them when the region is published, once
its downloads (and so its copies up) have landed (:func:`up_copy_time`: no host sync);
:class:`~offload_optim.hybrid_adam.RegionStepTiming` carries the sums and
``offload_optim.check_stream_rate`` turns a loop's steps into the fraction to plan with,
as ``check_host_rate`` does for the host.
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
:func:`streamed_step_costs` is given the budget (a 3 GiB budget: a ring of at most 0.3
GiB, where full chunks would take 0.81)."""
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
    down with its state and go up again after it. The optimizer follows the plan's
    choice. ``stage_in_backward`` (None: :data:`STAGE_IN_BACKWARD`,
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
for unless told ([Note: staging the state in backward]; measured: BENCHMARKS.md,
Decisions, "Staging streamed state in backward")."""

PACE_POLL_S = 1e-4
"""Seconds the issuing thread sleeps between checks that a slot is free ([Note: paced
ring])."""

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
    """Recorded after the chunk's wait for its slot: when the up stream got to its
    copies."""
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


def _chunk_key(master: torch.Tensor, a: int, b: int) -> tuple[int, int, int]:
    """What identifies a chunk to stage and to step: its host master's data pointer and
    its bounds."""
    return (master.data_ptr(), a, b)


@dataclass(frozen=True)
class _Staged:
    """A chunk whose master and moments went up ahead of its step
    (:meth:`StreamRing.stage`; [Note: staging the state in backward])."""

    key: tuple[int, int, int]
    """(master's data pointer, chunk start, chunk end): what :meth:`StreamRing.issue`
    must be asked to step for the chunk to be used (with any gradient)."""
    slot: int
    uploaded: Event


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
    on the stream it was allocated on, so a ring on new streams each step would allocate
    anew each step, its reserved memory growing past the budget."""
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
        timed: bool = False,
    ) -> None:
        if chunk_numel < 1 or slots < 1:
            raise ValueError(f"chunk_numel={chunk_numel} and slots={slots} must be >= 1")
        self.device = device
        self.chunk = chunk_numel
        self.up, self.step, self.down = ring_streams(device) if streams is None else streams
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
        """Chunks staged, in slot order from ``_next`` ([Note: staging the state in
        backward])."""
        self._staged_last: Event | None = None
        """After the last staged chunk's copies up: what :meth:`close` waits for too."""
        self.staged_used = 0
        """Chunks stepped from a staged slot (their copies up issued ahead)."""
        self.paced_wait_s = 0.0
        """Seconds a paced issue has waited for free slots (``issue(paced=True)``)."""
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

    def stage(self, master: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> bool:
        """Issue the copies up of a piece's leading chunks' master and moments (the
        tensors :meth:`issue` will get in a :class:`StreamPiece`) into free slots now,
        before the gradient exists; the step then copies up whatever gradient its piece
        has ([Note: staging the state in backward]). True when every chunk of the piece
        is staged; False when the slots ran out first (or the ring has issued a chunk
        already: only a fresh ring stages). Blocks on nothing."""
        total = master.numel()
        for a in range(0, total, self.chunk):
            if self._last is not None or len(self._staged) >= len(self.slots):
                return False
            b = min(total, a + self.chunk)
            index = (self._next + len(self._staged)) % len(self.slots)
            uploaded = self._upload(self.slots[index], master, exp_avg, exp_avg_sq, None, a, b)
            self._staged.append(_Staged(_chunk_key(master, a, b), index, uploaded))
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
        else:
            # Behind the staged copies on the same stream: the slot is this chunk's.
            uploaded = self._copy_up(slot, [(sg, piece.grad)], a, b)
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
        if first.key != _chunk_key(piece.master, a, b):
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
    :meth:`add` runs on the issuing thread (a step's regions) or the host worker (a
    hook's) while the other publishes; so may publishing, of entries that cast nothing on
    the host ([Note: the issuing thread publishes])."""

    def __init__(self) -> None:
        self._pending: deque[
            tuple[int, Event | None, float, Callable[[float, float], None], bool]
        ] = deque()
        self._lock = threading.Lock()
        self._publishing = threading.RLock()
        """Held while a thread publishes, so that the two publishing threads (the host
        worker and the issuing thread) take each entry once and in order."""

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
