"""HybridAdam: Adam(W) that steps an OffloadModule region by region, on host or device.

This file is the ``torch.optim`` face: parameter groups, ``step``, ``zero_grad`` and the
checkpoint format. What it stands on, one job per module:
- layout.py: regions and segments of the optimizer state ([Note: region segments]);
- stepping.py: the kernels that step a list of segments ([Note: fp16 I/O steps]);
- host_steps.py: which thread steps which region, and in which order;
- speculation.py: steps taken before the step's answer, committed or undone exactly
  ([Note: speculative steps]);
- streamed/: host state stepped on the device through a ring ([Note: streamed steps]).
Its threads and the ring's streams belong to the bound module's ``StreamSet`` ([Note:
streams and threads] in offload_runtime/streams.py).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future
from functools import partial
from typing import TYPE_CHECKING, Any, cast, overload

import torch

from offload_optim.host_steps import HostSteps
from offload_optim.layout import MOMENT_DTYPES, Segment, StateLayout
from offload_optim.reports import RegionStepTiming
from offload_optim.speculation import Speculation
from offload_optim.stepping import Stepper
from offload_optim.streamed import StreamedSteps
from offload_runtime.hardware import available_host_memory_bytes
from offload_runtime.host_kernels import AdamHyper, low_precision, single_pass
from offload_runtime.planning.speculation import SPECULATION_HOST_SHARE
from offload_runtime.storage import RegionStorage

if TYPE_CHECKING:
    from offload_runtime.controller import OffloadController
    from offload_runtime.module import OffloadModule

__all__ = ["MOMENT_DTYPES", "SPECULATION_HOST_SHARE", "HybridAdam", "RegionStepTiming"]


@torch.no_grad()
def _zero_on_host(grads: list[torch.Tensor], storages: list[RegionStorage]) -> None:
    torch._foreach_zero_(grads)
    for st in storages:
        st.grad_in_staging = False  # a gradient kept in staging is zeroed too


def _available_host_bytes() -> int | None:
    """Host bytes allocatable now (the runtime's reading of ``MemAvailable`` and the cgroup
    limit); None where nothing could be read."""
    return available_host_memory_bytes() or None


class HybridAdam(torch.optim.Optimizer):
    """Adam(W) over OffloadModule master weights (by region) and ordinary tensors, with
    torch's ``AdamW`` surface.

    Args:
        params: tensors or parameter groups, as for any ``torch.optim`` optimizer; usually
            ``module.parameters()`` of an ``OffloadModule`` (its fp32 master weights).
        lr, betas, eps, weight_decay: Adam's hyperparameters (per group, like torch's).
        adamw_mode: decoupled weight decay (AdamW) when true, L2 regularisation when false.

    Everything else comes from the module the optimizer is bound to (:meth:`bind`, which
    ``AMPOptimizer`` calls), before the state is laid out, so that the optimizer executes
    what the plan priced:

    - from ``module.config`` (``offload_runtime.OffloadConfig``): the dtype of
      host-resident moments (``host_moments``; host-state regions and plain fp32 CPU
      tensors; device-resident moments stay fp32; [Note: bf16 moments] in
      ``offload_runtime/host_kernels/torch_adam.py``);
    - from ``module.plan.options`` (``offload_solver.PlanOptions``): the host kernel
      (torch's fused CPU Adam, or the single-pass numba kernels: [Note: single-pass host
      Adam] in ``offload_runtime/host_kernels/single_pass.py``; both compute torch's Adam
      formula and differ in rounding by about 1e-7 of an update), fp16 I/O (host-state
      regions step straight from the fp16 gradients in pinned staging and write the fp16
      upload copy in the same pass: [Note: fp16 I/O steps] in stepping.py; bit for bit the
      separate passes' values; the fp32 accumulator of such a region is filled only on
      demand, ``module.named_gradients()`` or ``AMPOptimizer.clip_grad_norm``), whether
      speculative steps run on a thread of their own (``speculation_thread``: the host
      worker keeps taking landed gradients meanwhile; BENCHMARKS.md, Decisions, "Threads
      that issue, publish and speculate"), and whether streamed regions' state is staged
      in the backward (``stage_in_backward``: [Note: staging the state in backward] in
      streamed/ring.py; BENCHMARKS.md, Decisions, "Staging streamed state in backward").

    Unbound (plain tensors only): torch's fused kernel, fp32 moments. Device-resident
    state always steps with torch's fused CUDA kernel.

    Streamed regions (see [Note: streamed steps] in streamed/__init__.py) of a step are
    issued from a thread of their own, which paces the ring and publishes the regions whose
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
    ) -> None:
        if not lr >= 0:
            raise ValueError(f"lr={lr} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas} must each lie in [0, 1)")
        if not eps >= 0:
            raise ValueError(f"eps={eps} must be >= 0")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay={weight_decay} must be >= 0")
        # Set before Optimizer.__init__, which calls add_param_group; bind() sets what the
        # module's plan and configuration say, before the state is laid out.
        self._layout = StateLayout(torch.float32)
        self._stepper = Stepper(self._layout, "torch", False)
        self._speculation = Speculation(self._layout, self._stepper, False)
        self._streamed = StreamedSteps(self._layout, self._stepper, False)
        # HostSteps reads the optimizer through a weak reference: a bound method or a
        # closure over self would make a reference cycle, and the optimizer's state (device
        # moments among it) would then wait for the cyclic collector when dropped.
        owner = weakref.ref(self)

        def hypers() -> dict[int, AdamHyper]:
            alive = owner()
            assert alive is not None, "HostSteps outlived its HybridAdam"
            return alive.hypers()

        def state() -> Any:
            alive = owner()
            assert alive is not None, "HostSteps outlived its HybridAdam"
            return alive.state

        self._steps = HostSteps(
            self._layout, self._stepper, self._speculation, self._streamed, hypers, state
        )
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

    # ---- what the bound module's plan and configuration say --------------------------

    @property
    def moments_dtype(self) -> torch.dtype:
        """Dtype of host-resident moments (``module.config.host_moments``; fp32 unbound;
        device-resident ones are fp32)."""
        return self._layout.moments_dtype

    @property
    def host_kernel(self) -> str:
        """``"torch"`` or ``"single_pass"``: the kernels that step host-resident state
        (``module.plan.options.host_kernel``)."""
        return self._stepper.host_kernel

    @property
    def fp16_io(self) -> bool:
        """Whether host-state regions step from their fp16 gradients in staging
        (``module.plan.options.fp16_io``)."""
        return self._stepper.fp16_io

    @property
    def speculation_thread(self) -> bool:
        """Whether submitted speculative steps run on the module's speculation thread
        (``module.plan.options.speculation_thread``)."""
        return self._speculation.use_thread

    @property
    def stage_in_backward(self) -> bool:
        """Whether :meth:`stage_streamed_state` stages anything
        (``module.plan.options.stage_in_backward``)."""
        return self._streamed.stage_in_backward

    @property
    def staged_chunks(self) -> int:
        """Ring chunks stepped from a staged slot so far ([Note: staging the state in
        backward] in streamed/ring.py)."""
        return self._streamed.staged_chunks

    # ---- set-up --------------------------------------------------------------------

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group (torch's checks apply); its region parameters are laid out in segments."""
        super().add_param_group(param_group)
        if self._layout.laid_out:
            self._layout.lay_out_group(self.param_groups[-1], self.state)

    def _ensure_laid_out(self) -> None:
        """Lay every group out in segments (deferred until the module is known)."""
        self._layout.ensure(self.param_groups, self.state)

    def bind(self, module: OffloadModule) -> None:
        """Step ``module``'s masters through its controller (required to step regions),
        with the moments its configuration and the kernels its plan say (see the class
        docstring). ``AMPOptimizer`` calls it; call it yourself to step without one."""
        layout = self._layout
        if layout.controller is not None:
            if layout.controller is module.controller:
                return
            raise ValueError("HybridAdam is already bound to another OffloadModule")
        masters = {
            id(view): (st, name) for st in module.storages for name, view in st.master_views.items()
        }
        if layout.laid_out and layout.regions:
            raise ValueError("HybridAdam laid its parameters out before bind(); bind it first")
        if layout.laid_out:
            # Laid out unbound (plain tensors only): a master among them would be stepped as
            # a plain tensor, bypassing the runtime.
            for seg in layout.plain:
                if id(seg.param) in masters:
                    raise ValueError(
                        "HybridAdam treated master weights of the module as plain tensors; "
                        "bind(module) before the first step"
                    )
        options = module.plan.options
        if options.host_kernel == "single_pass":
            single_pass.require()
        if options.fp16_io:
            single_pass.require_fp16_io()
        if not layout.laid_out:
            layout.moments_dtype = module.config.host_moments
        self._stepper.host_state = module.config.host_state
        self._stepper.host_kernel = options.host_kernel
        self._stepper.fp16_io = options.fp16_io
        self._speculation.use_thread = options.speculation_thread
        self._streamed.stage_in_backward = options.stage_in_backward
        layout.masters = masters
        layout.elsewhere = frozenset() if module.sharding is None else module.sharding.elsewhere
        layout.controller = module.controller
        self._streamed.planned = module.plan.streamed
        self._ensure_laid_out()

    # ---- introspection used by AMPOptimizer ----------------------------------------

    @property
    def region_indices(self) -> list[int]:
        """Regions that hold parameters of this optimizer, in forward order."""
        self._ensure_laid_out()
        return list(self._layout.region_list)

    def has_region(self, r: int) -> bool:
        """Whether region ``r`` holds parameters of this optimizer (cheap: called per hook)."""
        self._ensure_laid_out()
        return r in self._layout.regions

    def hypers(self) -> dict[int, AdamHyper]:
        """Each parameter group's hyperparameters now, by ``id(group)``.

        A step queued on the host worker takes this snapshot along, so that a scheduler
        changing ``lr`` on this thread afterwards does not reach a step already decided.
        """
        return {id(group): AdamHyper.of_group(group) for group in self.param_groups}

    def region_storage(self, r: int) -> RegionStorage:
        return self._layout.regions[r].storage

    def region_grad(self, r: int) -> torch.Tensor:
        """Region ``r``'s flat fp32 gradient accumulator (a gradient kept in the staging
        buffer for an fp16-I/O step is widened into it first)."""
        storage = self._layout.regions[r].storage
        with torch.no_grad():
            storage.materialize_grad()
        return storage.grad

    @property
    def plain_params(self) -> int:
        """How many of the parameters are not the bound module's masters ("plain")."""
        self._ensure_laid_out()
        return len(self._layout.plain)

    def plain_grads(self) -> Iterator[torch.Tensor]:
        """Gradients of the plain (non-region) parameters that have one."""
        self._ensure_laid_out()
        for seg in self._layout.plain:
            g = seg.param.grad
            if g is not None:
                yield g

    # ---- stepping (host_steps.py says which thread steps what) ---------------------

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
        device-state one. A streamed region is stepped on the device, and this waits for
        it (a host sync point; see :meth:`issue_region`).
        """
        self._ensure_laid_out()
        sink = self.timings if timings is None else timings
        return self._steps.step_region(r, grad_scale, hypers, sink)

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
        sink = self.timings if timings is None else timings
        return self._steps.issue_region(r, grad_scale, hypers, sink, done)

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
        sink = self.timings if timings is None else timings
        return self._steps.step_device_regions(regions, grad_scale, hypers, sink)

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
        sink = self.timings if timings is None else timings
        return self._steps.submit_host_steps(regions, grad_scale, hypers, sink, commit)

    def step_plain(
        self, grad_scale: float | None = None, *, hypers: dict[int, AdamHyper] | None = None
    ) -> None:
        """Step the plain (non-region) parameters that have gradients."""
        self._ensure_laid_out()
        self._steps.step_plain(grad_scale, hypers)

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
        sink = self.timings if timings is None else timings
        return self._steps.step_regions(
            regions, grad_scale, plain=plain, wait=wait, hypers=hypers, timings=sink, commit=commit
        )

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

    # ---- speculative steps (speculation.py) ----------------------------------------

    def speculation_bytes(self) -> int:
        """Host bytes of the speculative-step buffers that host-state regions lack: all of
        them before :meth:`prepare_speculation`, those it left out after.

        Per host-state parameter: an fp32 master backup and a second pair of Adam moments,
        12 bytes with fp32 moments, 8 with bf16 moments.
        """
        self._ensure_laid_out()
        return self._speculation.missing_bytes()

    def can_speculate(self, r: int) -> bool:
        """Whether region ``r`` has the buffers of a speculative step (see
        :meth:`prepare_speculation`); a host-state region without them steps after the
        answer instead."""
        self._ensure_laid_out()
        return self._speculation.can(r)

    def speculative_params_that_fit(self) -> int:
        """Host-state parameters whose speculative buffers fit in host memory now: the
        count :meth:`prepare_speculation` would give buffers to without a limit (whole
        regions, from the last in forward order down). The planner counts the same
        regions from the host memory its host state leaves (``PlanOptions.
        speculative_params``), before anything is allocated."""
        self._ensure_laid_out()
        return self._speculation.params_that_fit(_available_host_bytes)

    def prepare_speculation(self, max_params: int | None = None) -> None:
        """Allocate the buffers of speculative steps (once; later calls do nothing).

        Host-state regions get them in the order their gradients land in backward (the
        last region in forward order first), as long as the total stays within
        ``max_params`` parameters (None: no limit) and within
        ``SPECULATION_HOST_SHARE`` of the host memory available now. The first region
        that does not fit ends the run, so the regions that may speculate are the same
        suffix the planner assumes (``PlanOptions.speculative_params``, which
        ``AMPOptimizer`` passes). The others step after
        the answer, as without speculation. A warning names what host memory left out.
        Main thread.
        """
        self._ensure_laid_out()
        self._speculation.prepare(max_params, _available_host_bytes)

    @property
    def speculated_regions(self) -> frozenset[int]:
        """Regions stepped speculatively and neither committed nor undone yet."""
        return frozenset(self._speculation.speculated)

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
        the spare buffers (see [Note: speculative steps] in speculation.py). The new
        weights are not published: :meth:`commit_speculation` then ``submit_host_steps(...,
        commit=...)`` do that, or :meth:`undo_speculation` restores the region.
        Host worker (a grad-ready hook); :meth:`prepare_speculation` must have run.

        Returns the region's overflow partial: the sum of its whole gradient before the
        step (0-dim fp32, finite exactly when every element is; see
        ``host_kernels.speculative_adam_``), or None when the region had no gradients (nothing
        stepped).
        """
        self._ensure_laid_out()
        self._speculation.check(r)
        segments = self._layout.segments_with_grad(r)
        if not segments:
            return None
        sink = self.timings if timings is None else timings
        return self._speculation.speculate(r, segments, grad_scale, hypers, sink)

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
        :meth:`speculate_region` does, now or, with ``speculation_thread``, on the module's
        speculation thread in submission order. ``stepped(r, partial)`` is called after the
        step (where it ran; not when ``r`` had no gradients). On the thread the step is
        skipped when ``stop()`` is true by the time it would start (backward is over: the
        region steps after the answer instead). Which segments step is fixed here, so the
        thread reads no ``.grad``: ``zero_grad`` may drop them meanwhile. Wait with
        :meth:`wait_speculation` before committing or undoing."""
        self._ensure_laid_out()
        self._speculation.submit(
            r, grad_scale, hypers=hypers, timings=timings, stop=stop, stepped=stepped
        )

    def wait_speculation(self, between: Callable[[], None] | None = None) -> None:
        """Block until every speculative step submitted so far has finished (a host sync
        point while one runs) and re-raise the first error; nothing to wait for without
        ``speculation_thread``. ``between`` runs about every millisecond while waiting
        (the host worker publishes streamed regions that landed). Call it once the hooks
        that submit them have run: after ``controller.wait_gradients()``, or on the host
        worker behind them."""
        self._speculation.wait(between)

    def commit_speculation(self) -> list[int]:
        """Make the speculative steps final; returns their regions, in forward order.

        The next moments become the moments by a swap of references (segments and
        ``state`` entries), no copy; the masters are stepped already. Publishing the new
        weights is left to the caller. The host task of ``submit_host_steps(...,
        commit=[])`` calls it, after :meth:`wait_speculation`; or any thread once the
        speculative steps are done.
        """
        return self._speculation.commit(self.state)

    def undo_speculation(self) -> list[int]:
        """Undo the speculative steps exactly; returns their regions, in forward order.

        Restores each stepped segment's master from its backup and its step count; the
        moments were never written (the step wrote the spare ones). Main thread, once the
        host worker has finished the speculative steps; nothing was published, so nothing
        else changes.
        """
        return self._speculation.undo()

    # ---- streamed regions (streamed/) ----------------------------------------------

    def writes_on_device(self, r: int) -> bool:
        """Whether streamed region ``r``'s device step writes its parameters in place on
        the device ([Note: writing resident parameters] in streamed/steps.py): a resident
        region, with a plan whose streaming costs say so (``StreamedStepCosts.
        resident_down_bytes_per_param``), or ``streamed.WRITE_RESIDENT`` without costs."""
        return self._streamed.writes_on_device(r)

    def stage_streamed_state(self) -> None:
        """Host worker, in a streamed region's gradient hook in the backward before a
        step: with ``stage_in_backward``, open the ring and issue the copies up of the
        master weights and moments (not the gradients) of the streamed regions' leading
        chunks, in forward order, as far as the ring's slots go ([Note: staging the state
        in backward] in streamed/ring.py). Nothing when a ring is open (the last step's,
        not yet closed, or this backward's): its slots are in use."""
        if not self.stage_in_backward:
            return
        self._ensure_laid_out()
        self._streamed.stage()

    def drop_staged(self) -> None:
        """Main thread, for a step that was skipped (or failed) after a backward that may
        have staged (:meth:`stage_streamed_state`): close the ring on the host worker
        (after the staged copies up), nothing issued on it, if one is open."""
        self._require_controller().submit_host(partial(self.publish_streamed, wait=True))

    def publish_streamed(self, wait: bool = False) -> None:
        """Host worker: publish each streamed region whose downloads have landed (in
        issue order; with ``wait``, all of them, blocking: a host sync point), and free
        the ring once none is left to publish.

        The ring is freed as soon as the last streamed region is published, not at the
        end of the task: the planner counts it until the last download, and a ring held
        into the next forward would add its bytes to that forward's peak. A ring that
        holds staged chunks and nothing else stays open unless ``wait``: a host-state
        region stepped in its hook calls this after the backward staged them ([Note:
        staging the state in backward] in streamed/ring.py)."""
        self._streamed.publish(wait)

    # ---- zero_grad -----------------------------------------------------------------

    def _require_controller(self) -> OffloadController:
        return self._layout.require_controller()

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
        if self._layout.controller is not None:
            self._layout.controller.wait_gradients()
        host, host_storages = self._layout.drop_grads(set_to_none)
        if host:
            controller = self._require_controller()
            controller.submit_host(partial(_zero_on_host, host, host_storages))

    # ---- checkpoints ---------------------------------------------------------------

    def _ordered_params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def synchronize(self) -> None:
        """Wait for the steps queued on the host worker (and the speculative steps on
        their thread); re-raise their first error."""
        if self._layout.controller is not None:
            self._layout.controller.wait_host()
        self.wait_speculation()

    def state_dict(self) -> dict[str, Any]:
        """torch's optimizer format (``state`` by parameter index, ``param_groups``).

        Moments are copied to CPU tensors in their stored dtype; ``step`` is a 0-dim fp32
        tensor, as ``torch.optim.AdamW(fused=True)`` keeps it, so either can load the other's.
        Refused while a speculative step is uncommitted: it holds committed state only.
        """
        if self._layout.controller is not None:
            self._layout.controller.wait_host()
        self.wait_speculation()
        self._speculation.refuse("state_dict()")
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
        if self._layout.controller is not None:
            self._layout.controller.wait_host()
        self.wait_speculation()
        self._speculation.refuse("load_state_dict()")
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
        segments = self._layout.all_segments()
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
                    for scale in seg.scales or ():
                        scale.zero_()
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
                typed = [cast(dict[str, torch.Tensor], e) for e in entries]
                if seg.scales is not None:
                    self._load_quantized(seg, typed)
                else:
                    for p, entry in zip(seg.views, typed, strict=True):
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

    def _load_quantized(self, seg: Segment, entries: list[dict[str, torch.Tensor]]) -> None:
        """Load 8-bit segment ``seg``'s moments from its parameters' ``entries``: codes
        and scales as :meth:`state_dict` saves them, or floating moments (an ``AdamW``
        state dict, another rung's), quantized as the 8-bit step would."""
        assert seg.scales is not None
        for p, entry in zip(seg.views, entries, strict=True):
            for key in ("exp_avg", "exp_avg_sq"):
                if entry[key].numel() != p.numel():
                    raise ValueError(
                        f"optimizer state_dict {key} has {entry[key].numel()} elements, the "
                        f"parameter {p.numel()}"
                    )
        if all("exp_avg_scale" in e for e in entries):
            first = entries[0]
            for key, scale in zip(("exp_avg_scale", "exp_avg_sq_scale"), seg.scales, strict=True):
                if first[key].shape != scale.shape:
                    raise ValueError(
                        f"optimizer state_dict {key} has shape {tuple(first[key].shape)}, "
                        f"this 8-bit segment {tuple(scale.shape)}: save and load with the "
                        "same parameter groups"
                    )
                scale.copy_(first[key])
            offset = 0
            for p, entry in zip(seg.views, entries, strict=True):
                n = p.numel()
                seg.exp_avg[offset : offset + n].copy_(entry["exp_avg"].reshape(-1))
                seg.exp_avg_sq[offset : offset + n].copy_(entry["exp_avg_sq"].reshape(-1))
                offset += n
            return
        m = torch.cat([e["exp_avg"].reshape(-1).float() for e in entries])
        v = torch.cat([e["exp_avg_sq"].reshape(-1).float() for e in entries])
        low_precision.quantize_moments_(
            m, v, seg.exp_avg, seg.scales[0], seg.exp_avg_sq, seg.scales[1]
        )


def _nothing() -> None:
    """The default ``published`` callback of :meth:`HybridAdam.issue_region`."""
