"""What a step did: each region's step (:class:`RegionStepTiming`, recorded by HybridAdam)
and each ``AMPOptimizer.step`` (:class:`StepReport`). Times are ``time.perf_counter()``
seconds."""

from __future__ import annotations

import dataclasses
from concurrent.futures import Future
from dataclasses import dataclass

from offload_optim.overlap import OverlapMode


@dataclass(frozen=True)
class RegionStepTiming:
    """When one region's optimizer step ran, in ``time.perf_counter()`` seconds."""

    region: int
    start_s: float
    end_s: float
    host: bool
    """True for a host-state region (stepped on the host worker, or streamed)."""
    streamed: bool = False
    """A streamed region (see [Note: streamed steps] in streamed/__init__.py): stepped on the
    device; the span runs from issuing its device work to publishing it."""
    issue_s: float = 0.0
    """A streamed region: seconds spent issuing its device work (copies, kernels and
    events per ring chunk), on the issuing thread (a step's regions) or the host worker
    (a region its own hook issues), not counting ``paced_wait_s``; 0 for the others."""
    paced_wait_s: float = 0.0
    """A streamed region issued by the issuing thread: seconds it waited for free ring
    slots while issuing it ([Note: paced ring] in streamed/ring.py); 0 otherwise."""
    up_bytes: int = 0
    """A streamed region on CUDA: bytes its ring chunks' copies up carried (staged ones
    included), where their device timing was read ([Note: timing the ring's copies up]
    in streamed/ring.py); 0 otherwise."""
    up_s: float = 0.0
    """Seconds those copies up took on the device, summed over its chunks."""

    @property
    def on_host(self) -> bool:
        """Stepped by the host CPU: a host-state region that is not streamed."""
        return self.host and not self.streamed

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@dataclass(frozen=True)
class StepReport:
    """What one :meth:`AMPOptimizer.step` did. Times are ``time.perf_counter()`` seconds."""

    step: int
    """Optimizer steps taken so far, this one included (skipped steps do not count)."""
    skipped: bool
    """True when fp16 gradients overflowed and no parameter changed."""
    loss_scale: float
    """The scale the step's gradients carried (1.0 without loss scaling)."""
    grad_norm: float | None
    """Global gradient norm before clipping (unscaled), when it was computed."""
    clip_coef: float
    """Factor the gradients were multiplied by (1.0 when not clipped)."""
    overlap: OverlapMode
    region_steps: tuple[RegionStepTiming, ...]
    backward_start_s: float | None
    """When the last micro-batch's ``backward`` was called."""
    backward_end_s: float | None
    """When it returned (on CUDA: all kernels launched, not necessarily finished)."""
    step_end_s: float | None = None
    """When :meth:`AMPOptimizer.step` returned; host steps still queued then overlapped
    the caller's next work (the next forward)."""
    undone_regions: int = 0
    """Regions whose speculative step (SPECULATIVE_UNDO) this step undid: non-zero only in
    a skipped step. ``region_steps`` still holds those steps' timings: the work was done."""
    speculated_regions: int = 0
    """Host-state regions stepped in their hooks before the answer (SPECULATIVE_UNDO:
    committed or undone) or without one (SPECULATIVE); the others stepped after
    :meth:`AMPOptimizer.step` had the answer."""

    @property
    def host_step_s(self) -> float:
        """Total time of host-state region steps on the host (with SPECULATIVE_UNDO, the
        publishes after the commit are recorded as steps of their regions too); streamed
        regions, stepped on the device, are not counted."""
        return sum(t.duration_s for t in self.region_steps if t.on_host)

    def hidden_fraction(self, backward_end_s: float | None = None) -> float:
        """Fraction of the host step time that ran before ``backward_end_s``.

        Pass the time backward really ended on the device (after a synchronize); default
        :attr:`backward_end_s`. 1.0 when there was no host step.
        """
        end = self.backward_end_s if backward_end_s is None else backward_end_s
        total = self.host_step_s
        if total == 0.0 or end is None or self.backward_start_s is None:
            return 1.0
        hidden = 0.0
        for t in self.region_steps:
            if t.on_host:
                hidden += max(0.0, min(t.end_s, end) - max(t.start_s, self.backward_start_s))
        return hidden / total

    def after_step_fraction(self) -> float:
        """Fraction of the host step time that ran after :meth:`AMPOptimizer.step` returned.

        That part overlapped the next forward instead of delaying ``step()``; how much of
        it the forward then waited for is ``OffloadController.update_wait_s``. 0.0 when
        there was no host step.
        """
        total = self.host_step_s
        if total == 0.0 or self.step_end_s is None:
            return 0.0
        after = 0.0
        for t in self.region_steps:
            if t.on_host:
                after += max(0.0, t.end_s - max(t.start_s, self.step_end_s))
        return after / total


Pending = tuple[StepReport, list[RegionStepTiming], list[Future[None]], list[int] | None]
"""A step's report without its region timings, the list its timings go to, its host steps
still queued, and (SPECULATIVE_UNDO, the step taken) the list of regions whose speculative
steps the host task commits."""


def completed(
    report: StepReport,
    timings: list[RegionStepTiming],
    futures: list[Future[None]],
    committed: list[int] | None,
) -> StepReport:
    """``report`` with its region steps' timings (and the speculative steps committed),
    once its queued host steps are done (re-raises their error): what
    :attr:`AMPOptimizer.last_step` and :meth:`AMPOptimizer.recent_steps` return for a
    step."""
    for fut in futures:
        fut.result()
    if committed is None:
        return dataclasses.replace(report, region_steps=tuple(timings))
    return dataclasses.replace(
        report, region_steps=tuple(timings), speculated_regions=len(committed)
    )
