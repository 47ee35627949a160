"""Where a HybridAdam's state lives: regions, their segments, and the buffers beside them.

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
fused CUDA Adam (the kernels: stepping.py). Parameters that are not OffloadModule masters
("plain" parameters) are stepped like ``torch.optim.AdamW(fused=True)`` would step them.

The ``state`` entries of the optimizer (what ``torch.optim`` shows per parameter) are
views of these buffers: ``step`` is the segment's count, ``exp_avg`` and ``exp_avg_sq``
the parameter's slices of its region's moments. A host-state region that may step
speculatively also has a :class:`Spare` set of buffers (see [Note: speculative steps] in
speculation.py).

On the 8-bit rung (``OffloadConfig.host_state="bf16_8bit"``) a host-state region's moments
are block-quantized codes with one fp32 scale per block of ``low_precision.QBLOCK``
elements. A block must not straddle two segments (each launch requantizes whole blocks),
so there each segment owns its codes and scales (``Segment.scales``) instead of slices of
region-wide buffers; ``state`` shows each parameter's slice of the codes and the
segment's scales (``exp_avg_scale``, ``exp_avg_sq_scale``).

Frozen parameters (``requires_grad=False`` in the model) get no state: their masters are
left out of the segments, and a region's moments cover only its trainable parameters,
which the runtime lays out first (see [Note: region storage]).
"""

from __future__ import annotations

from collections.abc import MutableMapping
from typing import TYPE_CHECKING, Any

import torch

from offload_runtime.host_kernels import AdamHyper, low_precision
from offload_runtime.storage import RegionStorage, alloc_host, region_of

if TYPE_CHECKING:
    from offload_runtime.controller import OffloadController

MOMENT_DTYPES = (torch.float32, torch.bfloat16, torch.uint8)
"""Storage dtypes of host moments: fp32, bf16, and the 8-bit rung's codes (``uint8``
names that rung; its first moment's codes are ``low_precision.QUANT_DTYPES[0]``)."""

ParamState = MutableMapping[torch.Tensor, Any]
"""The optimizer's ``state``: per parameter, its ``step``, ``exp_avg`` and ``exp_avg_sq``."""


class Segment:
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
        steps] in speculation.py); swapped with (``exp_avg``, ``exp_avg_sq``) when the
        step is committed."""
        self.spare_views: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()
        """``spare`` cut per parameter of ``views``, shaped like it (what ``state`` shows)."""
        self.scales: tuple[torch.Tensor, torch.Tensor] | None = None
        """8-bit moments (see [Note: region segments]): the per-block scales of
        ``exp_avg`` and ``exp_avg_sq``, which then hold codes."""


def hyper_of(seg: Segment, hypers: dict[int, AdamHyper] | None) -> AdamHyper:
    """Segment ``seg``'s hyperparameters: from a ``HybridAdam.hypers()`` snapshot, or its
    group's values now."""
    return AdamHyper.of_group(seg.group) if hypers is None else hypers[id(seg.group)]


class Spare:
    """A host-state region's buffers for speculative steps (see [Note: speculative steps]
    in speculation.py)."""

    def __init__(self, numel: int, moments_dtype: torch.dtype) -> None:
        # Pageable: the host step is their only reader and writer, nothing crosses PCIe.
        self.backup = torch.empty(numel, dtype=torch.float32)
        """The master as it was before the speculative step (of the stepped segments)."""
        self.exp_avg = torch.empty(numel, dtype=moments_dtype)
        self.exp_avg_sq = torch.empty(numel, dtype=moments_dtype)
        self.pending: list[tuple[Segment, float]] = []
        """Segments stepped speculatively and not yet committed, with their step count
        before that step."""


def attach_spare(spare: Spare, seg: Segment) -> None:
    """Point ``seg``'s spare moments (and their per-parameter views) into ``spare``."""
    stop = seg.start + seg.param.numel()
    seg.spare = (spare.exp_avg[seg.start : stop], spare.exp_avg_sq[seg.start : stop])
    views = []
    offset = 0
    for p in seg.views:
        n = p.numel()
        m, v = seg.spare
        views.append((m[offset : offset + n].view(p.shape), v[offset : offset + n].view(p.shape)))
        offset += n
    seg.spare_views = tuple(views)


class RegionAdamState:
    """One region's Adam state: its storage, moments, segments and spare buffers."""

    def __init__(self, storage: RegionStorage, moments_dtype: torch.dtype) -> None:
        self.storage = storage
        device = storage.master.device
        # A streamed region's moments cross PCIe at every step: pinned, as its master is,
        # and at their exact size (PyTorch's caching pinned allocator rounds a buffer up
        # to a power of two: up to twice the host memory).
        pin = storage.streamed and storage.master.is_pinned()
        n = storage.trainable_numel  # frozen parameters lie after it and get no state
        self.quantized = moments_dtype == torch.uint8
        """8-bit moments: each segment owns its codes and scales (see the note)."""
        if self.quantized:
            n = 0
            moments_dtype = torch.float32
        if pin:
            self.exp_avg = alloc_host(n, moments_dtype, pin=True).zero_()
            self.exp_avg_sq = alloc_host(n, moments_dtype, pin=True).zero_()
        else:
            self.exp_avg = torch.zeros(n, dtype=moments_dtype, device=device)
            self.exp_avg_sq = torch.zeros(n, dtype=moments_dtype, device=device)
        self.segments: list[Segment] = []
        self.spare: Spare | None = None
        """Allocated by ``HybridAdam.prepare_speculation`` (host-state regions only)."""

    @property
    def spare_bytes(self) -> int:
        """Host bytes :class:`Spare` takes: an fp32 master backup and two moment buffers."""
        return self.storage.trainable_numel * (4 + 2 * self.exp_avg.element_size())


def segment_has_grad(seg: Segment) -> bool:
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


class StateLayout:
    """Lays a HybridAdam's parameter groups out in regions and segments (see [Note: region
    segments]), once the module whose masters they may be is known; and the controller of
    that module, through which every region is stepped."""

    def __init__(self, moments_dtype: torch.dtype) -> None:
        self.moments_dtype = moments_dtype
        """Moments of host-resident state (device-resident moments are fp32)."""
        self.regions: dict[int, RegionAdamState] = {}
        self.region_list: list[int] = []
        """Sorted keys of ``regions``, kept with it."""
        self.plain: list[Segment] = []
        self.masters: dict[int, tuple[RegionStorage, str]] | None = None
        """The bound module's master views by ``id``, with their region and name."""
        self.controller: OffloadController | None = None
        """The bound module's controller (``HybridAdam.bind``)."""
        self.elsewhere: frozenset[int] = frozenset()
        """Regions another data-parallel rank steps: no state here (``Sharding``)."""
        self.laid_out = False

    def require_controller(self) -> OffloadController:
        """The bound module's controller; raises when the optimizer is not bound."""
        if self.controller is None:
            raise RuntimeError(
                "HybridAdam steps OffloadModule master weights only when bound to the module: "
                "call optimizer.bind(module), or wrap the optimizer in "
                "AMPOptimizer(optimizer, module)"
            )
        return self.controller

    def ensure(self, param_groups: list[dict[str, Any]], state: ParamState) -> None:
        """Lay every group out in segments (deferred until the module is known)."""
        if not self.laid_out:
            self.laid_out = True
            for group in param_groups:
                self.lay_out_group(group, state)

    def owner(self, p: torch.Tensor) -> tuple[RegionStorage, str] | None:
        """The region and parameter name whose master weights ``p`` is, if any."""
        if self.masters is not None:
            return self.masters.get(id(p))
        try:
            found = region_of(p) is not None
        except RuntimeError:
            # region_of's weak dictionary compares tensors with ==, which raises for a
            # registered multi-element tensor: that it raised means p is registered.
            found = True
        if found:
            raise RuntimeError(
                "HybridAdam got OffloadModule master weights but no module: call "
                "optimizer.bind(module), or wrap the optimizer in "
                "AMPOptimizer(optimizer, module)"
            )
        return None

    def lay_out_group(self, group: dict[str, Any], state: ParamState) -> None:
        by_region: dict[int, list[tuple[int, str, torch.Tensor]]] = {}
        for p in group["params"]:
            owner = self.owner(p)
            if owner is None:
                self._add_plain(group, p, state)
                continue
            st, name = owner
            if name in st.frozen or st.index in self.elsewhere:
                # Frozen: no gradient, no state, never stepped (as torch skips grad None);
                # or another rank steps it and shares its new weights.
                continue
            if st.index not in self.regions:
                dtype = self.moments_dtype if st.host_state else torch.float32
                if dtype == torch.uint8 and not st.master_is_upload_copy:
                    dtype = torch.bfloat16  # an fp32 master (streamed): bf16 moments
                self.regions[st.index] = RegionAdamState(st, dtype)
                self.region_list = sorted(self.regions)
            layout = next(lay for lay in st.layouts if lay.name == name)
            by_region.setdefault(st.index, []).append((layout.offset, name, p))
        for r, members in by_region.items():
            self._add_region_segments(
                group, self.regions[r], sorted(members, key=lambda m: m[0]), state
            )

    def _add_plain(self, group: dict[str, Any], p: torch.Tensor, state: ParamState) -> None:
        host_fp32 = p.device.type == "cpu" and p.dtype == torch.float32
        dtype = self.moments_dtype if host_fp32 else p.dtype
        m = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        v = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
        seg = Segment(group, (p,), p, m, v)
        self.plain.append(seg)
        state[p] = {"step": seg.step, "exp_avg": m, "exp_avg_sq": v}

    def _add_region_segments(
        self,
        group: dict[str, Any],
        rs: RegionAdamState,
        members: list[tuple[int, str, torch.Tensor]],
        state: ParamState,
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
            if rs.quantized:
                codes = low_precision.QUANT_DTYPES
                m = torch.zeros(stop - start, dtype=codes[0])
                v = torch.zeros(stop - start, dtype=codes[1])
                blocks = low_precision.quantized_numel(stop - start)
                scales = (torch.zeros(blocks), torch.zeros(blocks))
                base = start
            else:
                m = rs.exp_avg[start:stop]
                v = rs.exp_avg_sq[start:stop]
                base = 0
            seg = Segment(
                group,
                tuple(p for _, _, p in run),
                st.master[start:stop],
                m,
                v,
                grad=st.grad[start:stop],
                grad_views=tuple(st.grad_views[name] for _, name, _ in run),
                start=start,
                storage=st,
            )
            rs.segments.append(seg)
            if rs.spare is not None:
                attach_spare(rs.spare, seg)
            if rs.quantized:
                seg.scales = scales
            else:
                m, v = rs.exp_avg, rs.exp_avg_sq
            for offset, _, p in run:
                n = p.numel()
                at = offset - base
                state[p] = {
                    "step": seg.step,
                    "exp_avg": m[at : at + n].view(p.shape),
                    "exp_avg_sq": v[at : at + n].view(p.shape),
                }
                if seg.scales is not None:
                    state[p]["exp_avg_scale"] = seg.scales[0]
                    state[p]["exp_avg_sq_scale"] = seg.scales[1]

    def segments_with_grad(self, r: int) -> list[Segment]:
        """Region ``r``'s segments whose gradients are present (see
        :func:`segment_has_grad`)."""
        return [seg for seg in self.regions[r].segments if segment_has_grad(seg)]

    def all_segments(self) -> list[Segment]:
        """Every region's segments (in region-creation order), then the plain ones."""
        return [seg for rs in self.regions.values() for seg in rs.segments] + self.plain

    @torch.no_grad()
    def drop_grads(self, set_to_none: bool) -> tuple[list[torch.Tensor], list[RegionStorage]]:
        """``zero_grad``'s work on this thread: drop every gradient reference
        (``set_to_none``), or zero the gradients that are not a host-state region's flat
        accumulator; returns those accumulators (with their storages), which the host
        worker zeroes after the steps queued before them."""
        host: list[torch.Tensor] = []
        host_storages: list[RegionStorage] = []
        here: list[torch.Tensor] = []
        for rs in self.regions.values():
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
        for seg in self.plain:
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
        return host, host_storages
