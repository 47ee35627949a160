"""Speculative host steps: stepped before the step's answer, committed or undone exactly.

[Note: speculative steps]
A host-state region can be stepped before it is known whether the step should happen
(fp16 overflow; see [Note: overlapping the host step with backward] in overlap.py, option
1) and the step undone exactly if not. Adam is not invertible in floating point, so the
undo needs what the step overwrote. :meth:`HybridAdam.speculate_region` keeps it at
little memory traffic: per chunk of about 1M elements
(``host_kernels.SPECULATE_CHUNK_NUMEL``), in cache, it copies the master into a backup and
the moments into a *spare* pair of moment buffers, then runs the fused kernel on (master,
gradient, spare moments). Main memory sees the master, gradient and moments read once and
the master, backup and spare moments written once: about 32 bytes per parameter (36
counting the unscaled gradient the kernel writes back) against 28 (32) for the plain
step, instead of 52 for a backup pass before the step. bf16 moments are widened from the
moments and narrowed into the spare ones, as the chunked bf16 route does, so they add no
copy at all (only the backup).
- commit (``HybridAdam.commit_speculation``): each stepped segment swaps its moment
  buffers with the spare ones, and the ``state`` entries of its parameters are
  re-pointed: a reference swap, no copy. The buffers therefore alternate between steps: a
  tensor taken from ``state`` earlier may be the spare one afterwards; read ``state``
  again after a step.
- undo (``HybridAdam.undo_speculation``): the master is copied back from the backup (8
  bytes per parameter, only in the rare undone step) and the step counts are restored;
  the moments were never written.
The extra host memory is 12 bytes per host-state parameter (8 with bf16 moments), pageable,
allocated once by :meth:`HybridAdam.prepare_speculation`. Nothing is published by a
speculative step: the caller publishes after the commit
(``submit_host_steps(..., commit=...)``). While a step is uncommitted, ``state_dict``,
``load_state_dict`` and other steps of the region refuse to run.
With torch's kernels each of a chunk's copies and its fused step is a parallel pass of its
own, so the chunk leaves each core's cache between them and the speculative step costs
well over the plain one (``python benchmarks/host_adam_bench.py`` times both;
BENCHMARKS.md, Decisions, "Speculative fp16 host steps"). A slower step still pays where
it runs, in host time that backward leaves idle: a region whose gradients land after
backward has ended takes the plain step (overlap.py's SPECULATIVE tail rule).
The single-pass kernel (``PlanOptions.host_kernel``) replaces the copies and the fused
kernel with one compiled pass that writes the backup, the stepped master and the spare moments (see
[Note: single-pass host Adam] in offload_runtime/host_kernels/single_pass.py); commit and
undo are the same.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import wait as futures_wait

import torch

from offload_optim.layout import (
    ParamState,
    RegionAdamState,
    Segment,
    Spare,
    StateLayout,
    attach_spare,
    hyper_of,
)
from offload_optim.reports import RegionStepTiming
from offload_optim.stepping import Stepper, consumed
from offload_runtime.host_kernels import AdamHyper, scale_tensor, single_pass, speculative_adam_
from offload_runtime.planning.speculation import SPECULATION_HOST_SHARE

HostBytes = Callable[[], int | None]
"""Host bytes allocatable now, or None where nothing could be read."""


def wait_calling(fut: Future[None], between: Callable[[], None], poll_s: float) -> None:
    """Block until ``fut`` is done, calling ``between()`` first and then about every
    ``poll_s`` seconds while it runs (the host worker publishing landed streamed regions
    while it waits for another thread)."""
    while not fut.done():
        between()
        futures_wait([fut], timeout=poll_s)


class Speculation:
    """A HybridAdam's speculative steps: their buffers, the steps and their thread, the
    commit and the undo (see [Note: speculative steps])."""

    def __init__(
        self,
        layout: StateLayout,
        stepper: Stepper,
        use_thread: bool,
    ) -> None:
        self.layout = layout
        self.stepper = stepper
        self.use_thread = use_thread
        """The plan's ``PlanOptions.speculation_thread``: submitted steps run on the
        module's speculation thread, in submission order."""
        self.speculated: set[int] = set()
        """Regions with an uncommitted speculative step."""
        self.prepared = False
        self._running: list[Future[None]] = []
        """Speculative steps submitted to the thread and not yet waited for (appended by
        hooks on the host worker; taken by :meth:`wait` once those hooks have run)."""

    # ---- buffers -------------------------------------------------------------------

    def _speculating_kind(self, rs: RegionAdamState) -> bool:
        return rs.storage.host_state and not rs.storage.streamed

    def missing_bytes(self) -> int:
        """Host bytes of the buffers that host-stepped regions lack."""
        return sum(
            rs.spare_bytes
            for rs in self.layout.regions.values()
            if self._speculating_kind(rs) and rs.spare is None
        )

    def can(self, r: int) -> bool:
        """Whether region ``r`` has the buffers of a speculative step."""
        rs = self.layout.regions.get(r)
        return rs is not None and rs.spare is not None

    def params_that_fit(self, available: HostBytes) -> int:
        """Trainable host-state parameters with buffers (once prepared), or whose buffers
        would fit in host memory now."""
        if self.prepared:
            return sum(
                rs.storage.trainable_numel
                for rs in self.layout.regions.values()
                if rs.spare is not None
            )
        _, picked, _, _ = self._suffix(None, available)
        return sum(rs.storage.trainable_numel for rs in picked)

    def _suffix(
        self, max_params: int | None, available: HostBytes
    ) -> tuple[list[RegionAdamState], list[RegionAdamState], bool, int | None]:
        """(host-state regions in landing order, the ones that get buffers, whether host
        memory cut the run short, the host bytes available)."""
        if max_params is not None and (isinstance(max_params, bool) or max_params < 0):
            raise ValueError(f"max_params must be None or >= 0 parameters, got {max_params}")
        order = sorted(
            (rs for rs in self.layout.regions.values() if self._speculating_kind(rs)),
            key=lambda rs: -rs.storage.index,
        )
        host_bytes = available()
        allowance = None if host_bytes is None else int(host_bytes * SPECULATION_HOST_SHARE)
        picked: list[RegionAdamState] = []
        params = nbytes = 0
        short = False
        for rs in order:
            if max_params is not None and params + rs.storage.trainable_numel > max_params:
                break
            if allowance is not None and nbytes + rs.spare_bytes > allowance:
                short = True
                break
            picked.append(rs)
            params += rs.storage.trainable_numel
            nbytes += rs.spare_bytes
        return order, picked, short, host_bytes

    def prepare(self, max_params: int | None, available: HostBytes) -> None:
        """Allocate the buffers once (see ``HybridAdam.prepare_speculation``); a warning,
        attributed to the caller of ``HybridAdam.prepare_speculation``, names what host
        memory left out."""
        if self.prepared:
            return
        order, picked, short, host_bytes = self._suffix(max_params, available)
        self.prepared = True
        for i, rs in enumerate(picked):
            try:
                rs.spare = Spare(rs.storage.trainable_numel, rs.exp_avg.dtype)
            except RuntimeError:  # the allocator's "can't allocate memory": keep the rest
                short = True
                picked = picked[:i]
                break
            for seg in rs.segments:
                attach_spare(rs.spare, seg)
        if short:
            total = sum(rs.storage.trainable_numel for rs in order)
            got = sum(rs.storage.trainable_numel for rs in picked)
            need = sum(rs.spare_bytes for rs in order)
            have = "unknown" if host_bytes is None else f"{host_bytes / 2**30:.2f} GiB"
            warnings.warn(
                f"speculative fp16 steps need {need / 2**30:.2f} GiB ({need} bytes) of host "
                "memory for all host-state regions (per parameter an fp32 master backup "
                "and a second pair of Adam moments: 12 bytes, 8 with bf16 moments); with "
                f"{have} available, {len(picked)} of {len(order)} regions ({got} of {total} "
                "trainable parameters) may step under backward and the others step after it. "
                "Plan with OffloadConfig(host_memory_bytes=...) to predict that, or free host "
                "memory",
                RuntimeWarning,
                stacklevel=3,  # HybridAdam.prepare_speculation's caller
            )

    # ---- the steps -----------------------------------------------------------------

    def check(self, r: int) -> None:
        """Raise unless region ``r`` may step speculatively now."""
        rs = self.layout.regions[r]
        if not self._speculating_kind(rs):
            raise ValueError(
                f"speculate_region got region {r}, whose step runs on the device "
                "(device state or streamed): only host-stepped regions speculate"
            )
        if rs.spare is None:
            raise RuntimeError(
                f"region {r} has no buffers for a speculative step: call prepare_speculation()"
            )
        if r in self.speculated:
            raise RuntimeError(
                f"region {r} was already stepped speculatively in this window; "
                "commit_speculation() or undo_speculation() first"
            )

    def submit(
        self,
        r: int,
        grad_scale: float | None,
        *,
        hypers: dict[int, AdamHyper],
        timings: list[RegionStepTiming],
        stop: Callable[[], bool] | None = None,
        stepped: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """Host worker: see ``HybridAdam.submit_speculation``."""
        self.check(r)
        segments = self.layout.segments_with_grad(r)
        if not segments:
            return

        def run() -> None:
            if stop is not None and self.use_thread and stop():
                return
            with torch.profiler.record_function(f"speculative step {r}"):
                part = self.speculate(r, segments, grad_scale, hypers, timings)
            if stepped is not None:
                stepped(r, part)

        if not self.use_thread:
            run()
            return
        thread = self.layout.require_controller().streams.speculation_thread()
        self._running.append(thread.submit(run))

    def wait(self, between: Callable[[], None] | None = None) -> None:
        """See ``HybridAdam.wait_speculation``."""
        pending, self._running = self._running, []
        error: BaseException | None = None
        for fut in pending:
            if between is not None:
                wait_calling(fut, between, 0.001)
            exc = fut.exception()  # waits; re-raised below, after the rest finish
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    @torch.no_grad()
    def speculate(
        self,
        r: int,
        segments: list[Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        sink: list[RegionStepTiming],
    ) -> torch.Tensor:
        """``HybridAdam.speculate_region``'s step of ``segments`` (those with gradients,
        found by the caller: this reads no ``.grad``), recorded in ``sink``; returns the
        region's overflow partial."""
        rs = self.layout.regions[r]
        spare = rs.spare
        assert spare is not None, "checked by check()"
        start = time.perf_counter()
        # The gradient check must see the whole region, as the non-speculative check does:
        # when segments without gradients leave parts of it out, read it all first.
        io = self.stepper.staged_io(rs, segments)  # widens a staged gradient it does not step
        covered = sum(seg.param.numel() for seg in segments) == rs.storage.numel
        whole = None if covered else rs.storage.grad.sum()
        scale = scale_tensor(grad_scale, torch.device("cpu"))
        parts = []
        for seg in segments:
            assert seg.grad is not None and seg.spare is not None
            hyper = hyper_of(seg, hypers)
            before = float(seg.step)
            seg.step.add_(1.0)  # as Stepper.run counts it
            stop = seg.start + seg.param.numel()
            kernel: Callable[..., torch.Tensor] = (
                single_pass.speculative_adam_fp16_io_
                if io is not None
                else single_pass.speculative_adam_
                if self.stepper.single_pass(seg.param.device)
                else speculative_adam_
            )
            args = [
                seg.param,
                seg.grad if io is None else io[0][seg.start : stop],
                seg.exp_avg,
                seg.exp_avg_sq,
                seg.spare[0],
                seg.spare[1],
                spare.backup[seg.start : stop],
            ]
            if io is not None:
                args.append(io[1][seg.start : stop])  # the fp16 upload copy it writes
            try:
                parts.append(kernel(*args, seg.step, hyper, scale))
            except BaseException:
                seg.step.fill_(before)
                raise
            spare.pending.append((seg, before))
        if io is not None:
            consumed(rs.storage)
        self.speculated.add(r)
        sink.append(RegionStepTiming(r, start, time.perf_counter(), host=True))
        return whole if whole is not None else torch.stack(parts).sum()

    def commit(self, state: ParamState) -> list[int]:
        """See ``HybridAdam.commit_speculation``; re-points ``state``'s moment entries."""
        done = sorted(self.speculated)
        for r in done:
            spare = self.layout.regions[r].spare
            assert spare is not None
            for seg, _ in spare.pending:
                assert seg.spare is not None
                seg.spare, seg.exp_avg, seg.exp_avg_sq = (
                    (seg.exp_avg, seg.exp_avg_sq),
                    seg.spare[0],
                    seg.spare[1],
                )
                old = []
                for p, (m, v) in zip(seg.views, seg.spare_views, strict=True):
                    entry = state[p]
                    old.append((entry["exp_avg"], entry["exp_avg_sq"]))
                    entry["exp_avg"], entry["exp_avg_sq"] = m, v
                seg.spare_views = tuple(old)
            spare.pending.clear()
        self.speculated.clear()
        return done

    @torch.no_grad()
    def undo(self) -> list[int]:
        """See ``HybridAdam.undo_speculation``."""
        done = sorted(self.speculated)
        for r in done:
            st = self.layout.regions[r].storage
            spare = self.layout.regions[r].spare
            assert spare is not None
            for seg, before in spare.pending:
                stop = seg.start + seg.param.numel()
                seg.param.copy_(spare.backup[seg.start : stop])
                seg.step.fill_(before)
                if st.upload_copy_fresh and st.host_params is not None:
                    # An fp16-I/O step wrote the offloaded region's upload source: restore.
                    st.host_params[seg.start : stop].copy_(seg.param)
            st.upload_copy_fresh = False
            spare.pending.clear()
        self.speculated.clear()
        return done

    def refuse(self, what: str) -> None:
        """Raise if a speculative step is uncommitted: ``what`` cannot run then."""
        if self.speculated:
            raise RuntimeError(
                f"{what} while regions {sorted(self.speculated)} hold an uncommitted "
                "speculative step; finish the window first (AMPOptimizer.step() or zero_grad())"
            )
