"""Scheduling a HybridAdam's region steps: which thread steps what, and in which order.

Threads (see [Note: streams and threads] in offload_runtime/streams.py): the step of a
host-state region runs on the runtime's host worker (queued by
:meth:`HostSteps.submit_host_steps`, or called from a grad-ready hook, which runs there),
and so does its ``controller.publish``; device-state regions and plain parameters are
stepped on the calling thread. A streamed region's device step is issued from the
issuing thread (a step's regions) or the host worker (a hook's), and published by either
(see [Note: streamed steps] in streamed/__init__.py). A speculative step runs on the
speculation thread or in its hook ([Note: speculative steps] in speculation.py). A region
is only ever stepped by one thread at a time. ``HybridAdam.step`` waits for the host
steps; ``AMPOptimizer`` does not (see [Note: overlapping the host step with backward] in
overlap.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from functools import partial

import torch

from offload_optim.layout import ParamState, Segment, StateLayout
from offload_optim.reports import RegionStepTiming
from offload_optim.speculation import Speculation, wait_calling
from offload_optim.stepping import Stepper
from offload_optim.streamed.queue import PUBLISH_POLL_S
from offload_optim.streamed.steps import Jobs, StreamedSteps
from offload_runtime.host_kernels import AdamHyper


class HostSteps:
    """Steps a HybridAdam's regions where they belong: host-state ones on the host worker
    (in one task per step, streamed ones through the issuing thread), device-state ones in
    one batch on the calling thread. The public methods of the same names on
    ``HybridAdam`` say what each does; every ``timings`` here is the list to record in."""

    def __init__(
        self,
        layout: StateLayout,
        stepper: Stepper,
        speculation: Speculation,
        streamed: StreamedSteps,
        hypers: Callable[[], dict[int, AdamHyper]],
        state: Callable[[], ParamState],
    ) -> None:
        self.layout = layout
        self.stepper = stepper
        self.speculation = speculation
        self.streamed = streamed
        self._hypers = hypers
        """A snapshot of every group's hyperparameters now (``HybridAdam.hypers``)."""
        self._state = state
        """The optimizer's ``state`` (a commit re-points its moment entries)."""

    @torch.no_grad()
    def step_region(
        self,
        r: int,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming],
    ) -> bool:
        stepped = self.issue_region(r, grad_scale, hypers, timings, _nothing)
        if stepped and self.layout.regions[r].storage.streamed:
            self.streamed.publish(wait=True)
        return stepped

    @torch.no_grad()
    def issue_region(
        self,
        r: int,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming],
        published: Callable[[], None],
    ) -> bool:
        rs = self.layout.regions.get(r)
        if rs is None:
            published()
            return False
        if r in self.speculation.speculated:
            self.speculation.refuse(f"step_region({r})")
        controller = self.layout.require_controller()
        start = time.perf_counter()
        segments = self.layout.segments_with_grad(r)
        if not segments:
            published()
            return False
        st = rs.storage
        if not st.streamed:
            self.stepper.step_segments(r, segments, grad_scale, hypers)
            controller.publish(r)
            timings.append(RegionStepTiming(r, start, time.perf_counter(), host=st.host_state))
            published()
            if st.host_state:  # on the host worker, where streamed regions are issued
                self.streamed.publish()
            return True
        self.streamed.issue_region(r, segments, grad_scale, hypers, timings, published)
        return True

    @torch.no_grad()
    def step_device_regions(
        self,
        regions: Iterable[int],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming],
    ) -> list[int]:
        controller = self.layout.require_controller()
        start = time.perf_counter()
        stepped: list[int] = []
        segments: list[Segment] = []
        for r in regions:
            rs = self.layout.regions[r]
            if rs.storage.host_state:
                raise ValueError(
                    f"step_device_regions got host-state region {r}; step it with "
                    "step_region on the host worker"
                )
            segs = self.layout.segments_with_grad(r)
            if segs:
                stepped.append(r)
                segments.extend(segs)
        if not segments:
            return []
        self.stepper.run(segments, grad_scale, hypers)
        controller.publish_many(stepped)
        end = time.perf_counter()
        timings.extend(RegionStepTiming(r, start, end, host=False) for r in stepped)
        return stepped

    def submit_host_steps(
        self,
        regions: Iterable[int],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming],
        commit: list[int] | None,
    ) -> dict[int, Future[None]]:
        controller = self.layout.require_controller()
        jobs: Jobs = []
        for r in regions:
            if not self.layout.regions[r].storage.host_state:
                raise ValueError(
                    f"submit_host_steps got device-state region {r}; step it with "
                    "step_device_regions on the main thread"
                )
            if commit is None and r in self.speculation.speculated:
                self.speculation.refuse(f"submit_host_steps of region {r}")
            segs = self.layout.segments_with_grad(r)
            if segs:
                jobs.append((r, segs))
        if not jobs:
            return {}
        snapshot = self._hypers() if hypers is None else hypers
        futures = controller.expect_updates(r for r, _ in jobs)
        controller.submit_host(
            partial(self._task, jobs, grad_scale, snapshot, futures, timings, commit)
        )
        return futures

    @torch.no_grad()
    def _task(
        self,
        jobs: Jobs,
        grad_scale: float | None,
        hypers: dict[int, AdamHyper],
        futures: dict[int, Future[None]],
        sink: list[RegionStepTiming],
        commit: list[int] | None = None,
    ) -> None:
        """Host worker: step and publish each job's region, completing its future; with
        ``commit``, commit the speculative steps (after issuing the streamed regions) and
        only publish their regions.

        Streamed regions are handed to the issuing thread first, then the others step
        here, and each streamed region is published once its downloads landed (by the
        issuing thread, or here between host steps, then while the issuing thread
        finishes, and at the end; see [Note: streamed steps] in streamed/__init__.py and
        [Note: publishing while issuing] in streamed/queue.py)."""
        controller = self.layout.require_controller()
        done: set[int] = set()

        def complete(r: int) -> None:
            futures[r].set_result(None)
            done.add(r)

        streamed_jobs = [
            (r, segments)
            for r, segments in jobs
            if segments and self.layout.regions[r].storage.streamed
        ]
        streamed_here = {r for r, _ in streamed_jobs}
        issuing: Future[None] | None = None
        try:
            if streamed_jobs:
                issuing = self.streamed.issue_on_thread(
                    streamed_jobs, grad_scale, hypers, sink, complete, futures
                )
            if commit is not None:
                jobs = self._commit(jobs, commit)
            for r, segments in jobs:
                if r in streamed_here:
                    continue
                # Named in a torch.profiler trace, beside the streams it feeds.
                with torch.profiler.record_function(f"host step {r}"):
                    start = time.perf_counter()
                    if segments:
                        self.stepper.step_segments(r, segments, grad_scale, hypers)
                    end = time.perf_counter()
                    controller.publish(r)
                    sink.append(RegionStepTiming(r, start, end, host=True))
                    complete(r)
                if issuing is not None and issuing.done():
                    pending, issuing = issuing, None
                    self.streamed.finish_issuing(pending)  # the ring may close now
                # Frees the ring as soon as every streamed region landed, not after the
                # host steps still to come (see StreamedSteps.publish).
                self.streamed.publish()
            if issuing is not None:
                # The host steps are done while the issuing thread still issues: publish
                # each streamed region as it lands until it is done, instead of blocking
                # on it first ([Note: publishing while issuing] in streamed/queue.py).
                wait_calling(issuing, self.streamed.publish, PUBLISH_POLL_S)
                pending, issuing = issuing, None
                self.streamed.finish_issuing(pending)
            self.streamed.publish(wait=True)
        except BaseException as exc:
            # Every announced future must complete, or the region's next use would wait
            # forever: the error reaches whoever waits for any of them. The ring goes too
            # (after its last download, and after the issuing thread let it go), with what
            # it still had to publish: those regions' futures fail here, or (a hook's) in
            # the window's last task.
            if issuing is not None:
                with contextlib.suppress(BaseException):
                    self.streamed.finish_issuing(issuing)
            self.streamed.drop()
            for r, _ in jobs:
                if r not in done:
                    futures[r].set_exception(exc)
            raise

    def _commit(self, jobs: Jobs, commit: list[int]) -> Jobs:
        """Host worker, step()'s task once the streamed regions are issued (the
        speculative steps may still run): wait for the speculative steps, publishing
        landed streamed regions meanwhile, commit them and list their regions in
        ``commit``; returns ``jobs`` with those regions left only to publish."""
        self.speculation.wait(between=self.streamed.publish)
        committed = self.speculation.commit(self._state())
        commit.extend(committed)
        unqueued = set(committed).difference(r for r, _ in jobs)
        if unqueued:
            raise RuntimeError(
                f"regions {sorted(unqueued)} were committed but not queued to be "
                "published: a bug in the caller"
            )
        return [(r, [] if r in committed else segments) for r, segments in jobs]

    @torch.no_grad()
    def step_plain(self, grad_scale: float | None, hypers: dict[int, AdamHyper] | None) -> None:
        segments = [seg for seg in self.layout.plain if seg.param.grad is not None]
        if segments:
            self.stepper.run(segments, grad_scale, hypers)

    def step_regions(
        self,
        regions: Iterable[int] | None,
        grad_scale: float | None,
        *,
        plain: bool,
        wait: bool,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming],
        commit: list[int] | None,
    ) -> dict[int, Future[None]]:
        layout = self.layout
        chosen = layout.region_list if regions is None else sorted(regions)
        chosen = [r for r in chosen if r in layout.regions]
        snapshot = self._hypers() if hypers is None else hypers
        host = [r for r in chosen if layout.regions[r].storage.host_state]
        device = [r for r in chosen if not layout.regions[r].storage.host_state]
        futures: dict[int, Future[None]] = {}
        if host:
            futures = self.submit_host_steps(host, grad_scale, snapshot, timings, commit)
        if device:
            self.step_device_regions(device, grad_scale, snapshot, timings)
        if plain:
            self.step_plain(grad_scale, snapshot)
        if wait and layout.controller is not None:
            layout.controller.wait_host()
        return futures


def _nothing() -> None:
    """The ``published`` callback of a step that waits for its region itself."""
