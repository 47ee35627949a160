"""Region storage: flat buffers that hold each region's parameters, masters and gradients.

[Note: region storage]
Each region of the plan owns, for its parameters laid out one after another:
- ``device_params``: the training-dtype copy the model computes with. A resident region
  has its own device buffer; an offloaded region's buffer is a slot of the device pool,
  shared with the regions the plan never keeps on the device at the same time. The
  ``nn.Parameter`` objects put into the graph module are views of this buffer made with
  ``set_`` so that each has its own autograd version counter: re-uploading a slot between
  forward and backward is not an in-place change of the saved parameter.
- ``host_params`` (offloaded regions, unless ``convert_on_device``): a pinned
  training-dtype copy, the upload source. With ``convert_on_device`` there is none: the
  fp32 master is the upload source, narrowed to the training dtype on the device (twice
  the h2d bytes, no host cast after each optimizer step, 2 fewer host bytes per element).
- ``master``: full-precision (fp32) weights, on the device or in pinned host memory as the
  plan's ``StatePlacement`` says; the optimizer updates these. On a bf16-master rung of
  the host-state ladder (``OffloadConfig.host_state``) a host-state region's master is
  bf16, the training dtype: it is then its own upload copy (``host_params`` is the master
  itself, and a resident region uploads from it), so nothing is cast on the host.
- ``grad``: the gradient accumulator, next to the master, in the master's dtype. Gradients
  of one backward are added to it, so accumulation over micro-batches sums in fp32 (in
  bf16 beside a bf16 master, as torch accumulates the gradients of bf16 parameters).
- ``grad_staging`` (host-state regions): pinned training-dtype buffer that receives the
  region's gradients from the device; also the staging buffer for uploading updated
  resident parameters after a host step. With ``convert_on_device`` gradients normally go
  to the accumulator as fp32 (widened on the device) and parameters upload from the
  master, so the buffer is only allocated, at first use, when gradients must be *added*
  (accumulation over micro-batches): see :meth:`RegionStorage.staging`.
Tied parameters appear once, under the group's canonical name; every alias name maps to it.
Frozen parameters (``requires_grad=False``) come after the trainable ones of their region,
so that the trainable ones are the prefix ``[0, trainable_numel)`` of every flat buffer:
the optimizer's moments cover that prefix only. A frozen master has no ``.grad``.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

from offload_runtime.hardware import available_host_memory_bytes
from offload_solver import ParamPlacement, Plan, RegionPlan, StatePlacement

MASTER_DTYPE = torch.float32
_ALIGN_ELEMS = 128
"""Pool slots start on a multiple of this many elements (256 bytes in fp16)."""


@dataclass(frozen=True)
class ParamLayout:
    """Where one (canonical) parameter lives inside its region's flat buffers."""

    name: str
    aliases: tuple[str, ...]
    """Every original name sharing this storage, ``name`` included."""
    offset: int
    """Element offset into the region's flat buffers."""
    shape: torch.Size
    requires_grad: bool

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _view(flat: torch.Tensor, offset: int, shape: torch.Size) -> torch.Tensor:
    """A tensor over ``flat``'s storage with its own autograd version counter."""
    out = torch.empty(0, dtype=flat.dtype, device=flat.device)
    strides = torch.empty(shape, device="meta").stride()
    out.set_(flat.untyped_storage(), flat.storage_offset() + offset, shape, strides)
    return out


_PIN_IN_PLACE_MIN_BYTES = 1 << 20
"""Smaller buffers come from PyTorch's pinned allocator: its rounding wastes little there,
and a small ordinary allocation may share a memory page with another registered one, which
``cudaHostRegister`` refuses."""


def _cudart() -> Any:
    """The CUDA runtime bindings (``torch.cuda.cudart()``, untyped)."""
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def _unregister(ptr: int) -> None:
    with contextlib.suppress(Exception):  # interpreter shutdown: CUDA may be gone already
        _cudart().cudaHostUnregister(ptr)


def _pin_in_place(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory where it is (``cudaHostRegister``); False if that failed.

    [Note: exact-size pinned memory]
    ``torch.empty(..., pin_memory=True)`` goes through PyTorch's caching host allocator,
    which rounds every allocation up to the next power of two: a region's fp32 masters and
    gradients just above one would pin nearly twice their size, which a model whose host
    state fills host memory cannot afford. Registering an ordinary allocation pins exactly
    its size. The registration is undone when the tensor object that owns the memory is
    collected (every view keeps it alive through ``_base``).
    """
    try:
        ptr = t.data_ptr()
        err = _cudart().cudaHostRegister(ptr, t.numel() * t.element_size(), 0)
        if int(err) != 0:
            _cudart().cudaGetLastError()  # clear the error state
            return False
    except Exception:  # no CUDA runtime binding, or a driver that refuses: use the allocator
        return False
    if not t.is_pinned():
        _unregister(ptr)
        return False
    weakref.finalize(t, _unregister, ptr)
    return True


def alloc_host(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """``numel`` elements of host memory (uninitialised), page-locked when ``pin`` (see
    [Note: exact-size pinned memory]; falls back to PyTorch's pinned allocator). Every
    buffer of host state that crosses PCIe at every step should come from here."""
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    try:
        if pin and nbytes >= _PIN_IN_PLACE_MIN_BYTES:
            t = torch.empty(numel, dtype=dtype)
            if _pin_in_place(t):
                return t
            del t
        return torch.empty(numel, dtype=dtype, pin_memory=pin)
    except RuntimeError as exc:
        kind = "pinned " if pin else ""
        raise RuntimeError(
            f"could not allocate {nbytes / 2**20:.1f} MiB of {kind}host memory for region "
            f"storage ({exc}). Free host memory, lower the model size, or raise the memory "
            "budget so that more state stays on the device."
        ) from exc


# Keyed by identity: a WeakKeyDictionary would compare tensors with ``==``. The values are
# weak too: a storage holds its master views, so a strong value would keep its own key
# (and with it every buffer of the region, device memory included) alive forever.
_OWNER: WeakIdKeyDictionary = WeakIdKeyDictionary()


def region_of(master: torch.Tensor) -> RegionStorage | None:
    """The region storage whose master weights ``master`` is a view of, if any."""
    ref = _OWNER.get(master)  # type: ignore[no-untyped-call]
    owner = ref() if isinstance(ref, weakref.ref) else None
    return owner if isinstance(owner, RegionStorage) else None


class RegionStorage:
    """The buffers of one region (see [Note: region storage])."""

    def __init__(
        self,
        plan: RegionPlan,
        layouts: tuple[ParamLayout, ...],
        device: torch.device,
        dtype: torch.dtype,
        pool_slot: torch.Tensor | None,
        slot: int | None = None,
        *,
        convert_on_device: bool = False,
        host_master_dtype: torch.dtype = MASTER_DTYPE,
    ) -> None:
        self.plan = plan
        self.convert_on_device = convert_on_device
        """Uploads read the fp32 master and narrow on the device; gradients are widened on
        the device (see [Note: region storage])."""
        self.index = plan.region.index
        self.layouts = layouts
        self.numel = sum(layout.numel for layout in layouts)
        self.frozen = frozenset(lay.name for lay in layouts if not lay.requires_grad)
        """Names of the region's frozen parameters (no gradient, no optimizer state)."""
        self.trainable_numel = sum(lay.numel for lay in layouts if lay.requires_grad)
        """Elements of the trainable parameters: the prefix of the flat buffers they fill."""
        self.dtype = dtype
        self.device = device
        pin = device.type == "cuda"
        self._pin = pin
        self.offloaded = plan.placement is not ParamPlacement.RESIDENT
        self.slot = slot
        """Pool slot index of an offloaded region (regions sharing it never coexist)."""
        self.host_state = plan.state is not StatePlacement.DEVICE
        """Master and moments live in host memory (HOST or STREAMED)."""
        self.streamed = plan.state is StatePlacement.STREAMED
        """STREAMED: host state whose optimizer step runs on the device (see [Note:
        streamed steps] in offload_optim/streamed/__init__.py); its moments are pinned."""
        master_dtype = host_master_dtype if self.host_state and not self.streamed else MASTER_DTYPE
        self.master_is_upload_copy = master_dtype == dtype and master_dtype != MASTER_DTYPE
        """The host master is in the training dtype (a bf16-master rung): it is the upload
        source itself, and no step or publish casts anything on the host."""
        if self.master_is_upload_copy and convert_on_device:
            raise ValueError(
                f"region {self.index}: a {dtype} host master is its own upload copy; it "
                "cannot convert on the device"
            )
        state_device = torch.device("cpu") if self.host_state else device
        if state_device.type == "cpu":
            self.master = alloc_host(self.numel, master_dtype, pin)
            self.grad = alloc_host(self.numel, master_dtype, pin)
        else:
            self.master = torch.empty(self.numel, dtype=MASTER_DTYPE, device=state_device)
            self.grad = torch.empty(self.numel, dtype=MASTER_DTYPE, device=state_device)
        if self.offloaded:
            assert pool_slot is not None and pool_slot.numel() >= self.numel
            self.device_params = pool_slot[: self.numel]
            self.host_params: torch.Tensor | None = (
                self.master
                if self.master_is_upload_copy
                else None
                if convert_on_device
                else alloc_host(self.numel, dtype, pin)
            )
        else:
            self.device_params = torch.empty(self.numel, dtype=dtype, device=device)
            self.host_params = None
        self.grad.zero_()
        # Zero in memory too, but flagged so that the first backward overwrites rather than
        # adds (for host-state regions: copies straight into it, see the controller).
        self.grad_stale = True
        """True when ``grad`` is logically zero but its memory was not cleared: the next
        backward overwrites it instead of adding (a copy is ~5x faster than zero + add on
        the host), and readers clear it first (:meth:`materialize_grad`)."""
        self.grad_staging: torch.Tensor | None = (
            alloc_host(self.numel, dtype, pin)
            if self.host_state and not convert_on_device
            else None
        )
        self._staging_slots: list[torch.Tensor] | None = None
        self.grad_in_staging = False
        """The gradient is still only in ``grad_staging``, in the training dtype (the
        controller's ``keep_staged_grads``): an fp16-I/O optimizer step reads it there, and
        :meth:`materialize_grad` widens it into ``grad`` for any other reader. Meaningful
        only while ``grad_stale`` is False."""
        self.upload_copy_fresh = False
        """The optimizer's step already wrote the new master's training-dtype upload copy
        (:meth:`upload_copy`): the next publish skips its cast."""
        self.params: dict[str, torch.nn.Parameter] = {}
        self.master_views: dict[str, torch.Tensor] = {}
        self.grad_views: dict[str, torch.Tensor] = {}
        for layout in layouts:
            param = torch.nn.Parameter(
                _view(self.device_params, layout.offset, layout.shape),
                requires_grad=layout.requires_grad,
            )
            self.params[layout.name] = param
            self.master_views[layout.name] = self.master[
                layout.offset : layout.offset + layout.numel
            ].view(layout.shape)
            self.grad_views[layout.name] = self.grad[
                layout.offset : layout.offset + layout.numel
            ].view(layout.shape)
            # Optimizers over the masters read gradients here (see _relink_master_grad).
            if layout.requires_grad:
                self.master_views[layout.name].grad = self.grad_views[layout.name]
            _OWNER[self.master_views[layout.name]] = weakref.ref(self)

    def free_gradients(self) -> None:
        """Another data-parallel rank steps this region (``distributed.Sharding``): free
        its gradient accumulator and staging buffer, which this rank never fills; its
        masters have no ``.grad`` from now on."""
        self.grad = self.grad.new_empty(0)
        self.grad_views = {}
        self.grad_staging = None
        self._staging_slots = None
        for master in self.master_views.values():
            master.grad = None

    def take_grads(self) -> tuple[list[torch.Tensor], list[ParamLayout]]:
        """Detach the training-dtype gradients from the parameters: the gradients present
        and their layouts, in layout order (``.grad`` is ``None`` afterwards)."""
        grads = []
        layouts = []
        for layout in self.layouts:
            param = self.params[layout.name]
            if param.grad is not None:
                grads.append(param.grad)
                layouts.append(layout)
            param.grad = None
        return grads, layouts

    def staging(self) -> torch.Tensor:
        """The pinned training-dtype gradient staging buffer, allocated at first use.

        Only host-state regions have one. With ``convert_on_device`` it is first needed by
        a backward that must add to a non-zero accumulator (accumulation over
        micro-batches); the allocation (``numel`` elements of pinned memory) happens then.
        """
        if not self.host_state:
            raise RuntimeError(f"region {self.index} keeps its state on the device: no staging")
        if self.grad_staging is None:
            self.grad_staging = alloc_host(self.numel, self.dtype, self._pin)
        return self.grad_staging

    def staging_slots(self) -> list[torch.Tensor]:
        """Each parameter's slot of :meth:`staging`, shaped like the parameter, in layout
        order: what one backward's gradients are copied into when every parameter has one.

        Made once per region and kept (the staging buffer never moves), so the gradient
        hook, which runs on the thread that drives backward, makes no slice or reshape per
        parameter per step.
        """
        if self._staging_slots is None:
            staging = self.staging()
            self._staging_slots = [
                staging[lay.offset : lay.offset + lay.numel].view(lay.shape) for lay in self.layouts
            ]
        return self._staging_slots

    def upload_copy(self) -> torch.Tensor:
        """The training-dtype host buffer that the next upload of a host-state region
        reads: ``host_params`` of an offloaded region, the staging buffer of a resident
        one (free once its gradient was read). Only without ``convert_on_device``."""
        if not self.host_state or self.convert_on_device:
            raise RuntimeError(
                f"region {self.index} uploads no training-dtype host copy (device state, or "
                "converted on the device)"
            )
        if self.host_params is not None:
            return self.host_params
        return self.master if self.master_is_upload_copy else self.staging()

    def materialize_grad(self) -> None:
        """Make ``grad`` hold the gradient: clear a stale buffer so that it reads as zeros,
        or widen a gradient still kept in the staging buffer (``grad_in_staging``)."""
        if self.grad_stale:
            self.grad.zero_()
            self.grad_stale = False
        elif self.grad_in_staging:
            self.grad.copy_(self.staging())
        self.grad_in_staging = False

    @property
    def state_on_device(self) -> bool:
        return not self.host_state

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Fill the master from full-precision ``tensors`` (by canonical name) and publish."""
        with torch.no_grad():
            for layout in self.layouts:
                src = tensors[layout.name]
                if tuple(src.shape) != tuple(layout.shape):
                    raise ValueError(
                        f"parameter {layout.name!r} has shape {tuple(src.shape)}, "
                        f"expected {tuple(layout.shape)}"
                    )
                self.master_views[layout.name].copy_(src)
            self.publish_now()

    def publish_now(self) -> None:
        """Copy the master into the training-dtype copies, synchronously.

        Used at set-up and after ``load_state_dict``; the optimizer's step publishes through
        the controller instead, so that uploads go on the h2d stream. An offloaded region
        without a host copy (``convert_on_device``) has nothing to do: its next upload
        reads the master.
        """
        self.upload_copy_fresh = False
        with torch.no_grad():
            if self.host_params is not None and not self.master_is_upload_copy:
                self.host_params.copy_(self.master)
            if not self.offloaded:
                self.device_params.copy_(self.master)


def _layouts(
    plan: RegionPlan,
    shapes: Mapping[str, torch.Size],
    aliases: Mapping[str, tuple[str, ...]],
    requires_grad: Mapping[str, bool],
) -> tuple[ParamLayout, ...]:
    out = []
    offset = 0
    # Trainable parameters first (see [Note: region storage]).
    names = sorted(plan.region.param_names, key=lambda n: not requires_grad.get(n, True))
    for name in names:
        shape = shapes[name]
        out.append(
            ParamLayout(
                name=name,
                aliases=aliases.get(name, (name,)),
                offset=offset,
                shape=shape,
                requires_grad=requires_grad.get(name, True),
            )
        )
        offset += math.prod(shape)
    return tuple(out)


def required_host_bytes(
    plan: Plan,
    dtype: torch.dtype,
    *,
    convert_on_device: bool = False,
    host_master_dtype: torch.dtype = MASTER_DTYPE,
    moment_bytes: float = 4.0,
) -> int:
    """Host bytes the storage will pin for ``plan``, the host Adam moments included
    (``moment_bytes`` each per trainable parameter; the streamed ring's are fp32 or bf16
    as on the host).

    With ``convert_on_device`` neither the training-dtype host copy nor the gradient
    staging buffer exists up front (the staging buffer is allocated if gradients are ever
    accumulated over micro-batches; not counted here). A host master in the training
    dtype (``host_master_dtype``) is its own upload copy.
    """
    elem = torch.empty(0, dtype=dtype).element_size()
    copies = 0 if convert_on_device else elem
    total = 0
    for rp in plan.regions:
        n = rp.region.numel
        own_copy = (
            rp.state is StatePlacement.HOST
            and host_master_dtype == dtype
            and host_master_dtype != MASTER_DTYPE
        )
        master = elem if own_copy else 4
        if rp.placement is not ParamPlacement.RESIDENT and not own_copy:
            total += n * copies  # host_params
        if rp.state is not StatePlacement.DEVICE:
            # master + grad (its dtype) + staging (dtype, unless converted on the device),
            # and two Adam moments for the trainable parameters only.
            total += n * (2 * master + copies) + int(rp.region.stepped_numel * 2 * moment_bytes)
    return total


def build_storage(
    plan: Plan,
    shapes: Mapping[str, torch.Size],
    tied_groups: Iterable[tuple[str, ...]],
    requires_grad: Mapping[str, bool],
    device: torch.device,
    dtype: torch.dtype,
    *,
    convert_on_device: bool = False,
    host_master_dtype: torch.dtype = MASTER_DTYPE,
    moment_bytes: float = 4.0,
) -> tuple[list[RegionStorage], torch.Tensor | None]:
    """Allocate every region's buffers and the device pool for the plan's offloaded regions.

    ``host_master_dtype``: the master's dtype in host-state regions that are not streamed
    (bf16 on the bf16-master rungs); ``moment_bytes``: bytes of one host Adam moment per
    parameter, for the host memory check. Raises ``RuntimeError`` before allocating
    anything when host memory cannot hold the host-resident state.
    """
    needed = required_host_bytes(
        plan,
        dtype,
        convert_on_device=convert_on_device,
        host_master_dtype=host_master_dtype,
        moment_bytes=moment_bytes,
    )
    available = available_host_memory_bytes()
    if needed > available:
        raise RuntimeError(
            f"host memory too small for this plan: it needs {needed / 2**30:.2f} GiB of host "
            f"memory for masters, gradients and optimizer state, but {available / 2**30:.2f} "
            "GiB is available. Raise the memory budget (more state stays on the device), "
            "free host memory, or train a smaller model."
        )
    aliases: dict[str, tuple[str, ...]] = {}
    for group in tied_groups:
        for member in group:
            aliases[member] = tuple(group)
    # Pool slots: regions that the plan put at the same pool offset share one slot.
    slot_of: dict[int, int] = {}
    slot_elems: dict[int, int] = {}
    next_slot = 0
    for rp in plan.regions:
        if rp.placement is ParamPlacement.RESIDENT:
            continue
        key = rp.pool_offset_bytes if rp.pool_offset_bytes is not None else -1 - rp.region.index
        if key not in slot_of:
            slot_of[key] = next_slot
            next_slot += 1
        slot = slot_of[key]
        elems = -(-rp.region.numel // _ALIGN_ELEMS) * _ALIGN_ELEMS
        slot_elems[slot] = max(slot_elems.get(slot, 0), elems)
    pool: torch.Tensor | None = None
    slot_start: dict[int, int] = {}
    if slot_elems:
        start = 0
        for slot in sorted(slot_elems):
            slot_start[slot] = start
            start += slot_elems[slot]
        pool = torch.empty(start, dtype=dtype, device=device)
    storages = []
    for rp in plan.regions:
        slot_tensor = None
        s: int | None = None
        if rp.placement is not ParamPlacement.RESIDENT:
            assert pool is not None
            key = rp.pool_offset_bytes if rp.pool_offset_bytes is not None else -1 - rp.region.index
            s = slot_of[key]
            slot_tensor = pool[slot_start[s] : slot_start[s] + slot_elems[s]]
        layouts = _layouts(rp, shapes, aliases, requires_grad)
        storages.append(
            RegionStorage(
                rp,
                layouts,
                device,
                dtype,
                slot_tensor,
                s,
                convert_on_device=convert_on_device,
                host_master_dtype=host_master_dtype,
            )
        )
    return storages, pool
