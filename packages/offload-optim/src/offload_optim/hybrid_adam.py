"""HybridAdam: Adam(W) that steps an OffloadModule region by region, on host or device.

[Note: region segments]
The runtime keeps each region's fp32 master weights and fp32 gradients in two flat buffers
(see [Note: region storage] in offload_runtime/storage.py). HybridAdam gives each region two
flat moment buffers of the same length next to the master, and steps the region with as
few fused-kernel launches as possible: the region's parameters of one parameter group
that lie next to each other in the flat buffers form one *segment*, stepped as a single
tensor. A region whose parameters all belong to one group (the usual case) is one segment
and one kernel launch, whatever its number of parameters. A segment keeps one step count,
since all its parameters step together.

Host-state regions are stepped by torch's fused CPU Adam, device-state regions by its
fused CUDA Adam. Parameters that are not OffloadModule masters ("plain" parameters) are
stepped like ``torch.optim.AdamW(fused=True)`` would step them.

Threads: the step of a host-state region runs on the runtime's host worker (queued by
:meth:`HybridAdam.submit_host_steps`, or called from a grad-ready hook, which runs there),
and so does its ``controller.publish``; device-state regions and plain parameters are
stepped on the calling thread. A streamed region's device step is issued from the
issuing thread (a step's regions) or the host worker (a hook's), and published by either
(see [Note: streamed steps] in streamed.py). A region is only ever stepped by one thread
at a time. :meth:`HybridAdam.step` waits for the host steps; ``AMPOptimizer`` does not
(see [Note: overlapping the host step with backward] in amp.py).

[Note: speculative steps]
A host-state region can be stepped before it is known whether the step should happen (fp16
overflow; see amp.py's note, option 1) and the step undone exactly if not. Adam is not
invertible in floating point, so the undo needs what the step overwrote.
:meth:`HybridAdam.speculate_region` keeps it at little memory traffic: per chunk of about
1M elements (``kernels.SPECULATE_CHUNK_NUMEL``), in cache, it copies the master into a
backup and the moments into a *spare* pair of moment buffers, then runs the fused kernel
on (master, gradient, spare moments). Main memory sees the master, gradient and moments
read once and the master, backup and spare moments written once: about 32 bytes per
parameter (36 counting the unscaled gradient the kernel writes back) against 28 (32) for
the plain step, instead of 52 for a backup pass before the step. bf16 moments are widened
from the moments and narrowed into the spare ones, as the chunked bf16 route does, so they
add no copy at all (only the backup).
- commit (:meth:`commit_speculation`): each stepped segment swaps its moment buffers with
  the spare ones, and the ``state`` entries of its parameters are re-pointed: a reference
  swap, no copy. The buffers therefore alternate between steps: a tensor taken from
  ``state`` earlier may be the spare one afterwards; read ``state`` again after a step.
- undo (:meth:`undo_speculation`): the master is copied back from the backup (8 bytes per
  parameter, only in the rare undone step) and the step counts are restored; the moments
  were never written.
The extra host memory is 12 bytes per host-state parameter (8 with bf16 moments), pageable,
allocated once by :meth:`HybridAdam.prepare_speculation`. Nothing is published by a
speculative step: the caller publishes after the commit
(``submit_host_steps(..., stepped=...)``). While a step is uncommitted, ``state_dict``,
``load_state_dict`` and other steps of the region refuse to run.
With torch's kernels each of a chunk's copies and its fused step is a parallel pass of its
own, so the chunk leaves each core's cache between them and the speculative step costs
well over the plain one (``python benchmarks/host_adam_bench.py`` times both;
BENCHMARKS.md, Decisions, "Speculative fp16 host steps"). A slower step still pays where
it runs, in host time that backward leaves idle: a region whose gradients land after
backward has ended takes the plain step (amp.py's SPECULATIVE tail rule).
``HybridAdam(host_kernel="single_pass")`` replaces the copies and the fused kernel with
one compiled pass that writes the backup, the stepped master and the spare moments (see
[Note: single-pass host Adam] in single_pass.py); commit and undo are the same.

[Note: fp16 I/O steps]
An fp16 module that converts on the host moves fp16 across PCIe: a host-state region's
gradients land in its pinned fp16 staging buffer, and its next upload reads an fp16 host
copy (``host_params`` when offloaded, the staging buffer when resident). Without fp16 I/O
the host makes three passes per region and step: widen the gradients into the fp32
accumulator, step, narrow the master into the upload copy. ``HybridAdam(fp16_io=True)``
makes one: the runtime leaves the gradients in the staging buffer
(``OffloadController.keep_staged_grads``, ``RegionStorage.grad_in_staging``), and the
single-pass kernel reads them there and writes the upload copy as it steps
(``single_pass.adam_fp16_io_``), which the publish then uploads without a cast
(``RegionStorage.upload_copy_fresh``). Widening is exact and the narrowing rounds as
``.half()`` does, so master, moments and upload copy equal the three passes' bit for bit.
A speculative step writes the upload copy too; an undo rewrites an offloaded region's copy
from the restored master (a resident region's is cast again at its next publish). The
fp16 gradients stay the only copy until something else needs the fp32 accumulator:
``region_grad``, ``module.named_gradients()`` and a second backward that adds to them
(accumulation: the runtime widens them before that backward's copy overwrites the staging
buffer) widen them first. A region whose step covers only part of it (segments without
gradients) is widened and stepped by the fp32 kernel.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast, overload

import torch

from offload_optim import single_pass, streamed
from offload_optim.kernels import (
    HOST_KERNELS,
    AdamHyper,
    fused_adam_,
    scale_tensor,
    speculative_adam_,
)
from offload_optim.streamed import StreamedQueue, StreamPiece, StreamRing
from offload_runtime.hardware import available_host_memory_bytes
from offload_runtime.storage import RegionStorage, alloc_host, region_of
from offload_runtime.streams import Event
from offload_solver import StreamedStepCosts

if TYPE_CHECKING:
    from offload_runtime.controller import OffloadController
    from offload_runtime.module import OffloadModule

MOMENT_DTYPES = (torch.float32, torch.bfloat16)


def _wait_calling(fut: Future[None], between: Callable[[], None], poll_s: float) -> None:
    """Block until ``fut`` is done, calling ``between()`` first and then about every
    ``poll_s`` seconds while it runs (the host worker publishing landed streamed regions
    while it waits for another thread)."""
    while not fut.done():
        between()
        futures_wait([fut], timeout=poll_s)


@dataclass(frozen=True)
class RegionStepTiming:
    """When one region's optimizer step ran, in ``time.perf_counter()`` seconds."""

    region: int
    start_s: float
    end_s: float
    host: bool
    """True for a host-state region (stepped on the host worker, or streamed)."""
    streamed: bool = False
    """A streamed region (see [Note: streamed steps] in streamed.py): stepped on the
    device; the span runs from issuing its device work to publishing it."""
    issue_s: float = 0.0
    """A streamed region: seconds spent issuing its device work (copies, kernels and
    events per ring chunk), on the issuing thread (a step's regions) or the host worker
    (a region its own hook issues), not counting ``paced_wait_s``; 0 for the others."""
    paced_wait_s: float = 0.0
    """A streamed region issued by the issuing thread: seconds it waited for free ring
    slots while issuing it ([Note: paced ring] in streamed.py); 0 otherwise."""
    up_bytes: int = 0
    """A streamed region on CUDA: bytes its ring chunks' copies up carried (staged ones
    included), where their device timing was read ([Note: timing the ring's copies up]
    in streamed.py); 0 otherwise."""
    up_s: float = 0.0
    """Seconds those copies up took on the device, summed over its chunks."""

    @property
    def on_host(self) -> bool:
        """Stepped by the host CPU: a host-state region that is not streamed."""
        return self.host and not self.streamed

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s


@torch.no_grad()
def _zero_on_host(grads: list[torch.Tensor], storages: list[RegionStorage]) -> None:
    torch._foreach_zero_(grads)
    for st in storages:
        st.grad_in_staging = False  # a gradient kept in staging is zeroed too


class _Segment:
    """Parameters of one group stepped as one tensor (see [Note: region segments])."""

    def __init__(
        self,
        group: dict[str, Any],
        views: tuple[torch.Tensor, ...],
        param: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor | None = None,
        grad_views: tuple[torch.Tensor, ...] = (),
        start: int = 0,
        storage: RegionStorage | None = None,
    ) -> None:
        self.group = group
        self.storage = storage
        """The region's storage (None for a plain parameter)."""
        self.views = views
        """The optimizer's parameters in this segment (master views, or one plain tensor)."""
        self.param = param
        self.grad = grad
        """The flat gradient slice of a region segment; None for a plain parameter."""
        self.grad_views = grad_views
        """The runtime's gradient view of each of ``views`` (what ``view.grad`` should be)."""
        self.exp_avg = exp_avg
        self.exp_avg_sq = exp_avg_sq
        # fp32 0-dim on the parameter's device, as the fused kernels read it.
        self.step = torch.zeros((), dtype=torch.float32, device=param.device)
        self.start = start
        """Offset of the segment in its region's flat buffers (0 for a plain parameter)."""
        self.spare: tuple[torch.Tensor, torch.Tensor] | None = None
        """Where a speculative step writes the next moments (see [Note: speculative
        steps]); swapped with (``exp_avg``, ``exp_avg_sq``) when the step is committed."""
        self.spare_views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        """``spare`` cut per parameter of ``views``, shaped like it (what ``state`` shows)."""


def _hyper_of(seg: _Segment, hypers: dict[int, AdamHyper] | None) -> AdamHyper:
    """Segment ``seg``'s hyperparameters: from a :meth:`HybridAdam.hypers` snapshot, or
    its group's values now."""
    return AdamHyper.of_group(seg.group) if hypers is None else hypers[id(seg.group)]


class _Spare:
    """A host-state region's buffers for speculative steps (see [Note: speculative steps])."""

    def __init__(self, numel: int, moments_dtype: torch.dtype) -> None:
        # Pageable: the host step is their only reader and writer, nothing crosses PCIe.
        self.backup = torch.empty(numel, dtype=torch.float32)
        """The master as it was before the speculative step (of the stepped segments)."""
        self.exp_avg = torch.empty(numel, dtype=moments_dtype)
        self.exp_avg_sq = torch.empty(numel, dtype=moments_dtype)
        self.pending: list[tuple[_Segment, float]] = []
        """Segments stepped speculatively and not yet committed, with their step count
        before that step."""


def _nothing() -> None:
    """The default ``published`` callback of :meth:`HybridAdam.issue_region`."""


def _publish_streamed_step(
    controller: OffloadController,
    sink: list[RegionStepTiming],
    r: int,
    then: Callable[[], None],
    start: float,
    end: float,
    issue_s: float = 0.0,
    paced_wait_s: float = 0.0,
    written: Event | None = None,
    up_copies: list[streamed.UpCopy] | None = None,
) -> None:
    """Publish streamed region ``r`` once its downloads landed: mark it published on
    ``controller`` (``written``: its device parameters were written by the device step,
    ready at that event, and nothing goes up; see [Note: writing resident parameters] in
    streamed.py), record its :class:`RegionStepTiming` in ``sink`` (``start``/``end`` in
    seconds of ``time.perf_counter``, ``issue_s`` and ``paced_wait_s`` in seconds, with
    the device time of ``up_copies``, its ring chunks' timed copies up), then call
    ``then`` (step()'s task completes the region's future; a hook's
    :meth:`HybridAdam.issue_region` calls its ``published``)."""
    with torch.profiler.record_function(f"streamed step {r} (publish)"):
        if written is None:
            controller.publish(r)
        else:
            controller.publish_written(r, written)
        up_bytes, up_s = streamed.up_copy_time(up_copies or [])
        sink.append(
            RegionStepTiming(r, start, end, True, True, issue_s, paced_wait_s, up_bytes, up_s)
        )
        then()


class _RegionState:
    def __init__(self, storage: RegionStorage, moments_dtype: torch.dtype) -> None:
        self.storage = storage
        device = storage.master.device
        # A streamed region's moments cross PCIe at every step: pinned, as its master is,
        # and at their exact size (PyTorch's caching pinned allocator rounds a buffer up
        # to a power of two: up to twice the host memory).
        pin = storage.streamed and storage.master.is_pinned()
        if pin:
            self.exp_avg = alloc_host(storage.numel, moments_dtype, pin=True).zero_()
            self.exp_avg_sq = alloc_host(storage.numel, moments_dtype, pin=True).zero_()
        else:
            self.exp_avg = torch.zeros(storage.numel, dtype=moments_dtype, device=device)
            self.exp_avg_sq = torch.zeros(storage.numel, dtype=moments_dtype, device=device)
        self.segments: list[_Segment] = []
        self.spare: _Spare | None = None
        """Allocated by :meth:`HybridAdam.prepare_speculation` (host-state regions only)."""

    @property
    def spare_bytes(self) -> int:
        """Host bytes :class:`_Spare` takes: an fp32 master backup and two moment buffers."""
        return self.storage.numel * (4 + 2 * self.exp_avg.element_size())


SPECULATION_HOST_SHARE = 0.9
"""Share of the host memory available at the first speculative backward that
:meth:`HybridAdam.prepare_speculation` may take for its buffers."""


def _available_host_bytes() -> int | None:
    """Host bytes allocatable now (the runtime's reading of ``MemAvailable`` and the cgroup
    limit); None where nothing could be read."""
    return available_host_memory_bytes() or None


class HybridAdam(torch.optim.Optimizer):
    """Adam(W) over OffloadModule master weights (by region) and ordinary tensors.

    Args:
        params: tensors or parameter groups, as for any ``torch.optim`` optimizer; usually
            ``module.parameters()`` of an ``OffloadModule`` (its fp32 master weights).
        lr, betas, eps, weight_decay: Adam's hyperparameters (per group, like torch's).
        adamw_mode: decoupled weight decay (AdamW) when true, L2 regularisation when false.
        moments_dtype: dtype of the Adam moments of host-resident state (host-state regions
            and plain fp32 CPU tensors): ``torch.float32`` or ``torch.bfloat16``. bf16 halves
            the moments' host memory; with torch's kernels it makes the host step slower,
            not faster (see [Note: bf16 moments] in kernels.py); with
            ``host_kernel="single_pass"`` it moves 8 fewer bytes per parameter (20
            instead of 28) and steps faster (BENCHMARKS.md, Decisions, "bf16 moments").
            Device-resident moments stay fp32.
        host_kernel: the kernels that step host-resident state. ``"torch"`` (default):
            torch's fused CPU Adam. ``"single_pass"``: one-pass kernels compiled by numba
            (``pip install 'offload-optim[single-pass]'``; fp32 or bf16 moments), whose
            speculative fp16 step keeps its undo data in the same pass instead of copying
            it first (see [Note: single-pass host Adam] in single_pass.py). Both compute
            torch's Adam formula; they differ in rounding (about 1e-7 of an update), so a
            run uses one of them for every host step. Device-resident state always steps
            with torch's fused CUDA kernel.
        fp16_io: with ``host_kernel="single_pass"`` (fp32 or bf16 moments) and an fp16
            module that converts on the host (``convert_on_device=False``): each host-state
            region steps straight from the fp16 gradients in its pinned staging buffer and writes
            the new master's fp16 upload copy in the same pass, so the host makes no
            separate widening and narrowing passes (see [Note: fp16 I/O steps]). Values
            are those of the separate passes, bit for bit. The fp32 accumulator of such a
            region is then filled only on demand (``module.named_gradients()``,
            ``AMPOptimizer.clip_grad_norm``); the region's step consumes the gradient, so
            a resident host-state region's ``.grad`` reads zero after the step. Needs the
            CPU's half-precision conversions (``single_pass.fp16_io_available()``).
        module: the OffloadModule whose masters are among ``params``; needed to step them
            (its controller orders the step after the host gradient work and publishes the
            new weights). ``AMPOptimizer`` binds it for you.
        speculation_thread: run the speculative steps that grad-ready hooks submit
            (:meth:`submit_speculation`, ``AMPOptimizer(speculate_fp16=True)``) on a
            thread of their own instead of in the hook. The host worker then keeps taking
            landed gradients while one runs, so ``AMPOptimizer.step()`` has its answer
            and queues its task without waiting for the speculative step in flight when
            backward ends, and that task issues the streamed regions before it waits for
            the speculative steps and commits them. Values are the same either way. On
            by default (measured: BENCHMARKS.md, Decisions, "Threads that issue, publish
            and speculate"). Pass the same to ``memory_optimize(speculation_thread=)``,
            whose default follows this one.
        stage_in_backward: the first streamed region's gradient hook in the backward
            before a step (the last micro-batch's, with overlap) has the host worker
            issue the copies up of the streamed regions' leading chunks' master weights
            and moments (12 of a chunk's 14 bytes a parameter with fp32 moments and fp16
            gradients), while the backward still runs and the H2D link is mostly idle;
            the step then copies up only their gradients (see [Note: staging the state
            in backward] in streamed.py). The ring's device memory is then held from
            that hook on, which the planner counts when planned with
            ``streamed_step_costs(stage_in_backward=True)`` (the default follows this
            one's, ``streamed.STAGE_IN_BACKWARD``; a plan that differs is warned
            about). Values are the same either way. On by default (measured:
            BENCHMARKS.md, Decisions, "Staging streamed state in backward").

    Streamed regions (see [Note: streamed steps] in streamed.py) of a step are issued
    from a thread of their own, which paces the ring and publishes the regions whose
    publish casts nothing on the host, while the host worker steps the other host-state
    regions (BENCHMARKS.md, Decisions, "Threads that issue, publish and speculate").

    ``param_groups[i]["lr"]`` is read at every step, so ``torch.optim.lr_scheduler``
    schedulers work. Each region's moments are allocated up front, next to its master.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        adamw_mode: bool = True,
        *,
        moments_dtype: torch.dtype = torch.float32,
        host_kernel: str = "torch",
        fp16_io: bool = False,
        module: OffloadModule | None = None,
        speculation_thread: bool = True,
        stage_in_backward: bool = streamed.STAGE_IN_BACKWARD,
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr={lr} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must each lie in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"eps={eps} must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        if moments_dtype not in MOMENT_DTYPES:
            raise ValueError(
                f"moments_dtype={moments_dtype} is not supported; use torch.float32 or "
                "torch.bfloat16"
            )
        if host_kernel not in HOST_KERNELS:
            raise ValueError(f"host_kernel={host_kernel!r}; use one of {HOST_KERNELS}")
        if host_kernel == "single_pass":
            single_pass.require()
        if fp16_io:
            if host_kernel != "single_pass":
                raise ValueError("fp16_io=True needs host_kernel='single_pass'")
            single_pass.require_fp16_io()
        self.host_kernel = host_kernel
        self.fp16_io = fp16_io
        # Set before Optimizer.__init__, which calls add_param_group.
        self.moments_dtype = moments_dtype
        self._regions: dict[int, _RegionState] = {}
        self._region_list: list[int] = []  # sorted keys of _regions, kept with it
        self._plain: list[_Segment] = []
        self._controller: OffloadController | None = None
        self._masters: dict[int, tuple[RegionStorage, str]] | None = None
        self._laid_out = False
        self._speculated: set[int] = set()  # regions with an uncommitted speculative step
        self._speculation_prepared = False
        self._ring_streams: streamed.RingStreams | None = None
        self._streaming: tuple[StreamRing, StreamedQueue] | None = None
        """The ring and the queue of streamed regions issued and not yet published (host
        worker only; see :meth:`publish_streamed`)."""
        self._issuer: ThreadPoolExecutor | None = None
        """The thread a step's streamed regions are issued from (made at the first use)."""
        self._issuing = 0
        """Issuing tasks running on that thread: the ring stays open while one runs."""
        self.stage_in_backward = stage_in_backward
        """Whether :meth:`stage_streamed_state` stages anything (see above)."""
        self.staged_chunks = 0
        """Ring chunks stepped from a staged slot so far ([Note: staging the state in
        backward] in streamed.py)."""
        self.speculation_thread = speculation_thread
        self._speculator: ThreadPoolExecutor | None = None
        """The thread speculative steps run on with ``speculation_thread`` (made at the
        first use)."""
        self._speculating: list[Future[None]] = []
        """Speculative steps submitted to it and not yet waited for (appended by hooks on
        the host worker; taken by :meth:`wait_speculation` once those hooks have run)."""
        self._planned_streaming: StreamedStepCosts | None = None
        """The plan's streaming costs (``Plan.streamed``): rings are built to its size."""
        self.timings: list[RegionStepTiming] = []
        """Region steps since this list was last cleared (appended from two threads)."""
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "adamw_mode": adamw_mode,
        }
        super().__init__(params, defaults)
        if module is not None:
            self.bind(module)

    # ---- set-up --------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch's checks apply); its region parameters are laid out in segments."""
        super().add_param_group(param_group)
        if self._laid_out:
            self._lay_out_group(self.param_groups[-1])

    def _ensure_laid_out(self) -> None:
        """Lay every group out in segments (deferred until the module is known)."""
        if not self._laid_out:
            self._laid_out = True
            for group in self.param_groups:
                self._lay_out_group(group)

    def _owner(self, p: torch.Tensor) -> tuple[RegionStorage, str] | None:
        """The region and parameter name whose master weights ``p`` is, if any."""
        if self._masters is not None:
            return self._masters.get(id(p))
        try:
            found = region_of(p) is not None
        except RuntimeError:
            # region_of's weak dictionary compares tensors with ==, which raises for a
            # registered multi-element tensor: that it raised means p is registered.
            found = True
        if found:
            raise RuntimeError(
                "HybridAdam got OffloadModule master weights but no module: pass "
                "module=... to HybridAdam, call optimizer.bind(module), or wrap the optimizer "
                "in AMPOptimizer(optimizer, module)"
            )
        return None

    def _lay_out_group(self, group: dict[str, Any]) -> None:
        by_region: dict[int, list[tuple[int, str, torch.Tensor]]] = {}
        for p in group["params"]:
            owner = self._owner(p)
            if owner is None:
                self._add_plain(group, p)
                continue
            st, name = owner
            if st.index not in self._regions:
                dtype = self.moments_dtype if st.host_state else torch.float32
                self._regions[st.index] = _RegionState(st, dtype)
                self._region_list = sorted(self._regions)
            layout = next(lay for lay in st.layouts if lay.name == name)
            by_region.setdefault(st.index, []).append((layout.offset, name, p))
        for r, members in by_region.items():
            self._add_region_segments(group, self._regions[r], sorted(members, key=lambda m: m[0]))

    def _add_plain(self, group: dict[str, Any], p: torch.Tensor) -> None:
        host_fp32 = p.device.type == "cpu" and p.dtype == torch.float32
        dtype = self.moments_dtype if host_fp32 else p.dtype
        m = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        v = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        seg = _Segment(group, (p,), p, m, v)
        self._plain.append(seg)
        self.state[p] = {"step": seg.step, "exp_avg": m, "exp_avg_sq": v}

    def _add_region_segments(
        self,
        group: dict[str, Any],
        rs: _RegionState,
        members: list[tuple[int, str, torch.Tensor]],
    ) -> None:
        st = rs.storage
        runs: list[list[tuple[int, str, torch.Tensor]]] = []
        end = -1
        for offset, name, p in members:
            if runs and offset == end:
                runs[-1].append((offset, name, p))
            else:
                runs.append([(offset, name, p)])
            end = offset + p.numel()
        for run in runs:
            start = run[0][0]
            stop = run[-1][0] + run[-1][2].numel()
            seg = _Segment(
                group,
                tuple(p for _, _, p in run),
                st.master[start:stop],
                rs.exp_avg[start:stop],
                rs.exp_avg_sq[start:stop],
                grad=st.grad[start:stop],
                grad_views=tuple(st.grad_views[name] for _, name, _ in run),
                start=start,
                storage=st,
            )
            rs.segments.append(seg)
            if rs.spare is not None:
                self._attach_spare(rs.spare, seg)
            for offset, _, p in run:
                n = p.numel()
                self.state[p] = {
                    "step": seg.step,
                    "exp_avg": rs.exp_avg[offset : offset + n].view(p.shape),
                    "exp_avg_sq": rs.exp_avg_sq[offset : offset + n].view(p.shape),
                }

    def bind(self, module: OffloadModule) -> None:
        """Step ``module``'s masters through its controller (required to step regions)."""
        if self._controller is not None:
            if self._controller is module.controller:
                return
            raise ValueError("HybridAdam is already bound to another OffloadModule")
        masters = {
            id(view): (st, name) for st in module.storages for name, view in st.master_views.items()
        }
        if self._laid_out and self._regions:
            raise ValueError("HybridAdam laid its parameters out before bind(); bind it first")
        if self._laid_out:
            # Laid out unbound (plain tensors only): a master among them would be stepped as
            # a plain tensor, bypassing the runtime.
            for seg in self._plain:
                if id(seg.param) in masters:
                    raise ValueError(
                        "HybridAdam treated master weights of the module as plain tensors; "
                        "pass module=... when building it"
                    )
        if self.fp16_io:
            host = [st for st in module.storages if st.host_state]
            if any(st.dtype != torch.float16 for st in host) or module.controller.convert_on_device:
                raise ValueError(
                    "fp16_io=True steps fp16 gradients converted on the host: build the "
                    "module in float16 with convert_on_device=False, or drop fp16_io"
                )
        self._masters = masters
        self._controller = module.controller
        self._planned_streaming = module.plan.streamed
        if module.plan.streamed is not None:
            up, down = streamed.stream_copy_bytes(self.moments_dtype, self.fp16_io)
            planned = (
                module.plan.streamed.up_bytes_per_param,
                module.plan.streamed.down_bytes_per_param,
            )
            if planned != (up, down):
                warnings.warn(
                    f"the plan streams regions at {planned[0]:g} bytes up and {planned[1]:g} "
                    f"down per parameter, but this optimizer moves {up} and {down} "
                    f"(moments_dtype={self.moments_dtype}, fp16_io={self.fp16_io}); plan "
                    "with memory_optimize(streamed=streamed_step_costs(moments_dtype, "
                    "fp16_io)) of the optimizer you build, or the prediction will not hold",
                    RuntimeWarning,
                    stacklevel=2,
                )
            if bool(module.plan.streamed.staged_chunks) != self.stage_in_backward:
                planned_staging = (
                    "stages" if module.plan.streamed.staged_chunks else "does not stage"
                )
                warnings.warn(
                    f"the plan {planned_staging} streamed state in the backward, but this "
                    f"optimizer has stage_in_backward={self.stage_in_backward}; plan with "
                    "memory_optimize(streamed=streamed_step_costs(..., stage_in_backward=...)) "
                    "as the optimizer you build, or the prediction (the ring's memory in the "
                    "backward included) will not hold",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if self.fp16_io:
            module.controller.keep_staged_grads = True
        self._ensure_laid_out()

    # ---- introspection used by AMPOptimizer ----------------------------------------

    @property
    def region_indices(self) -> list[int]:
        """Regions that hold parameters of this optimizer, in forward order."""
        self._ensure_laid_out()
        return list(self._region_list)

    def has_region(self, r: int) -> bool:
        """Whether region ``r`` holds parameters of this optimizer (cheap: called per hook)."""
        self._ensure_laid_out()
        return r in self._regions

    def hypers(self) -> dict[int, AdamHyper]:
        """Each parameter group's hyperparameters now, by ``id(group)``.

        A step queued on the host worker takes this snapshot along, so that a scheduler
        changing ``lr`` on this thread afterwards does not reach a step already decided.
        """
        return {id(group): AdamHyper.of_group(group) for group in self.param_groups}

    def region_storage(self, r: int) -> RegionStorage:
        return self._regions[r].storage

    def region_grad(self, r: int) -> torch.Tensor:
        """Region ``r``'s flat fp32 gradient accumulator (a gradient kept in the staging
        buffer for an fp16-I/O step is widened into it first)."""
        storage = self._regions[r].storage
        with torch.no_grad():
            storage.materialize_grad()
        return storage.grad

    def plain_grads(self) -> Iterator[torch.Tensor]:
        """Gradients of the plain (non-region) parameters that have one."""
        self._ensure_laid_out()
        for seg in self._plain:
            g = seg.param.grad
            if g is not None:
                yield g

    # ---- stepping ------------------------------------------------------------------

    def _segment_has_grad(self, seg: _Segment) -> bool:
        """Whether a region segment's gradients are present (all of them, or none).

        A gradient assigned by hand to a master view is copied into the accumulator, since
        the step reads the flat buffer.
        """
        grads = [view.grad for view in seg.views]
        if all(g is e for g, e in zip(grads, seg.grad_views, strict=True)):
            return True  # the usual case, checked cheaply: it runs for every region and step
        present = 0
        for view, expected in zip(seg.views, seg.grad_views, strict=True):
            g = view.grad
            if g is None:
                continue
            present += 1
            if g is not expected:
                if seg.storage is not None:
                    with torch.no_grad():
                        seg.storage.materialize_grad()  # the others' part may be staged
                with torch.no_grad():
                    expected.copy_(g)
                view.grad = expected
        if present and present != len(seg.views):
            raise RuntimeError(
                f"{len(seg.views) - present} of {len(seg.views)} parameters stepped together "
                "in one region have no gradient (.grad is None) while the others have one; "
                "HybridAdam steps a region's parameters as one tensor: zero their gradients "
                "(zero_grad(set_to_none=False)) instead of setting some to None"
            )
        return present > 0

    def _run(
        self,
        segments: list[_Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None = None,
        io: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """One fused launch per (group, device) over ``segments`` (steps counted here).

        ``hypers``: a :meth:`hypers` snapshot to step with; default: the groups' values now.
        ``io``: (fp16 gradients, fp16 upload copy) of the one host-state region that
        ``segments`` cover (see :meth:`_staged_io`): the fp16-I/O kernel steps them.
        """
        buckets: dict[tuple[int, torch.device], list[_Segment]] = {}
        for seg in segments:
            buckets.setdefault((id(seg.group), seg.param.device), []).append(seg)
        for (group_id, device), segs in buckets.items():
            hyper = AdamHyper.of_group(segs[0].group) if hypers is None else hypers[group_id]
            grads = [seg.grad if seg.grad is not None else seg.param.grad for seg in segs]
            for g in grads:
                if g is None or g.is_sparse:
                    raise RuntimeError("HybridAdam: a parameter has no dense gradient")
            steps = [seg.step for seg in segs]
            torch._foreach_add_(steps, 1.0)
            scale = scale_tensor(grad_scale, device)
            pairs = list(zip(segs, cast(list[torch.Tensor], grads), strict=True))
            if self._single_pass(device):
                # Region segments are flat; a plain tensor that is not contiguous (it never
                # steps speculatively) takes torch's kernel.
                fused = []
                for seg, g in pairs:
                    if io is not None:
                        stop = seg.start + seg.param.numel()
                        single_pass.adam_fp16_io_(
                            seg.param,
                            io[0][seg.start : stop],
                            seg.exp_avg,
                            seg.exp_avg_sq,
                            io[1][seg.start : stop],
                            seg.step,
                            hyper,
                            scale,
                        )
                    elif all(
                        t.is_contiguous() for t in (seg.param, g, seg.exp_avg, seg.exp_avg_sq)
                    ):
                        single_pass.adam_(
                            seg.param, g, seg.exp_avg, seg.exp_avg_sq, seg.step, hyper, scale
                        )
                    else:
                        fused.append((seg, g))
                pairs = fused
            fused_adam_(  # returns at once when nothing is left
                [seg.param for seg, _ in pairs],
                [g for _, g in pairs],
                [seg.exp_avg for seg, _ in pairs],
                [seg.exp_avg_sq for seg, _ in pairs],
                [seg.step for seg, _ in pairs],
                hyper,
                scale,
            )

    def _single_pass(self, device: torch.device) -> bool:
        return self.host_kernel == "single_pass" and device.type == "cpu"

    def _segments_with_grad(self, r: int) -> list[_Segment]:
        return [seg for seg in self._regions[r].segments if self._segment_has_grad(seg)]

    def _staged_io(
        self, rs: _RegionState, segments: list[_Segment]
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(fp16 gradients, fp16 upload copy) when region ``rs`` steps by fp16 I/O now.

        That is when its gradient is still in the staging buffer (see [Note: fp16 I/O
        steps]) and ``segments`` cover the whole region: a resident region's upload copy
        is the staging buffer itself, which must then hold every parameter's new value.
        Otherwise a staged gradient is widened here, for the fp32 kernels. Host worker or
        main thread, as the step that calls it.
        """
        st = rs.storage
        if not st.grad_in_staging or st.grad_stale:
            return None
        covered = sum(seg.param.numel() for seg in segments) == st.numel
        if not (self.fp16_io and covered and self._single_pass(st.master.device)):
            with torch.no_grad():
                st.materialize_grad()
            return None
        return st.staging(), st.upload_copy()

    def _step_segments(
        self,
        r: int,
        segments: list[_Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
    ) -> None:
        """Step ``segments`` of region ``r`` (not publishing it), by fp16 I/O when the
        gradient waits in the staging buffer (see :meth:`_staged_io`)."""
        rs = self._regions[r]
        assert not rs.storage.streamed, "streamed regions are issued (issue_region)"
        io = self._staged_io(rs, segments) if rs.storage.host_state else None
        self._run(segments, grad_scale, hypers, io)
        if io is not None:
            self._consumed(rs.storage)

    def _stream_ring(self) -> StreamRing:
        """A ring to stream host-state regions through the device (see streamed.py), on
        this optimizer's ring streams (made at the first ring, reused by every later one,
        so that each ring reuses the last one's freed memory)."""
        device = self._require_controller().streams.device
        if self._ring_streams is None:
            self._ring_streams = streamed.ring_streams(device)
        chunk, slots = streamed.ring_shape(
            self._planned_streaming, self.moments_dtype, self.fp16_io
        )
        return StreamRing(
            device,
            self.moments_dtype,
            self.fp16_io,
            chunk_numel=chunk,
            slots=slots,
            streams=self._ring_streams,
            timed=True,
        )

    def _issue_streamed(
        self,
        ring: StreamRing,
        r: int,
        segments: list[_Segment],
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
        ring] in streamed.py, ``between()`` running while a paced issue waits for a
        slot."""
        rs = self._regions[r]
        st = rs.storage
        io = self._staged_io(rs, segments)
        write = self.writes_on_device(r)
        pieces = []
        for seg in segments:
            hyper = _hyper_of(seg, hypers)
            seg.step.add_(1.0)  # as _run counts it
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
            self._consumed(st, upload_copy_written=not write)
        return landed, ring.written() if write else None

    def writes_on_device(self, r: int) -> bool:
        """Whether streamed region ``r``'s device step writes its parameters in place on
        the device ([Note: writing resident parameters] in streamed.py): a resident region,
        with a plan whose streaming costs say so (``StreamedStepCosts.
        resident_down_bytes_per_param``), or ``streamed.WRITE_RESIDENT`` without costs."""
        st = self._regions[r].storage
        if not st.streamed or st.offloaded:
            return False
        costs = self._planned_streaming
        if costs is None:
            return streamed.WRITE_RESIDENT
        return costs.resident_down_bytes_per_param is not None

    @staticmethod
    def _consumed(st: RegionStorage, upload_copy_written: bool = True) -> None:
        """After an fp16-I/O step of ``st``: its upload copy is written (unless a streamed
        step wrote the device parameters instead). A resident region's gradient is
        logically zero now (overwritten by the upload copy, which is the staging buffer);
        an offloaded one's stays readable in the staging buffer."""
        if upload_copy_written:
            st.upload_copy_fresh = True
        if not st.offloaded:
            st.grad_in_staging = False
            st.grad_stale = True

    @torch.no_grad()
    def step_region(
        self,
        r: int,
        grad_scale: float | None = None,
        *,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
    ) -> bool:
        """Step region ``r``'s parameters and publish its new weights; False if it had none.

        Gradients are divided by ``grad_scale`` first (loss scale over clip coefficient).
        ``hypers``: a :meth:`hypers` snapshot (default: the groups' values now); ``timings``:
        where to record the step (default :attr:`timings`). Usable from a grad-ready hook:
        call it on the host worker for a host-state region, on the main thread for a
        device-state one (see [Note: region segments]). A streamed region is stepped on
        the device, and this waits for it (a host sync point; see :meth:`issue_region`).
        """
        stepped = self.issue_region(r, grad_scale, hypers=hypers, timings=timings)
        if stepped and self._regions[r].storage.streamed:
            self.publish_streamed(wait=True)
        return stepped

    # ---- speculative steps ---------------------------------------------------------

    @staticmethod
    def _attach_spare(spare: _Spare, seg: _Segment) -> None:
        stop = seg.start + seg.param.numel()
        seg.spare = (spare.exp_avg[seg.start : stop], spare.exp_avg_sq[seg.start : stop])
        views = []
        offset = 0
        for p in seg.views:
            n = p.numel()
            m, v = seg.spare
            views.append(
                (m[offset : offset + n].view(p.shape), v[offset : offset + n].view(p.shape))
            )
            offset += n
        seg.spare_views = tuple(views)

    def speculation_bytes(self) -> int:
        """Host bytes of the speculative-step buffers that host-state regions lack: all of
        them before :meth:`prepare_speculation`, those it left out after.

        Per host-state parameter: an fp32 master backup and a second pair of Adam moments,
        12 bytes with fp32 moments, 8 with bf16 moments.
        """
        self._ensure_laid_out()
        return sum(
            rs.spare_bytes
            for rs in self._regions.values()
            if rs.storage.host_state and not rs.storage.streamed and rs.spare is None
        )

    def can_speculate(self, r: int) -> bool:
        """Whether region ``r`` has the buffers of a speculative step (see
        :meth:`prepare_speculation`); a host-state region without them steps after the
        answer instead."""
        self._ensure_laid_out()
        rs = self._regions.get(r)
        return rs is not None and rs.spare is not None

    def speculative_params_that_fit(self) -> int:
        """Host-state parameters whose speculative buffers fit in host memory now: the
        count :meth:`prepare_speculation` would give buffers to without a limit (whole
        regions, from the last in forward order down). Pass it as ``speculative_params``
        to ``memory_optimize`` and :class:`~offload_optim.AMPOptimizer` so that the plan
        assumes the regions that will speculate."""
        self._ensure_laid_out()
        if self._speculation_prepared:
            return sum(rs.storage.numel for rs in self._regions.values() if rs.spare is not None)
        _, picked, _, _ = self._speculation_suffix(None)
        return sum(rs.storage.numel for rs in picked)

    def _speculation_suffix(
        self, max_params: int | None
    ) -> tuple[list[_RegionState], list[_RegionState], bool, int | None]:
        """(host-state regions in landing order, the ones that get buffers, whether host
        memory cut the run short, the host bytes available)."""
        if max_params is not None and (isinstance(max_params, bool) or max_params < 0):
            raise ValueError(f"max_params must be None or >= 0 parameters, got {max_params}")
        order = sorted(
            (
                rs
                for rs in self._regions.values()
                if rs.storage.host_state and not rs.storage.streamed
            ),
            key=lambda rs: -rs.storage.index,
        )
        available = _available_host_bytes()
        allowance = None if available is None else int(available * SPECULATION_HOST_SHARE)
        picked: list[_RegionState] = []
        params = nbytes = 0
        short = False
        for rs in order:
            if max_params is not None and params + rs.storage.numel > max_params:
                break
            if allowance is not None and nbytes + rs.spare_bytes > allowance:
                short = True
                break
            picked.append(rs)
            params += rs.storage.numel
            nbytes += rs.spare_bytes
        return order, picked, short, available

    def prepare_speculation(self, max_params: int | None = None) -> None:
        """Allocate the buffers of speculative steps (once; later calls do nothing).

        Host-state regions get them in the order their gradients land in backward (the
        last region in forward order first), as long as the total stays within
        ``max_params`` parameters (None: no limit) and within
        ``SPECULATION_HOST_SHARE`` of the host memory available now. The first region
        that does not fit ends the run, so the regions that may speculate are the same
        suffix the planner assumes (``solve(speculative_params=)``). The others step after
        the answer, as without speculation. A warning names what host memory left out.
        Main thread.
        """
        self._ensure_laid_out()
        if self._speculation_prepared:
            return
        order, picked, short, available = self._speculation_suffix(max_params)
        self._speculation_prepared = True
        for i, rs in enumerate(picked):
            try:
                rs.spare = _Spare(rs.storage.numel, rs.exp_avg.dtype)
            except RuntimeError:  # the allocator's "can't allocate memory": keep the rest
                short = True
                picked = picked[:i]
                break
            for seg in rs.segments:
                self._attach_spare(rs.spare, seg)
        if short:
            total = sum(rs.storage.numel for rs in order)
            got = sum(rs.storage.numel for rs in picked)
            need = sum(rs.spare_bytes for rs in order)
            have = "unknown" if available is None else f"{available / 2**30:.2f} GiB"
            warnings.warn(
                f"speculative fp16 steps need {need / 2**30:.2f} GiB ({need} bytes) of host "
                "memory for all host-state regions (per parameter an fp32 master backup "
                "and a second pair of Adam moments: 12 bytes, 8 with bf16 moments); with "
                f"{have} available, {len(picked)} of {len(order)} regions ({got} of {total} "
                "parameters) may step under backward and the others step after it. Plan "
                "with solve(speculative_params=...) to predict that, or free host memory",
                RuntimeWarning,
                stacklevel=2,
            )

    @property
    def speculated_regions(self) -> frozenset[int]:
        """Regions stepped speculatively and neither committed nor undone yet."""
        return frozenset(self._speculated)

    @torch.no_grad()
    def speculate_region(
        self,
        r: int,
        grad_scale: float | None = None,
        *,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
    ) -> torch.Tensor | None:
        """Step host-state region ``r`` so that the step can be undone exactly.

        The step's values are those of :meth:`step_region` (same kernel, hyperparameters
        and step count), but it keeps a backup of the master and writes the new moments to
        the spare buffers (see [Note: speculative steps]). The new weights are not
        published: :meth:`commit_speculation` then ``submit_host_steps(...,
        stepped=...)`` do that, or :meth:`undo_speculation` restores the region.
        Host worker (a grad-ready hook); :meth:`prepare_speculation` must have run.

        Returns the region's overflow partial: the sum of its whole gradient before the
        step (0-dim fp32, finite exactly when every element is; see
        ``kernels.speculative_adam_``), or None when the region had no gradients (nothing
        stepped).
        """
        self._check_speculative(r)
        segments = self._segments_with_grad(r)
        if not segments:
            return None
        return self._speculate(r, segments, grad_scale, hypers, timings)

    def _check_speculative(self, r: int) -> None:
        """Raise unless region ``r`` may step speculatively now."""
        self._ensure_laid_out()
        rs = self._regions[r]
        if not rs.storage.host_state or rs.storage.streamed:
            raise ValueError(
                f"speculate_region got region {r}, whose step runs on the device "
                "(device state or streamed): only host-stepped regions speculate"
            )
        if rs.spare is None:
            raise RuntimeError(
                f"region {r} has no buffers for a speculative step: call prepare_speculation()"
            )
        if r in self._speculated:
            raise RuntimeError(
                f"region {r} was already stepped speculatively in this window; "
                "commit_speculation() or undo_speculation() first"
            )

    def submit_speculation(
        self,
        r: int,
        grad_scale: float | None,
        *,
        hypers: dict[int, AdamHyper],
        timings: list[RegionStepTiming],
        stop: Callable[[], bool] | None = None,
        stepped: Callable[[int, torch.Tensor], None] | None = None,
    ) -> None:
        """Host worker (a grad-ready hook): step host-state region ``r`` speculatively, as
        :meth:`speculate_region` does, now or, with ``speculation_thread``, on that thread
        in submission order. ``stepped(r, partial)`` is called after the step (where it
        ran; not when ``r`` had no gradients). On the thread the step is skipped when
        ``stop()`` is true by the time it would start (backward is over: the region steps
        after the answer instead). Which segments step is fixed here, so the
        thread reads no ``.grad``: ``zero_grad`` may drop them meanwhile. Wait with
        :meth:`wait_speculation` before committing or undoing."""
        self._check_speculative(r)
        segments = self._segments_with_grad(r)
        if not segments:
            return

        def run() -> None:
            if stop is not None and self.speculation_thread and stop():
                return
            with torch.profiler.record_function(f"speculative step {r}"):
                part = self._speculate(r, segments, grad_scale, hypers, timings)
            if stepped is not None:
                stepped(r, part)

        if not self.speculation_thread:
            run()
            return
        if self._speculator is None:
            self._speculator = ThreadPoolExecutor(1, thread_name_prefix="offload-speculate")
        self._speculating.append(self._speculator.submit(run))

    def wait_speculation(self, between: Callable[[], None] | None = None) -> None:
        """Block until every speculative step submitted so far has finished (a host sync
        point while one runs) and re-raise the first error; nothing to wait for without
        ``speculation_thread``. ``between`` runs about every millisecond while waiting
        (the host worker publishes streamed regions that landed). Call it once the hooks
        that submit them have run: after ``controller.wait_gradients()``, or on the host
        worker behind them."""
        pending, self._speculating = self._speculating, []
        error: BaseException | None = None
        for fut in pending:
            if between is not None:
                _wait_calling(fut, between, 0.001)
            exc = fut.exception()  # waits; re-raised below, after the rest finish
            if exc is not None and error is None:
                error = exc
        if error is not None:
            raise error

    @torch.no_grad()
    def _speculate(
        self,
        r: int,
        segments: list[_Segment],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        timings: list[RegionStepTiming] | None,
    ) -> torch.Tensor:
        """:meth:`speculate_region`'s step of ``segments`` (those with gradients, found
        by the caller: this reads no ``.grad``)."""
        rs = self._regions[r]
        spare = rs.spare
        assert spare is not None, "checked by _check_speculative"
        start = time.perf_counter()
        # The gradient check must see the whole region, as the non-speculative check does:
        # when segments without gradients leave parts of it out, read it all first.
        io = self._staged_io(rs, segments)  # widens a staged gradient it does not step
        covered = sum(seg.param.numel() for seg in segments) == rs.storage.numel
        whole = None if covered else rs.storage.grad.sum()
        scale = scale_tensor(grad_scale, torch.device("cpu"))
        parts = []
        for seg in segments:
            assert seg.grad is not None and seg.spare is not None
            hyper = _hyper_of(seg, hypers)
            before = float(seg.step)
            seg.step.add_(1.0)  # as _run counts it
            stop = seg.start + seg.param.numel()
            kernel: Callable[..., torch.Tensor] = (
                single_pass.speculative_adam_fp16_io_
                if io is not None
                else single_pass.speculative_adam_
                if self._single_pass(seg.param.device)
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
            self._consumed(rs.storage)
        self._speculated.add(r)
        sink = self.timings if timings is None else timings
        sink.append(RegionStepTiming(r, start, time.perf_counter(), host=True))
        return whole if whole is not None else torch.stack(parts).sum()

    def commit_speculation(self) -> list[int]:
        """Make the speculative steps final; returns their regions, in forward order.

        The next moments become the moments by a swap of references (segments and
        ``state`` entries), no copy; the masters are stepped already. Publishing the new
        weights is left to the caller. The host task of ``submit_host_steps(...,
        commit=[])`` calls it, after :meth:`wait_speculation`; or any thread once the
        speculative steps are done.
        """
        done = sorted(self._speculated)
        for r in done:
            spare = self._regions[r].spare
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
                    entry = self.state[p]
                    old.append((entry["exp_avg"], entry["exp_avg_sq"]))
                    entry["exp_avg"], entry["exp_avg_sq"] = m, v
                seg.spare_views = tuple(old)
            spare.pending.clear()
        self._speculated.clear()
        return done

    @torch.no_grad()
    def undo_speculation(self) -> list[int]:
        """Undo the speculative steps exactly; returns their regions, in forward order.

        Restores each stepped segment's master from its backup and its step count; the
        moments were never written (the step wrote the spare ones). Main thread, once the
        host worker has finished the speculative steps; nothing was published, so nothing
        else changes.
        """
        done = sorted(self._speculated)
        for r in done:
            st = self._regions[r].storage
            spare = self._regions[r].spare
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
        self._speculated.clear()
        return done

    def _refuse_speculated(self, what: str) -> None:
        if self._speculated:
            raise RuntimeError(
                f"{what} while regions {sorted(self._speculated)} hold an uncommitted "
                "speculative step; finish the window first (AMPOptimizer.step() or zero_grad())"
            )

    @torch.no_grad()
    def step_device_regions(
        self,
        regions: Iterable[int],
        grad_scale: float | None = None,
        *,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
    ) -> list[int]:
        """Step device-state ``regions`` together; returns those that had gradients.

        One fused launch per (group, device) for all of them and one batched publish,
        instead of a few launches per region: with many small regions, per-region launches
        made the step CPU-bound. Main thread only. Each region's recorded timing spans the
        whole batch.
        """
        self._ensure_laid_out()
        controller = self._require_controller()
        start = time.perf_counter()
        stepped: list[int] = []
        segments: list[_Segment] = []
        for r in regions:
            rs = self._regions[r]
            if rs.storage.host_state:
                raise ValueError(
                    f"step_device_regions got host-state region {r}; step it with "
                    "step_region on the host worker"
                )
            segs = self._segments_with_grad(r)
            if segs:
                stepped.append(r)
                segments.extend(segs)
        if not segments:
            return []
        self._run(segments, grad_scale, hypers)
        controller.publish_many(stepped)
        end = time.perf_counter()
        sink = self.timings if timings is None else timings
        sink.extend(RegionStepTiming(r, start, end, host=False) for r in stepped)
        return stepped

    def submit_host_steps(
        self,
        regions: Iterable[int],
        grad_scale: float | None = None,
        *,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
        commit: list[int] | None = None,
    ) -> dict[int, Future[None]]:
        """Queue host-state ``regions``' steps on the host worker, in the given order.

        Returns at once: one future per region that has gradients, completed once the
        region is stepped and published (the runtime makes the region's next forward wait
        for it: ``OffloadController.expect_updates``). What a queued step uses is fixed
        here, on the calling thread: which segments have gradients (a later ``zero_grad``
        may drop the ``.grad`` references before the worker gets there; the step reads the
        flat accumulators, which stay) and the hyperparameters (``hypers``, default a
        snapshot now: a scheduler may change ``lr`` before the worker gets there). One
        task steps the regions one after another, so their publishes come in that order.
        ``commit``: the task first issues its streamed regions, then waits for the
        speculative steps (:meth:`wait_speculation`, publishing landed streamed regions
        meanwhile), commits them (:meth:`commit_speculation`) and appends their regions to
        this list; those, which must be among ``regions``, are then only published, in
        their place in the order.
        """
        self._ensure_laid_out()
        controller = self._require_controller()
        jobs: list[tuple[int, list[_Segment]]] = []
        for r in regions:
            if not self._regions[r].storage.host_state:
                raise ValueError(
                    f"submit_host_steps got device-state region {r}; step it with "
                    "step_device_regions on the main thread"
                )
            if commit is None and r in self._speculated:
                self._refuse_speculated(f"submit_host_steps of region {r}")
            segs = self._segments_with_grad(r)
            if segs:
                jobs.append((r, segs))
        if not jobs:
            return {}
        snapshot = self.hypers() if hypers is None else hypers
        sink = self.timings if timings is None else timings
        futures = controller.expect_updates(r for r, _ in jobs)
        controller.submit_host(
            partial(
                self._host_steps_task,
                controller,
                jobs,
                grad_scale,
                snapshot,
                futures,
                sink,
                commit,
            )
        )
        return futures

    @torch.no_grad()
    def _host_steps_task(
        self,
        controller: OffloadController,
        jobs: list[tuple[int, list[_Segment]]],
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
        finishes, and at the end; see [Note: streamed steps] and [Note: publishing while
        issuing] in streamed.py)."""
        done: set[int] = set()

        def complete(r: int) -> None:
            futures[r].set_result(None)
            done.add(r)

        def finish(r: int, start: float, end: float) -> None:
            controller.publish(r)
            sink.append(RegionStepTiming(r, start, end, host=True))
            complete(r)

        streamed_jobs = [
            (r, segments) for r, segments in jobs if segments and self._regions[r].storage.streamed
        ]
        streamed_here = {r for r, _ in streamed_jobs}
        issuing: Future[None] | None = None
        try:
            if streamed_jobs:
                ring, queue = self._streaming_session()
                issue = partial(
                    self._issue_jobs,
                    ring,
                    queue,
                    streamed_jobs,
                    grad_scale,
                    hypers,
                    {
                        r: partial(
                            _publish_streamed_step, controller, sink, r, partial(complete, r)
                        )
                        for r, _ in streamed_jobs
                    },
                    # A region written on the device: its next forward may go on once
                    # the device has done the write ([Note: writing resident parameters]).
                    early={
                        r: partial(controller.ready_early, r, futures[r])
                        for r, _ in streamed_jobs
                        if self.writes_on_device(r)
                    },
                )
                # The issuing thread paces the ring and publishes what has landed, so that
                # this thread starts its host steps at once ([Note: streamed steps] in
                # streamed.py).
                issuing = self._issue_elsewhere(partial(issue, issuer=True))
            if commit is not None:
                # The streamed regions go first; the speculative steps may still run.
                self.wait_speculation(between=self.publish_streamed)
                committed = self.commit_speculation()
                commit.extend(committed)
                unqueued = set(committed).difference(r for r, _ in jobs)
                if unqueued:
                    raise RuntimeError(
                        f"regions {sorted(unqueued)} were committed but not queued to be "
                        "published: a bug in the caller"
                    )
                jobs = [(r, [] if r in committed else segments) for r, segments in jobs]
            for r, segments in jobs:
                if r in streamed_here:
                    continue
                # Named in a torch.profiler trace, beside the streams it feeds.
                with torch.profiler.record_function(f"host step {r}"):
                    start = time.perf_counter()
                    if segments:
                        self._step_segments(r, segments, grad_scale, hypers)
                    finish(r, start, time.perf_counter())
                if issuing is not None and issuing.done():
                    pending, issuing = issuing, None
                    self._finish_issuing(pending)  # the ring may close now
                # Frees the ring as soon as every streamed region landed, not after the
                # host steps still to come (see publish_streamed).
                self.publish_streamed()
            if issuing is not None:
                # The host steps are done while the issuing thread still issues: publish
                # each streamed region as it lands until it is done, instead of blocking
                # on it first ([Note: publishing while issuing] in streamed.py).
                _wait_calling(issuing, self.publish_streamed, streamed.PUBLISH_POLL_S)
                pending, issuing = issuing, None
                self._finish_issuing(pending)
            self.publish_streamed(wait=True)
        except BaseException as exc:
            # Every announced future must complete, or the region's next use would wait
            # forever: the error reaches whoever waits for any of them. The ring goes too
            # (after its last download, and after the issuing thread let it go), with what
            # it still had to publish: those regions' futures fail here, or (a hook's) in
            # the window's last task.
            if issuing is not None:
                with contextlib.suppress(BaseException):
                    self._finish_issuing(issuing)
            self._drop_streaming()
            for r, _ in jobs:
                if r not in done:
                    futures[r].set_exception(exc)
            raise

    def _issue_jobs(
        self,
        ring: StreamRing,
        queue: StreamedQueue,
        jobs: list[tuple[int, list[_Segment]]],
        grad_scale: float | None,
        hypers: dict[int, AdamHyper] | None,
        publish: dict[int, Callable[..., None]],
        early: dict[int, Callable[[Event], None]] | None = None,
        issuer: bool = False,
    ) -> None:
        """Issue each streamed job's device step on ``ring`` and queue it on ``queue``, in
        order (the issuing thread for step()'s task, with ``issuer``; the host worker for
        a hook's :meth:`issue_region`); ``publish[r](start_s, end_s, issue_s=,
        paced_wait_s=, written=)`` publishes region ``r`` once landed. ``early[r](event)``
        is called as soon as region ``r`` is issued when its step writes its device
        parameters, with the event after that write. ``issuer``: pace the ring ([Note:
        paced ring] in streamed.py) and publish what has landed while waiting for slots
        and after each region, then every region as it lands until none is left ([Note:
        the issuing thread publishes])."""
        between = partial(queue.publish_landed, block=False, casting=False) if issuer else None
        with torch.no_grad():  # grad mode is per thread
            for r, segments in jobs:
                with torch.profiler.record_function(f"streamed step {r} (issue)"):
                    start = time.perf_counter()
                    waited = ring.paced_wait_s
                    landed, written = self._issue_streamed(
                        ring, r, segments, grad_scale, hypers, issuer, between
                    )
                    waited = ring.paced_wait_s - waited
                    issued = time.perf_counter() - start - waited
                    ups = ring.take_up_copies()
                if written is not None and early is not None and r in early:
                    early[r](written)
                # Its publish casts the new master on the host unless the ring wrote the
                # device parameters or (fp16 I/O) the upload copy.
                casts = written is None and self._require_controller().publish_casts(r)
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
                queue.publish_until_empty(streamed.PUBLISH_POLL_S)

    @torch.no_grad()
    def stage_streamed_state(self) -> None:
        """Host worker, in a streamed region's gradient hook in the backward before a
        step: with ``stage_in_backward``, open the ring and issue the copies up of the
        master weights and moments (not the gradients) of the streamed regions' leading
        chunks, in forward order, as far as the ring's slots go ([Note: staging the state
        in backward] in streamed.py). Nothing when a ring is open (the last step's, not
        yet closed, or this backward's): its slots are in use."""
        if not self.stage_in_backward:
            return
        self._ensure_laid_out()
        if self._streaming is not None:
            return
        ring, _ = self._streaming_session()
        with torch.profiler.record_function("stage streamed state"):
            for r in self._region_list:
                if not self._regions[r].storage.streamed:
                    continue
                for seg in self._regions[r].segments:
                    if not ring.stage(seg.param, seg.exp_avg, seg.exp_avg_sq):
                        return

    def drop_staged(self) -> None:
        """Main thread, for a step that was skipped (or failed) after a backward that may
        have staged (:meth:`stage_streamed_state`): close the ring on the host worker
        (after the staged copies up), nothing issued on it, if one is open."""
        self._require_controller().submit_host(partial(self.publish_streamed, wait=True))

    def _issue_elsewhere(self, issue: Callable[[], None]) -> Future[None]:
        """Host worker: run ``issue`` on the issuing thread; the ring stays open until
        :meth:`_finish_issuing`."""
        if self._issuer is None:
            self._issuer = ThreadPoolExecutor(1, thread_name_prefix="offload-stream-issue")
        self._issuing += 1
        try:
            return self._issuer.submit(issue)
        except BaseException:
            self._issuing -= 1
            raise

    def _finish_issuing(self, issuing: Future[None]) -> None:
        """Host worker: wait for an issuing task (raising its error); the ring may close
        again once its regions are published."""
        try:
            issuing.result()
        finally:
            self._issuing -= 1

    def _streaming_session(self) -> tuple[StreamRing, StreamedQueue]:
        """Host worker: the ring and queue that streamed regions are issued to, made (on
        this optimizer's ring streams) when none is open."""
        if self._streaming is None:
            self._streaming = (self._stream_ring(), StreamedQueue())
        return self._streaming

    def publish_streamed(self, wait: bool = False) -> None:
        """Host worker: publish each streamed region whose downloads have landed (in
        issue order; with ``wait``, all of them, blocking: a host sync point), and free
        the ring once none is left to publish.

        The ring is freed as soon as the last streamed region is published, not at the
        end of the task: the planner counts it until the last download, and a ring held
        into the next forward would add its bytes to that forward's peak. A ring that
        holds staged chunks and nothing else stays open unless ``wait``: a host-state
        region stepped in its hook calls this after the backward staged them ([Note:
        staging the state in backward] in streamed.py)."""
        if self._streaming is None:
            return
        ring, queue = self._streaming
        try:
            queue.publish_landed(wait)
        except BaseException:
            self._drop_streaming()  # what is left is not published; its futures fail
            raise
        if not queue.regions() and not self._issuing and (wait or not ring.staged()):
            self._close_streaming()  # every download has landed: no wait

    def _drop_streaming(self) -> None:
        """Host worker, after an error: free the ring after its last download, leaving
        what it had still to publish unpublished (their futures fail elsewhere)."""
        if self._streaming is not None:
            self._close_streaming()

    def _close_streaming(self) -> None:
        """Host worker: close the open ring (after its last download and staged upload)
        and count the chunks it stepped from staged slots."""
        assert self._streaming is not None
        ring, _ = self._streaming
        self._streaming = None
        ring.close()
        self.staged_chunks += ring.staged_used

    @torch.no_grad()
    def issue_region(
        self,
        r: int,
        grad_scale: float | None = None,
        *,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
        published: Callable[[], None] | None = None,
    ) -> bool:
        """:meth:`step_region`, except that a streamed region's device step is only
        issued (on the host worker): it is published, timed and ``published()`` called
        once its downloads land, in this or a later :meth:`publish_streamed` call (the
        caller makes one with ``wait=True`` before it relies on the step). Any other
        region steps, publishes and calls ``published()`` here, and on the host worker
        streamed regions issued earlier that have landed are published too. False if
        ``r`` had nothing to step (``published()`` is called all the same).

        This is how the hook of a region whose gradients land after the step's answer
        steps it (``OverlapMode.DEVICE_ANSWER``): a streamed region's copies and device
        step then run while the host worker goes on to the next hook, as the planner
        models it, instead of blocking it (the up and down copies take longer than the
        host step of the same region would)."""
        done = published if published is not None else _nothing
        self._ensure_laid_out()
        rs = self._regions.get(r)
        if rs is None:
            done()
            return False
        if r in self._speculated:
            self._refuse_speculated(f"step_region({r})")
        controller = self._require_controller()
        start = time.perf_counter()
        segments = self._segments_with_grad(r)
        if not segments:
            done()
            return False
        st = rs.storage
        sink = self.timings if timings is None else timings
        if not st.streamed:
            self._step_segments(r, segments, grad_scale, hypers)
            controller.publish(r)
            sink.append(RegionStepTiming(r, start, time.perf_counter(), host=st.host_state))
            done()
            if st.host_state:  # on the host worker, where streamed regions are issued
                self.publish_streamed()
            return True

        publish = partial(_publish_streamed_step, controller, sink, r, done)
        ring, queue = self._streaming_session()
        try:
            self._issue_jobs(ring, queue, [(r, segments)], grad_scale, hypers, {r: publish})
        except BaseException:
            self._drop_streaming()
            raise
        self.publish_streamed()
        return True

    @torch.no_grad()
    def step_plain(
        self, grad_scale: float | None = None, *, hypers: dict[int, AdamHyper] | None = None
    ) -> None:
        """Step the plain (non-region) parameters that have gradients."""
        self._ensure_laid_out()
        segments = [seg for seg in self._plain if seg.param.grad is not None]
        if segments:
            self._run(segments, grad_scale, hypers)

    def step_regions(
        self,
        regions: Iterable[int] | None = None,
        grad_scale: float | None = None,
        *,
        plain: bool = True,
        wait: bool = True,
        hypers: dict[int, AdamHyper] | None = None,
        timings: list[RegionStepTiming] | None = None,
        commit: list[int] | None = None,
    ) -> dict[int, Future[None]]:
        """Step ``regions`` (default: all) and, if ``plain``, the plain parameters.

        Host-state regions are queued on the host worker in forward order
        (:meth:`submit_host_steps`) and run while this thread steps the device-state
        regions (all in one batch). With ``wait`` this returns when all are done (a host
        sync point); otherwise at once, with the host regions' futures. ``hypers``: a
        :meth:`hypers` snapshot for every region (default: now). ``commit``: commit the
        speculative steps on the host worker first and only publish those (see
        :meth:`submit_host_steps`).
        """
        self._ensure_laid_out()
        chosen = self._region_list if regions is None else sorted(regions)
        chosen = [r for r in chosen if r in self._regions]
        snapshot = self.hypers() if hypers is None else hypers
        host = [r for r in chosen if self._regions[r].storage.host_state]
        device = [r for r in chosen if not self._regions[r].storage.host_state]
        futures: dict[int, Future[None]] = {}
        if host:
            futures = self.submit_host_steps(
                host, grad_scale, hypers=snapshot, timings=timings, commit=commit
            )
        if device:
            self.step_device_regions(device, grad_scale, hypers=snapshot, timings=timings)
        if plain:
            self.step_plain(grad_scale, hypers=snapshot)
        if wait and self._controller is not None:
            self._controller.wait_host()
        return futures

    @overload
    def step(self, closure: None = None) -> None: ...

    @overload
    def step(self, closure: Callable[[], float]) -> float: ...

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Step every parameter that has a gradient and wait; returns ``closure()`` if given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.timings.clear()  # keep the last step's only
        self.step_regions()
        return loss

    def _require_controller(self) -> OffloadController:
        if self._controller is None:
            raise RuntimeError(
                "HybridAdam steps OffloadModule master weights only when bound to the module: "
                "pass module=... to HybridAdam, call optimizer.bind(module), or wrap the "
                "optimizer in AMPOptimizer(optimizer, module)"
            )
        return self._controller

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``torch.optim.Optimizer.zero_grad``, without waiting for queued steps.

        Waits only for host gradient work still running (it reads the ``.grad``
        references). Optimizer steps queued on the host worker read the flat accumulators,
        not ``.grad``: with ``set_to_none`` only the references are dropped, and the
        runtime overwrites each accumulator when the region's next gradients arrive, on the
        host worker after the queued steps. ``set_to_none=False`` zeroes the host-state
        accumulators on the host worker too, after the queued steps, and the others here.
        """
        self._ensure_laid_out()
        if self._controller is not None:
            self._controller.wait_gradients()
        host: list[torch.Tensor] = []
        host_storages: list[RegionStorage] = []
        here: list[torch.Tensor] = []
        with torch.no_grad():
            for rs in self._regions.values():
                for seg in rs.segments:
                    present = False
                    for view, linked in zip(seg.views, seg.grad_views, strict=True):
                        g = view.grad
                        if g is None:
                            continue
                        present = True
                        if set_to_none:
                            view.grad = None
                        elif g is not linked:
                            here.append(g)  # assigned by hand: zero it where it is
                    if present and not set_to_none:
                        assert seg.grad is not None
                        (host if rs.storage.host_state else here).append(seg.grad)
                        if rs.storage.host_state:
                            host_storages.append(rs.storage)
            for seg in self._plain:
                p = seg.param
                if p.grad is None:
                    continue
                if set_to_none:
                    p.grad = None
                else:
                    if p.grad.grad_fn is not None:
                        p.grad.detach_()
                    else:
                        p.grad.requires_grad_(False)
                    here.append(p.grad)
            by_kind: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
            for g in here:
                by_kind.setdefault((g.device, g.dtype), []).append(g)
            for grads in by_kind.values():
                torch._foreach_zero_(grads)
        if host:
            controller = self._require_controller()
            controller.submit_host(partial(_zero_on_host, host, host_storages))

    # ---- checkpoints ---------------------------------------------------------------

    def _ordered_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def synchronize(self) -> None:
        """Wait for the steps queued on the host worker (and the speculative steps on
        their thread); re-raise their first error."""
        if self._controller is not None:
            self._controller.wait_host()
        self.wait_speculation()

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format (``state`` by parameter index, ``param_groups``).

        Moments are copied to CPU tensors in their stored dtype; ``step`` is a 0-dim fp32
        tensor, as ``torch.optim.AdamW(fused=True)`` keeps it, so either can load the other's.
        Refused while a speculative step is uncommitted: it holds committed state only.
        """
        if self._controller is not None:
            self._controller.wait_host()
        self.wait_speculation()
        self._refuse_speculated("state_dict()")
        self._ensure_laid_out()
        groups = []
        index = 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(index, index + len(group["params"])))
            index += len(group["params"])
            groups.append(packed)
        state: dict[int, dict[str, torch.Tensor]] = {}
        for i, p in enumerate(self._ordered_params()):
            entry = self.state.get(p)
            if entry:
                state[i] = {k: v.detach().to("cpu", copy=True) for k, v in entry.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`state_dict` output (or a ``torch.optim.Adam``/``AdamW`` one).

        The parameter groups must have the same sizes in the same order. Parameters stepped
        together in one segment must carry the same step count.
        """
        if self._controller is not None:
            self._controller.wait_host()
        self.wait_speculation()
        self._refuse_speculated("load_state_dict()")
        self._ensure_laid_out()
        saved_groups = state_dict.get("param_groups")
        saved_state = state_dict.get("state")
        if not isinstance(saved_groups, list) or not isinstance(saved_state, dict):
            raise ValueError("optimizer state_dict needs 'state' and 'param_groups' entries")
        sizes = [len(g["params"]) for g in self.param_groups]
        saved_sizes = [len(g["params"]) for g in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(
                f"optimizer state_dict has parameter groups of sizes {saved_sizes}, this "
                f"optimizer {sizes}; build the optimizer over the same parameters"
            )
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for key, value in saved.items():
                if key != "params":
                    group[key] = tuple(value) if key == "betas" else value
        index_of = {}
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            for p, saved_index in zip(group["params"], saved["params"], strict=True):
                index_of[p] = saved_index
        segments = [seg for rs in self._regions.values() for seg in rs.segments] + self._plain
        with torch.no_grad():
            for seg in segments:
                entries = [
                    saved_state.get(index_of[p], saved_state.get(str(index_of[p])))
                    for p in seg.views
                ]
                if all(e is None for e in entries):
                    for p in seg.views:
                        self.state[p]["exp_avg"].zero_()
                        self.state[p]["exp_avg_sq"].zero_()
                    seg.step.zero_()
                    continue
                if any(e is None for e in entries):
                    raise ValueError(
                        "optimizer state_dict has state for some parameters of one region "
                        "segment but not for others; save and load the whole optimizer"
                    )
                steps = {float(cast(dict[str, Any], e)["step"]) for e in entries}
                if len(steps) != 1:
                    raise ValueError(
                        f"parameters stepped together have different step counts {sorted(steps)}"
                        " in the optimizer state_dict; HybridAdam keeps one count per segment"
                    )
                for p, e in zip(seg.views, entries, strict=True):
                    entry = cast(dict[str, torch.Tensor], e)
                    for key in ("exp_avg", "exp_avg_sq"):
                        src = entry[key]
                        dst = self.state[p][key]
                        if tuple(src.shape) != tuple(dst.shape):
                            raise ValueError(
                                f"optimizer state_dict {key} has shape {tuple(src.shape)}, "
                                f"the parameter {tuple(dst.shape)}"
                            )
                        dst.copy_(src)
                step = steps.pop()
                if not math.isfinite(step) or step < 0:
                    raise ValueError(f"optimizer state_dict step count {step} is invalid")
                seg.step.fill_(step)
