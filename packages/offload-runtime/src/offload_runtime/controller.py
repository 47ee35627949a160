"""The per-step state machine that moves regions between host and device.

The graph passes insert calls into this controller at region boundaries of the forward
graph; the backward side is driven by autograd itself:
- saved-tensor hooks pushed while a region's forward runs fire when its backward first
  unpacks a saved tensor, which is before any backward use of its parameters: that is
  where the region is uploaded again and where planned backward prefetches are issued;
- a post-accumulate-grad hook on every parameter tells when all of a region's gradients
  exist: the region's gradients are then moved out (to the host on the d2h stream, or into
  the device fp32 accumulator), and an offloaded region's slot is released;
- a callback queued on the autograd engine closes the backward pass.
See [Note: streams and threads] in streams.py and [Note: region storage] in storage.py.
"""

from __future__ import annotations

import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from enum import Enum
from typing import Any

import torch
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
)

from offload_runtime.activations import SavedActivations
from offload_runtime.conversions import copy_up, widen_down
from offload_runtime.frozen import SavedParams
from offload_runtime.inputs import tensors_in
from offload_runtime.storage import RegionStorage
from offload_runtime.streams import Event, StreamSet
from offload_solver import ParamPlacement, Plan

log = logging.getLogger(__name__)

GradReadyHook = Callable[[int], None]
"""Called with a region index once that region's fp32 gradients of a backward are complete.
Host-state regions call it on the host worker thread, device-state regions on the thread
that runs backward."""
DeviceGradHook = Callable[[int, list[torch.Tensor]], None]
"""Called with a host-state region's index and its training-dtype device gradients just
before they are copied to the host (see :meth:`OffloadController.add_device_grad_hook`)."""
GradReducer = Callable[[int, list[torch.Tensor]], bool]
"""Reduces a region's device gradients over data-parallel ranks in place; False where
another rank steps the region (this one then drops them): ``distributed.py``."""


class RegionState(Enum):
    """Where an offloaded region's training-dtype parameters are."""

    ON_HOST = "on_host"
    """Only the pinned host copy is valid; the pool slot may hold another region."""
    IN_FLIGHT = "in_flight"
    """A prefetch is queued on the h2d stream; wait for its event before use."""
    ON_DEVICE = "on_device"
    """The pool slot holds the region (uploaded, or prefetched and waited for)."""


class OffloadController:
    """Executes a plan's uploads, prefetches, releases and gradient moves."""

    def __init__(
        self,
        plan: Plan,
        storages: list[RegionStorage],
        streams: StreamSet,
        *,
        host_worker: bool | None = None,
        batch_device_grads: bool = False,
        convert_on_device: bool = False,
    ) -> None:
        """``host_worker``: run host-side gradient work (and optimizer steps hung off the
        grad-ready hooks) on the host worker thread that ``streams`` owns; default: on CUDA
        only. On the CPU it exists so that tests exercise the threaded path.

        ``batch_device_grads``: fold the training-dtype gradients of every device-state
        region into the fp32 accumulators in one batched operation at the end of backward,
        instead of region by region as each region's backward ends (see
        :meth:`_finish_device_regions`). It saves per-region launches and Python when the
        step is launch-bound, but keeps those gradients alive until backward ends, so it is
        only for plans whose budget has room for them.

        ``convert_on_device``: the host makes no dtype-conversion pass. When a host-state
        region's fp32 accumulator holds nothing to add to, its gradients are widened to fp32
        on the device and copied straight into it (twice the d2h bytes); its parameters are
        uploaded from the fp32 master and narrowed on the device (twice the h2d bytes), so a
        host optimizer step needs no cast to the training dtype afterwards. The storages
        must have been built with the same flag, and the plan made with
        ``host_grad_bytes_per_param=4`` and ``host_upload_bytes_per_param=4``.
        """
        self.convert_on_device = convert_on_device
        self.keep_staged_grads = False
        """Leave a host-state region's training-dtype gradients in its staging buffer when
        they replace the accumulator's content, instead of widening them into it
        (``RegionStorage.grad_in_staging``): set by an optimizer whose host step reads fp16
        gradients itself (the module sets it from ``PlanOptions.fp16_io``). Whatever else
        reads the gradient widens it first (``RegionStorage.materialize_grad``)."""
        self.plan = plan
        self.storages = storages
        self.batched_device_regions = frozenset(
            st.index
            for st in storages
            if batch_device_grads and not st.host_state and not st.offloaded
        )
        """Device-state regions whose gradients are folded in at the end of backward."""
        self.streams = streams
        n = len(storages)
        self.state = [RegionState.ON_HOST] * n
        for st in storages:
            if not st.offloaded:
                self.state[st.index] = RegionState.ON_DEVICE
        # h2d event of an in-flight prefetch, or of a post-step upload of a resident region.
        self.ready_event: list[Event | None] = [None] * n
        self.slot_occupant: dict[int, int | None] = {}
        self.slot_free_event: dict[int, Event | None] = {}
        # Regions whose backward prefetch is issued at the backward start of a host region.
        self.prefetch_at: dict[int, list[int]] = {}
        for rp in plan.regions:
            if rp.placement is ParamPlacement.ASYNC and rp.prefetch_at is not None:
                self.prefetch_at.setdefault(rp.prefetch_at, []).append(rp.region.index)
        # Per-backward bookkeeping.
        self._bwd_started: set[int] = set()
        self._grads_done: set[int] = set()
        self._received: list[int] = [0] * n
        self._expected = [sum(p.requires_grad for p in st.params.values()) for st in storages]
        self._saved = SavedParams(storages)  # [Note: releasing regions with frozen parameters]
        # What RECOMPUTE and HOST regions do with their saved tensors (activations.py).
        self.activations = SavedActivations(plan, storages, streams)
        self._callback_queued = False
        self._hook_depth = 0
        self._grad_hooks: list[GradReadyHook] = []
        self._device_grad_hooks: list[DeviceGradHook] = []
        self.grad_reducer: GradReducer | None = None
        self._lock = threading.Lock()
        # Host-side gradient work (and optimizer steps that hang off the grad-ready hooks)
        # runs on the host worker that ``streams`` owns, or inline (see [Note: streams and
        # threads] in streams.py).
        self._threaded = streams.is_cuda if host_worker is None else host_worker
        self._futures: list[Future[None]] = []
        # Host gradient work (accumulation and the grad-ready hooks) not yet waited for.
        self._grad_work: list[Future[None]] = []
        # Last host task that reads each region's grad staging buffer.
        self._staging_reader: dict[int, Future[None]] = {}
        # Optimizer steps queued on the host worker that will change a region's parameters
        # (see expect_updates): the region's next use waits for its future.
        self._updates: dict[int, Future[None]] = {}
        self._early: dict[int, tuple[Future[None], Event]] = {}
        """Per region, an announced update whose new parameters are written on the device
        at the event, before the update completes (see :meth:`ready_early`)."""
        self._early_lock = threading.Lock()
        self.update_wait_s = 0.0
        """Seconds this process blocked in :meth:`wait_update` for steps still running
        (cumulative): the part of the host optimizer steps that the next forward did not
        hide."""
        self.stats = {
            "sync_uploads": 0,
            "prefetches": 0,
            "prefetch_fallbacks": 0,
            "grads_to_accumulator": 0,  # host-state regions copied straight to fp32
            "grads_to_staging": 0,  # ... or to staging, for the host worker to add
            "staged_grads_widened_late": 0,  # kept in staging, then added to (accumulation)
        }
        self._register_grad_hooks()

    # ---- region residency ------------------------------------------------------------

    def _claim_slot(self, r: int) -> None:
        st = self.storages[r]
        assert st.slot is not None
        occupant = self.slot_occupant.get(st.slot)
        if occupant is not None and occupant != r:
            if self.state[occupant] is RegionState.IN_FLIGHT:
                # A prefetched region not yet used loses the slot; it is uploaded again at use.
                self.streams.compute.wait(self.ready_event[occupant])
                self.state[occupant] = RegionState.ON_HOST
                self.ready_event[occupant] = None
            else:
                raise RuntimeError(
                    f"offload runtime: region {r} needs pool slot {st.slot}, still held by "
                    f"region {occupant}; the plan's pool assignment does not match the "
                    "execution order (please report this with the plan JSON)"
                )
        self.slot_occupant[st.slot] = r

    def upload(self, r: int) -> None:
        """Make region ``r``'s parameters usable by the compute stream (sync upload)."""
        self.wait_update(r)
        state = self.state[r]
        if state is RegionState.ON_DEVICE:
            return
        if state is RegionState.IN_FLIGHT:
            self.streams.compute.wait(self.ready_event[r])
            self.ready_event[r] = None
            self.state[r] = RegionState.ON_DEVICE
            return
        st = self.storages[r]
        assert st.slot is not None
        self._claim_slot(r)
        self.streams.compute.wait(self.slot_free_event.get(st.slot))
        # Queued on the compute stream: compute waits for it, the host does not.
        copy_up(st)
        self.state[r] = RegionState.ON_DEVICE
        self.stats["sync_uploads"] += 1

    def prefetch(self, r: int) -> None:
        """Queue region ``r``'s upload on the h2d stream, if its slot is free."""
        self.wait_update(r)
        if self.state[r] is not RegionState.ON_HOST:
            return
        st = self.storages[r]
        assert st.slot is not None
        occupant = self.slot_occupant.get(st.slot)
        if occupant is not None and occupant != r:
            # The slot's previous region is still in use: r is uploaded at use instead.
            self.stats["prefetch_fallbacks"] += 1
            return
        self.slot_occupant[st.slot] = r
        h2d = self.streams.h2d
        with h2d.context():
            # Do not overwrite the slot before compute has finished with its last occupant.
            h2d.wait(self.slot_free_event.get(st.slot))
            copy_up(st)
            self.ready_event[r] = h2d.record()
        self.state[r] = RegionState.IN_FLIGHT
        self.stats["prefetches"] += 1

    def release(self, r: int) -> None:
        """Give an offloaded region's slot back once queued compute is done with it."""
        st = self.storages[r]
        if not st.offloaded or self.state[r] is RegionState.ON_HOST:
            return
        assert st.slot is not None
        if self.state[r] is RegionState.IN_FLIGHT:
            self.streams.compute.wait(self.ready_event[r])
            self.ready_event[r] = None
        self.slot_free_event[st.slot] = self.streams.compute.record()
        self.slot_occupant[st.slot] = None
        self.state[r] = RegionState.ON_HOST

    # ---- forward-side entry points (called from graph nodes) -------------------------

    def begin_forward(self, r: int) -> None:
        self.wait_update(r)
        st = self.storages[r]
        if not st.offloaded and self.ready_event[r] is not None:
            # Updated parameters of a resident host-state region are uploading on h2d.
            self.streams.compute.wait(self.ready_event[r])
            self.ready_event[r] = None
        if st.offloaded:
            self.upload(r)
        if torch.is_grad_enabled() and self._needs_backward_trigger(r):
            self._push_hooks(r)

    def end_forward(self, r: int) -> None:
        self.activations.end_forward(r)
        if self._hook_depth and self._pushed_region == r:
            self._pop_hooks()
        self.release(r)

    def _needs_backward_trigger(self, r: int) -> bool:
        st = self.storages[r]
        return st.offloaded or r in self.prefetch_at or self.activations.hooked(r)

    # ---- backward-side triggers ----------------------------------------------------------

    _pushed_region = -1

    def _push_hooks(self, r: int) -> None:
        acts = self.activations

        def pack(t: torch.Tensor) -> tuple[int, Any, bool]:
            return (r, acts.pack(r, t), self._saved.packed(r, t))

        def unpack(packed: tuple[int, Any, bool]) -> torch.Tensor:
            region, value, counted = packed
            last = acts.run_end.get(region, region)
            if last not in self._bwd_started:
                # Its run is recomputed now: the last region's parameters must be up.
                self.pre_backward(last)
            if region not in self._bwd_started:
                self.pre_backward(region)
            if counted:
                self._saved.unpacked(region, self._expected[region] == 0)
            return acts.unpack(value)

        _push_saved_tensors_default_hooks(pack, unpack)
        self._hook_depth += 1
        self._pushed_region = r

    def _pop_hooks(self) -> None:
        _pop_saved_tensors_default_hooks()
        self._hook_depth -= 1
        self._pushed_region = -1

    def pop_all_hooks(self) -> None:
        """Undo hooks (and close activation frames) left open by a forward that raised."""
        while self._hook_depth:
            self._pop_hooks()
        self.activations.close_frames()

    def pre_backward(self, r: int) -> None:
        """Region ``r``'s backward is about to use its saved tensors."""
        self._bwd_started.add(r)
        self._queue_end_callback()
        for q in self._saved.take_ready():
            self.release(q)
        for q in self.prefetch_at.get(r, ()):
            if q not in self._grads_done:
                self.prefetch(q)
        self.activations.before_backward(r)
        if self.storages[r].offloaded:
            self.upload(r)

    def _register_grad_hooks(self) -> None:
        ref = weakref.ref(self)

        def queue_only(_: torch.Tensor) -> None:
            controller = ref()
            if controller is not None and not controller._callback_queued:
                controller._queue_end_callback()

        self._queue_hook = queue_only
        for st in self.storages:
            if st.index in self.batched_device_regions:
                # A batched region's gradients are read at the end of backward, by the
                # callback that a hook on the forward's outputs queues (watch_outputs):
                # its parameters carry no hook, which would cost the thread that drives
                # backward a Python call per parameter per step.
                continue
            for param in st.params.values():
                if param.requires_grad:
                    param.register_post_accumulate_grad_hook(self._make_grad_hook(st.index))  # type: ignore[no-untyped-call]

    def watch_outputs(self, outputs: Any) -> None:
        """Make a backward through any tensor of ``outputs`` (a forward's result: tensors
        nested in tuples, lists and mappings) queue the end-of-backward callback as it
        starts, for the batched device regions, whose parameters carry no hook. Every
        gradient of the model's parameters flows through some output, so any backward
        that reaches a parameter starts at one. A backward that reaches no parameter
        (``torch.autograd.grad`` with respect to the inputs) then also ends with the
        callback, which finds no gradients and leaves the accumulators as they were."""
        if not self.batched_device_regions:
            return  # every region's parameters carry a hook that queues it
        for t in tensors_in(outputs):
            if t.requires_grad:
                t.register_hook(self._queue_hook)  # type: ignore[no-untyped-call]

    def _make_grad_hook(self, r: int) -> Callable[[torch.Tensor], None]:
        # A weak reference: the hook lives on the parameter, which autograd's C++ side also
        # holds (its gradient accumulator), so the cyclic collector cannot see through it;
        # a strong one would keep the controller, and every region buffer, alive forever.
        ref = weakref.ref(self)

        def hook(_: torch.Tensor) -> None:
            controller = ref()
            if controller is None:
                return
            controller._queue_end_callback()
            for q in controller._saved.take_ready():
                controller.release(q)
            controller._received[r] += 1
            if controller._received[r] == controller._expected[r]:
                controller._finish_region_backward(r)

        return hook

    def _queue_end_callback(self) -> None:
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def _finish_region_backward(self, r: int) -> None:
        """All of region ``r``'s gradients exist: move them out and release the region."""
        if r in self._grads_done:
            return
        self._grads_done.add(r)
        st = self.storages[r]
        grads, views = st.take_grads()
        # Under data parallel the reducer says whether this rank steps region r (else its
        # gradients went to the rank that does).
        here = self.grad_reducer is None or not grads or self.grad_reducer(r, grads)
        if here and st.host_state:
            self._offload_grads(st, grads, views)
        elif here:
            self._fold_device_grads([(st, grads, views)])
            self._notify(r)
        if not self._saved.holds(r):
            self.release(r)

    def _fold_device_grads(
        self, items: list[tuple[RegionStorage, list[torch.Tensor], list[Any]]]
    ) -> None:
        """Fold device-state regions' training-dtype gradients (with their layouts, as
        :meth:`RegionStorage.take_grads` returns them) into the fp32 accumulators: one copy
        over every region whose accumulator is logically zero and gets all its gradients,
        one add over the rest."""
        copy_dst: list[torch.Tensor] = []
        copy_src: list[torch.Tensor] = []
        add_dst: list[torch.Tensor] = []
        add_src: list[torch.Tensor] = []
        with torch.no_grad():
            for st, grads, layouts in items:
                self._relink_master_grad(st)
                targets = [st.grad_views[layout.name] for layout in layouts]
                if st.grad_stale and len(grads) == len(st.layouts):
                    copy_dst += targets  # overwrite: logically zero before
                    copy_src += grads
                    st.grad_stale = False
                else:
                    st.materialize_grad()
                    add_dst += targets
                    add_src += grads
            if copy_dst:
                torch._foreach_copy_(copy_dst, copy_src)
            if add_dst:
                torch._foreach_add_(add_dst, add_src)

    def _offload_grads(
        self, st: RegionStorage, grads: list[torch.Tensor], layouts: list[Any]
    ) -> None:
        r = st.index
        if not grads:
            empty = self._submit(lambda: self._host_accumulate(r, None))
            if empty is not None:
                self._grad_work.append(empty)
            return
        for device_hook in self._device_grad_hooks:
            device_hook(r, grads)
        reader = self._staging_reader.pop(r, None)
        if reader is not None and not reader.done():
            # Host sync point, only when the host lags a whole backward behind (gradient
            # accumulation): the staging buffer is still being read from the last backward.
            reader.result()
        if st.grad_in_staging and not self._accumulator_is_zero(st):
            # A gradient left in the staging buffer by an earlier backward that this one
            # must add to (accumulation): this backward's copy is about to overwrite it, so
            # widen it into the accumulator now, on this thread (the reader above has
            # finished). After zero_grad nothing is added, and nothing is widened.
            with torch.no_grad():
                st.materialize_grad()
            self.stats["staged_grads_widened_late"] += 1
        # take_grads keeps the region's layout order, so the gradients cover the whole
        # region exactly when every parameter has one. Otherwise the copies and the host's
        # add go by each present parameter's (offset, numel).
        present = (
            None
            if len(layouts) == len(st.layouts)
            else [(lay.offset, lay.numel) for lay in layouts]
        )
        # The accumulator holds nothing this backward must add to (zero_grad ran): the
        # gradients go straight into it in full precision, converted on the device, and the
        # host has no conversion pass to make. Otherwise they land in the training-dtype
        # staging buffer and the host worker adds them. Either way the values are the same:
        # widening to fp32 is exact.
        direct = self.convert_on_device and present is None and self._accumulator_is_zero(st)
        staging = None if direct else st.staging()
        d2h = self.streams.d2h
        d2h.wait(self.streams.compute.record())
        with d2h.context(), torch.no_grad():
            if staging is not None:
                # One copy per parameter straight into its slot of the staging buffer, all
                # issued by one call: a gather into one flat tensor first would hold a
                # second copy of the region's gradients on the device, memory the plan
                # does not count. With every gradient present the slots are the region's
                # kept views, shaped like the gradients.
                if present is None:
                    slots = st.staging_slots()
                    torch._foreach_copy_(slots, grads, non_blocking=True)
                else:
                    slots = [staging[off : off + n] for off, n in present]
                    flats = [g.reshape(-1) for g in grads]
                    torch._foreach_copy_(slots, flats, non_blocking=True)
            else:
                widen_down([g.reshape(-1) for g in grads], st.grad)
            done = d2h.record()
        if self.streams.is_cuda:
            for g in grads:
                # Python drops the gradient now; keep its memory until the copy has read it.
                g.record_stream(d2h.cuda)  # type: ignore[arg-type]
        self.stats["grads_to_accumulator" if direct else "grads_to_staging"] += 1
        if direct:
            fut = self._submit(lambda: self._host_landed(r, done))
        else:
            fut = self._submit(lambda: self._host_accumulate(r, done, present))
        if fut is not None:
            self._staging_reader[r] = fut
            self._grad_work.append(fut)

    def _accumulator_is_zero(self, st: RegionStorage) -> bool:
        """Whether region ``st``'s fp32 gradient is logically zero (lazily zeroed, or its
        views dropped by ``zero_grad(set_to_none=True)``) for the backward now running.

        Called on the backward thread. The host worker only ever changes this from "zero"
        to "not zero" by running the gradient task of an earlier backward, and zero_grad
        waits for those, so the answer cannot go stale before this backward's task runs.
        """
        if st.grad_stale:
            return True
        return any(m.grad is None for m in st.master_views.values())

    def _host_landed(self, r: int, done: Event) -> None:
        """Host worker: region ``r``'s gradients were copied straight into its fp32
        accumulator (see _offload_grads); wait for the copy and announce them."""
        st = self.storages[r]
        done.synchronize()  # host worker thread only: waits for this region's d2h copy
        self._relink_master_grad(st)
        st.grad_stale = False  # overwritten in full by the copy
        self._notify(r)

    def _host_accumulate(
        self, r: int, done: Event | None, present: list[tuple[int, int]] | None = None
    ) -> None:
        st = self.storages[r]
        if done is not None:
            done.synchronize()  # host worker thread only: waits for this region's d2h copy
        with torch.no_grad():
            self._relink_master_grad(st)
            if done is not None and present is None and st.grad_stale:
                # Overwrite: the accumulator was logically zero.
                if self.keep_staged_grads:
                    st.grad_in_staging = True  # the fp16-I/O step reads them from there
                else:
                    st.grad.copy_(st.staging())
                st.grad_stale = False
            elif done is not None:
                staging = st.staging()
                st.materialize_grad()
                if present is None:
                    st.grad.add_(staging)
                else:
                    for off, n in present:
                        st.grad[off : off + n].add_(staging[off : off + n])
            else:
                st.materialize_grad()
        self._notify(r)

    def _relink_master_grad(self, st: RegionStorage) -> None:
        """Re-attach ``.grad`` of master views after an optimizer set them to ``None``.

        ``zero_grad(set_to_none=True)`` drops the views; the flat accumulator then still
        holds old sums, so it is marked stale: this backward overwrites it.
        """
        lost = False
        for name, master in st.master_views.items():
            if master.grad is None and name not in st.frozen:
                lost = True
                master.grad = st.grad_views[name]
        if lost:
            st.grad_stale = True

    def _submit(self, fn: Callable[[], None]) -> Future[None] | None:
        if not self._threaded:
            fn()
            return None
        fut = self.streams.host_worker().submit(fn)
        self._futures.append(fut)
        return fut

    def _notify(self, r: int) -> None:
        for hook in self._grad_hooks:
            hook(r)

    def _finish_device_regions(self, regions: list[int]) -> None:
        """Fold the gradients of device-state ``regions`` into their fp32 accumulators in
        one batch (see :meth:`_fold_device_grads`); regions without gradients are skipped."""
        items = []
        done = []
        for r in regions:
            st = self.storages[r]
            grads, layouts = st.take_grads()
            if grads:
                if self.grad_reducer is not None:  # every rank steps device-state regions
                    self.grad_reducer(r, grads)
                items.append((st, grads, layouts))
                done.append(r)
                self._grads_done.add(r)
        self._fold_device_grads(items)
        for r in done:
            self._notify(r)

    def _end_backward(self) -> None:
        """Autograd-engine callback at the end of a backward pass."""
        if self.batched_device_regions:
            self._finish_device_regions(sorted(self.batched_device_regions))
        for q in self._saved.reset():
            self.release(q)
        for st in self.storages:
            r = st.index
            if r not in self._grads_done and (self._received[r] or r in self._bwd_started):
                self._finish_region_backward(r)
            elif r not in self._grads_done:
                self.release(r)
        self._bwd_started.clear()
        self._grads_done.clear()
        self._received = [0] * len(self.storages)
        self._callback_queued = False

    # ---- optimizer-facing API ----------------------------------------------------------

    def add_grad_ready_hook(self, hook: GradReadyHook) -> None:
        """Call ``hook(region_index)`` whenever a region's fp32 gradients are complete."""
        self._grad_hooks.append(hook)

    def add_device_grad_hook(self, hook: DeviceGradHook) -> None:
        """Call ``hook(region_index, grads)`` for each host-state region whose gradients
        are about to leave the device: on the backward thread, with the compute stream
        current, before their copy to the host is queued. ``grads`` are the region's
        training-dtype gradients (one tensor per parameter that got one); the hook may
        launch device work that reads them (it runs before the copy frees them) and must
        not change them. Regions without gradients are not reported.
        """
        self._device_grad_hooks.append(hook)

    def submit_host(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the host worker after the host work queued so far (inline on CPU)."""
        self._submit(fn)

    def wait_host(self) -> None:
        """Block until all queued host work is done; re-raise its first error. A sync point.

        Every task is waited for even when an earlier one failed, so that nothing still runs
        on the host worker when this raises.
        """
        futures, self._futures = self._futures, []
        updates, self._updates = self._updates, {}
        self._grad_work = []
        error: BaseException | None = None
        for fut in [*futures, *updates.values()]:
            try:
                fut.result()
            except BaseException as exc:  # re-raised below, after the rest are waited for
                if error is None:
                    error = exc
        with self._early_lock:
            self._early.clear()  # every update waited for is done: nothing is early now
        if error is not None:
            raise error

    def wait_gradients(self) -> None:
        """Block until the host gradient work of finished backward passes is done.

        That work (accumulating each host-state region's gradients, and the grad-ready
        hooks it calls) is waited for, but not the optimizer steps queued after it; its
        first error is re-raised. A host sync point while that work runs.
        """
        work, self._grad_work = self._grad_work, []
        for fut in work:
            fut.result()
        # Forget finished tasks that succeeded; failed ones stay for wait_host to re-raise.
        self._futures = [f for f in self._futures if not f.done() or f.exception() is not None]

    def expect_updates(self, regions: Iterable[int]) -> dict[int, Future[None]]:
        """Announce host work, queued next, that steps and publishes ``regions``.

        Returns one future per region. The work completes each (``set_result(None)``, or
        ``set_exception``) once that region's master is stepped and published, and must
        complete every one of them even when it fails. Until then the region's next
        :meth:`begin_forward`, :meth:`upload` or :meth:`prefetch` waits for it on the host
        (see [Note: overlapping the host step with backward] in offload_optim/overlap.py), and
        :meth:`wait_host` waits for all. Main thread only.
        """
        futures: dict[int, Future[None]] = {}
        for r in regions:
            fut: Future[None] = Future()
            futures[r] = fut
            self._updates[r] = fut
        return futures

    def wait_update(self, r: int) -> None:
        """Block until region ``r``'s announced update (if any) is done; re-raise its error.

        A host sync point only while that step still runs; the blocked time is added to
        :attr:`update_wait_s`. An update that has written the region's device parameters
        already (:meth:`ready_early`) is not waited for: its event becomes the region's
        ``ready_event``, which the compute stream waits on; its error, if any, reaches
        :meth:`wait_host` through the host task that runs it.
        """
        fut = self._updates.pop(r, None)
        if fut is None:
            return
        with self._early_lock:
            early = self._early.pop(r, None)
        if early is not None and early[0] is fut and not fut.done():
            # Written on the device: the compute stream waits for the write, not the host
            # for the update's end (begin_forward waits on ready_event).
            self.ready_event[r] = early[1]
            return
        if not fut.done():
            start = time.perf_counter()
            try:
                fut.result()
            finally:
                self.update_wait_s += time.perf_counter() - start
        fut.result()

    def ready_early(self, r: int, update: Future[None], event: Event) -> None:
        """Any thread: announced ``update`` of resident region ``r`` has written its new
        device parameters, done on the device at ``event``, and goes on (its host state
        still landing). Its next forward, if that comes first, waits for ``event`` on the
        compute stream instead of for ``update`` on the host. The update must still
        complete its future and publish the region (:meth:`publish_written`)."""
        with self._early_lock:
            self._early[r] = (update, event)

    def publish_written(self, r: int, event: Event) -> None:
        """Host worker: region ``r``'s update, whose device step wrote its device
        parameters (ready at ``event``), is done: nothing to upload; the next forward
        waits for ``event`` on the compute stream."""
        st = self.storages[r]
        if st.offloaded:
            raise ValueError(
                f"publish_written: region {r} is offloaded; its parameters live on the host"
            )
        st.upload_copy_fresh = False
        self.ready_event[r] = event

    def publish_casts(self, r: int) -> bool:
        """Whether :meth:`publish` of region ``r`` would now cast its master on the host:
        a host-state region converting on the host whose upload copy was not written by
        the optimizer's step (``upload_copy_fresh``). Any thread."""
        st = self.storages[r]
        if st.upload_copy_fresh:
            return False
        if st.master_is_upload_copy:
            return False
        if st.offloaded:
            return st.host_params is not None
        return st.host_state and not st.convert_on_device

    def publish(self, r: int) -> None:
        """Propagate region ``r``'s updated master into its training-dtype copies.

        Host-state regions: call from the host worker (the cast runs on the CPU, or with
        ``convert_on_device`` on the device after the upload; an offloaded region then has
        nothing to do, its next upload reads the master); a resident one then uploads on the
        h2d stream and the next forward waits for it. Device-state regions: call from the
        main thread; the cast is queued on the compute stream.
        """
        st = self.storages[r]
        fresh, st.upload_copy_fresh = st.upload_copy_fresh, False
        with torch.no_grad():
            if st.offloaded:
                if st.host_params is not None and not fresh and not st.master_is_upload_copy:
                    st.host_params.copy_(st.master)
            elif st.host_state:
                source = st.master
                if not st.convert_on_device and not st.master_is_upload_copy:
                    # Cast on the host into the staging buffer, free until the next backward
                    # (whose copies the next forward's wait for this upload orders after),
                    # unless the optimizer's step wrote it already.
                    source = st.staging()
                    if not fresh:
                        source.copy_(st.master)
                h2d = self.streams.h2d
                with h2d.context():
                    copy_up(st, source)
                    self.ready_event[r] = h2d.record()
            else:
                st.device_params.copy_(st.master)

    def publish_many(self, regions: Iterable[int]) -> None:
        """:meth:`publish` for many regions; the resident device-state ones in one batch.

        Main thread. A batched cast of every resident device-state region costs one call
        instead of one Python round trip per region: with many small regions those round
        trips made the optimizer step CPU-bound.
        """
        targets: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []
        for r in regions:
            st = self.storages[r]
            if st.offloaded or st.host_state:
                self.publish(r)
            else:
                targets.append(st.device_params)
                sources.append(st.master)
        if targets:
            with torch.no_grad():
                torch._foreach_copy_(targets, sources)

    def close(self) -> None:
        """Stop the worker threads after their queued work (``StreamSet.close``: the host
        worker and the optimizer's threads); re-raise the host work's first error."""
        self.streams.close()
        self.wait_host()
