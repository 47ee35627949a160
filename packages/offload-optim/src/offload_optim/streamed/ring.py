"""The ring of device buffers that steps streamed host state chunk by chunk (see [Note:
streamed steps] in streamed/__init__.py).

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

[Note: staging the state in backward]
At the step boundary the H2D link carries the ring's chunks and the host-stepped
regions' uploads, while late in the backward it is mostly idle and most activations are
freed (backward frees them as it goes). Of a chunk's copies up only the gradient (2 of
its 14 bytes a parameter, fp32 moments and fp16 gradients) is made by that backward; the
master weights and moments are final once the last step's downloads landed. With
``PlanOptions.stage_in_backward`` (the planner's default), the
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
the costs say so (``offload_runtime.planning.streamed_step_costs`` with
``stage_in_backward``: ``StreamedStepCosts.staged_chunks``): one copy up of the
staged state from the hook, the ring held from there, and the step's copies up without
it ([Note: streamed steps] in ``offload_solver.simulators._engine``). Measured:
BENCHMARKS.md, Decisions, "Staging streamed state in backward".

[Note: timing the ring's copies up]
The planner runs the ring's copies up at the cost model's ``stream_up_fraction`` of the
profile's H2D rate (``offload_solver.CostModel``; 0.78 by default). In the training loop
they share the PCIe link with the ring's copies down and the runtime's uploads, so the
fraction they reach depends on the plan and the machine. A ring built
``timed`` (``HybridAdam``'s rings on CUDA) records a pair of timing events around each
chunk's copies up on its up stream, the first after the chunk's wait for its slot, so
the pair spans the copies alone (with whatever else shares the link then), and the bytes
they carry (:class:`UpCopy`). The issuing code takes them per streamed region
(:meth:`StreamRing.take_up_copies`) and reads them when the region is published, once
its downloads (and so its copies up) have landed (:func:`up_copy_time`: no host sync);
:class:`~offload_optim.reports.RegionStepTiming` carries the sums and
``offload_optim.check_stream_rate`` turns a loop's steps into the fraction to plan with,
as ``check_host_rate`` does for the host.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from offload_runtime.host_kernels import AdamHyper, fused_adam_, scale_tensor
from offload_runtime.planning.streamed_costs import STREAM_CHUNK_NUMEL, STREAM_SLOTS
from offload_runtime.streams import NO_STREAM, Event, RingStreams

PACE_POLL_S = 1e-4
"""Seconds the issuing thread sleeps between checks that a slot is free ([Note: paced
ring])."""


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
    """Where the new master goes in the training dtype on the device, written on the step
    stream (a resident region's device parameters; see [Note: writing resident
    parameters] in streamed/steps.py). With it, ``half_out`` is None: nothing of the
    parameters comes down."""


class StreamRing:
    """The ring of device buffers that streams host-state pieces through one device step.

    Build one per host-worker task, on the same ``streams`` each time (the module's
    ``StreamSet.ring_streams()``: one triple for its life, so that each ring reuses the
    last one's freed device memory; [Note: streams and threads] in
    offload_runtime/streams.py), :meth:`issue` pieces, then :meth:`close` (waits for the
    last download and frees the buffers, for the next ring to reuse). ``streams`` may be
    left out on the CPU only, where there are no streams. Host worker thread only.
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
        if streams is None:
            if device.type != "cpu":
                raise ValueError(
                    f"a ring on {device} runs on its module's ring streams: pass "
                    "streams=module.streams.ring_streams()"
                )
            streams = (NO_STREAM, NO_STREAM, NO_STREAM)
        self.up, self.step, self.down = streams
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
