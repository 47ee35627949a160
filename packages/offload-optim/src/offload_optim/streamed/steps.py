"""A HybridAdam's streamed regions: issued onto a ring, staged in backward, published
(see [Note: streamed steps] in streamed/__init__.py).

[Note: writing resident parameters]
A resident streamed region's parameters live on the device, and its device step has the new
master there. With ``StreamedStepCosts.resident_down_bytes_per_param`` set (the default of
``offload_runtime.planning.streamed_step_costs``), the step writes the region's device
parameters in place (``StreamPiece.device_out``, cast from the fp32 master on the step
stream, as the upload copy's narrowing rounds): nothing of them comes down, and the region
is not uploaded again. Otherwise (``write_resident=False``) the new master is narrowed into
the slot's fp16 copy, copied down into the region's upload copy and uploaded once the
region is published: 2 more bytes per parameter each way, and the next forward waits for
the copy down and the upload. When step()'s host task issues a written region, it hands the
runtime the step stream's event after the write (``OffloadController.ready_early``): the
region's next forward waits for that on the device instead of for its downloads and publish
on the host. The copies down of master and moments still land, and the region is published
(its host state complete); the next step's work on it waits for that. The device parameters
are free to overwrite then: the region's backward ran before its gradients came down, which
the host saw before issuing. Offloaded regions keep their fp16 copy coming down (their
parameters live on the host)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING

import torch

from offload_optim.layout import Segment, StateLayout, hyper_of
from offload_optim.reports import RegionStepTiming
from offload_optim.stepping import Stepper, consumed
from offload_optim.streamed.queue import PUBLISH_POLL_S, StreamedQueue
from offload_optim.streamed.ring import StreamPiece, StreamRing, UpCopy, up_copy_time
from offload_runtime.host_kernels import AdamHyper
from offload_runtime.planning import streamed_costs as costs
from offload_runtime.streams import Event
from offload_solver import StreamedStepCosts

if TYPE_CHECKING:
    from offload_runtime.controller import OffloadController

Jobs = list[tuple[int, list[Segment]]]
"""Regions to step, each with its segments that have gradients, in order."""


def publish_step(
    controller: OffloadController,
    sink: list[RegionStepTiming],
    r: int,
    then: Callable[[], None],
    start: float,
    end: float,
    issue_s: float = 0.0,
    paced_wait_s: float = 0.0,
    written: Event | None = None,
    up_copies: list[UpCopy] | None = None,
) -> None:
    """Publish streamed region ``r`` once its downloads landed: mark it published on
    ``controller`` (``written``: its device parameters were written by the device step,
    ready at that event, and nothing goes up; see [Note: writing resident parameters]),
    record its :class:`RegionStepTiming` in ``sink`` (``start``/``end`` in seconds of
    ``time.perf_counter``, ``issue_s`` and ``paced_wait_s`` in seconds, with the device
    time of ``up_copies``, its ring chunks' timed copies up), then call ``then`` (step()'s
    task completes the region's future; a hook's ``HybridAdam.issue_region`` calls its
    ``published``)."""
    with torch.profiler.record_function(f"streamed step {r} (publish)"):
        if written is None:
            controller.publish(r)
        else:
            controller.publish_written(r, written)
        up_bytes, up_s = up_copy_time(up_copies or [])
        sink.append(
            RegionStepTiming(r, start, end, True, True, issue_s, paced_wait_s, up_bytes, up_s)
        )
        then()


class StreamedSteps:
    """A HybridAdam's streamed regions: issued onto the ring that is open (one at a time,
    on the module's ring streams), staged in backward, and published once landed.

    The ring and its queue are the host worker's (see [Note: streamed steps] in
    streamed/__init__.py); the issuing thread issues a step's regions into them and
    publishes those that cast nothing.
    """

    def __init__(
        self,
        layout: StateLayout,
        stepper: Stepper,
        stage_in_backward: bool,
    ) -> None:
        self.layout = layout
        self.stepper = stepper
        self.planned: StreamedStepCosts | None = None
        """The plan's streaming costs (``Plan.streamed``): rings are built to its size."""
        self.open: tuple[StreamRing, StreamedQueue] | None = None
        """The ring and the queue of streamed regions issued and not yet published (host
        worker only; see :meth:`publish`)."""
        self.issuing = 0
        """Issuing tasks running on the issuing thread: the ring stays open while one
        runs."""
        self.stage_in_backward = stage_in_backward
        """Whether :meth:`stage` stages anything."""
        self.staged_chunks = 0
        """Ring chunks stepped from a staged slot so far ([Note: staging the state in
        backward] in streamed/ring.py)."""

    # ---- the ring ------------------------------------------------------------------

    def _ring(self) -> StreamRing:
        """A ring to stream host-state regions through the device, on the module's ring
        streams (one triple for its life, so that each ring reuses the last one's freed
        memory), shaped as the plan says (:func:`costs.ring_shape`)."""
        streams = self.layout.require_controller().streams
        chunk, slots = costs.ring_shape(
            self.planned, self.layout.moments_dtype, self.stepper.fp16_io
        )
        return StreamRing(
            streams.device,
            self.layout.moments_dtype,
            self.stepper.fp16_io,
            chunk_numel=chunk,
            slots=slots,
            streams=streams.ring_streams(),
            timed=True,
        )

    def session(self) -> tuple[StreamRing, StreamedQueue]:
        """Host worker: the ring and queue that streamed regions are issued to, made when
        none is open."""
        if self.open is None:
            self.open = (self._ring(), StreamedQueue())
        return self.open

    def publish(self, wait: bool = False) -> None:
        """Host worker: see ``HybridAdam.publish_streamed``."""
        if self.open is None:
            return
        ring, queue = self.open
        try:
            queue.publish_landed(wait)
        except BaseException:
            self.drop()  # what is left is not published; its futures fail
            raise
        if not queue.regions() and not self.issuing and (wait or not ring.staged()):
            self._close()  # every download has landed: no wait

    def drop(self) -> None:
        """Host worker, after an error: free the ring after its last download, leaving
        what it had still to publish unpublished (their futures fail elsewhere)."""
        if self.open is not None:
            self._close()

    def _close(self) -> None:
        """Host worker: close the open ring (after its last download and staged upload)
        and count the chunks it stepped from staged slots."""
        assert self.open is not None
        ring, _ = self.open
        self.open = None
        ring.close()
        self.staged_chunks += ring.staged_used

    # ---- issuing -------------------------------------------------------------------

    def writes_on_device(self, r: int) -> bool:
        """See ``HybridAdam.writes_on_device``."""
        st = self.layout.regions[r].storage
        if not st.streamed or st.offloaded:
            return False
        if self.planned is None:
            return costs.WRITE_RESIDENT
        return self.planned.resident_down_bytes_per_param is not None

    def issue_streamed(
        self,
        ring: StreamRing,
        r: int,
        segments: list[Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        paced: bool = False,
        between: Callable[[], None] | None = None,
    ) -> tuple[Event | None, Event | None]:
        """Queue streamed region ``r``'s device step on ``ring`` (counting the step);
        returns the events after its downloads and, when the step writes the region's
        device parameters (:meth:`writes_on_device`), after that write (else None). Its
        fp16-I/O flags are set as the host step sets them; nothing may read its buffers
        before the first event. ``paced`` (the issuing thread only): see [Note: paced
        ring] in streamed/ring.py, ``between()`` running while a paced issue waits for a
        slot."""
        rs = self.layout.regions[r]
        st = rs.storage
        io = self.stepper.staged_io(rs, segments)
        write = self.writes_on_device(r)
        pieces = []
        for seg in segments:
            hyper = hyper_of(seg, hypers)
            seg.step.add_(1.0)  # as Stepper.run counts it
            a, b = seg.start, seg.start + seg.param.numel()
            assert seg.grad is not None
            pieces.append(
                StreamPiece(
                    seg.param,
                    seg.exp_avg,
                    seg.exp_avg_sq,
                    seg.grad if io is None else io[0][a:b],
                    float(seg.step),
                    hyper,
                    None if io is None or write else io[1][a:b],
                    st.device_params[a:b] if write else None,
                )
            )
        landed = ring.issue(pieces, grad_scale, paced=paced, between=between)
        if io is not None:
            consumed(st, upload_copy_written=not write)
        return landed, ring.written() if write else None

    def issue_jobs(
        self,
        ring: StreamRing,
        queue: StreamedQueue,
        jobs: Jobs,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        publish: dict[int, Callable[..., None]],
        early: dict[int, Callable[[Event], None]] | None = None,
        issuer: bool = False,
    ) -> None:
        """Issue each streamed job's device step on ``ring`` and queue it on ``queue``, in
        order (the issuing thread for step()'s task, with ``issuer``; the host worker for
        a hook's ``HybridAdam.issue_region``); ``publish[r](start_s, end_s, issue_s=,
        paced_wait_s=, written=)`` publishes region ``r`` once landed. ``early[r](event)``
        is called as soon as region ``r`` is issued when its step writes its device
        parameters, with the event after that write. ``issuer``: pace the ring ([Note:
        paced ring] in streamed/ring.py) and publish what has landed while waiting for
        slots and after each region, then every region as it lands until none is left
        ([Note: the issuing thread publishes] in streamed/queue.py)."""
        between = partial(queue.publish_landed, block=False, casting=False) if issuer else None
        with torch.no_grad():  # grad mode is per thread
            for r, segments in jobs:
                with torch.profiler.record_function(f"streamed step {r} (issue)"):
                    start = time.perf_counter()
                    waited = ring.paced_wait_s
                    landed, written = self.issue_streamed(
                        ring, r, segments, grad_scale, hypers, issuer, between
                    )
                    waited = ring.paced_wait_s - waited
                    issued = time.perf_counter() - start - waited
                    ups = ring.take_up_copies()
                if written is not None and early is not None and r in early:
                    early[r](written)
                # Its publish casts the new master on the host unless the ring wrote the
                # device parameters or (fp16 I/O) the upload copy.
                casts = written is None and self.layout.require_controller().publish_casts(r)
                queue.add(
                    r,
                    landed,
                    start,
                    partial(
                        publish[r],
                        issue_s=issued,
                        paced_wait_s=waited,
                        written=written,
                        up_copies=ups,
                    ),
                    casts=casts,
                )
                if between is not None:
                    between()
            if issuer:
                queue.publish_until_empty(PUBLISH_POLL_S)

    def issue_on_thread(
        self,
        jobs: Jobs,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper],
        sink: list[RegionStepTiming],
        complete: Callable[[int], None],
        futures: dict[int, Future[None]],
    ) -> Future[None]:
        """Host worker, step()'s task: hand ``jobs`` (streamed regions) to the issuing
        thread, which issues them onto the open ring (opened here if none is), paces it
        and publishes what has landed, so that this thread starts its host steps at once
        ([Note: streamed steps] in streamed/__init__.py). Each region, once published, is
        recorded in ``sink`` and ``complete(r)`` is called; a region written on the
        device hands its event to the runtime as soon as it is issued, so its next
        forward may go on once the device has done the write ([Note: writing resident
        parameters]). The ring stays open until :meth:`finish_issuing` of the future
        returned."""
        controller = self.layout.require_controller()
        ring, queue = self.session()
        issue = partial(
            self.issue_jobs,
            ring,
            queue,
            jobs,
            grad_scale,
            hypers,
            {r: partial(publish_step, controller, sink, r, partial(complete, r)) for r, _ in jobs},
            early={
                r: partial(controller.ready_early, r, futures[r])
                for r, _ in jobs
                if self.writes_on_device(r)
            },
        )
        return self.issue_elsewhere(partial(issue, issuer=True))

    def issue_elsewhere(self, issue: Callable[[], None]) -> Future[None]:
        """Host worker: run ``issue`` on the module's issuing thread; the ring stays open
        until :meth:`finish_issuing`."""
        thread = self.layout.require_controller().streams.issuing_thread()
        self.issuing += 1
        try:
            return thread.submit(issue)
        except BaseException:
            self.issuing -= 1
            raise

    def finish_issuing(self, issuing: Future[None]) -> None:
        """Host worker: wait for an issuing task (raising its error); the ring may close
        again once its regions are published."""
        try:
            issuing.result()
        finally:
            self.issuing -= 1

    def issue_region(
        self,
        r: int,
        segments: list[Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        sink: list[RegionStepTiming],
        published: Callable[[], None],
    ) -> None:
        """Host worker, a hook: issue streamed region ``r``'s device step onto the open
        ring, unpaced; it is published, recorded in ``sink`` and ``published()`` called
        once its downloads land, here or in a later :meth:`publish`."""
        publish = partial(publish_step, self.layout.require_controller(), sink, r, published)
        ring, queue = self.session()
        try:
            self.issue_jobs(ring, queue, [(r, segments)], grad_scale, hypers, {r: publish})
        except BaseException:
            self.drop()
            raise
        self.publish()

    # ---- staging in backward -------------------------------------------------------

    @torch.no_grad()
    def stage(self) -> None:
        """Host worker: see ``HybridAdam.stage_streamed_state``."""
        if not self.stage_in_backward:
            return
        if self.open is not None:
            return
        ring, _ = self.session()
        with torch.profiler.record_function("stage streamed state"):
            for r in self.layout.region_list:
                if not self.layout.regions[r].storage.streamed:
                    continue
                for seg in self.layout.regions[r].segments:
                    if not ring.stage(seg.param, seg.exp_avg, seg.exp_avg_sq):
                        return
