"""The step's global answers, combined from per-region partials: the fp16 overflow check
and the gradient norm that clipping scales by (see [Note: overlapping the host step with
backward] in overlap.py for who computes which partial, and when)."""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import torch

if TYPE_CHECKING:
    from offload_optim.hybrid_adam import HybridAdam

CLIP_EPS = 1e-6
"""Added to the norm before dividing, as ``torch.nn.utils.clip_grad_norm_`` does."""


def partials_of(grads: list[torch.Tensor], norm_type: float, as_norm: bool) -> list[torch.Tensor]:
    """Each gradient's share of a global answer, as 0-dim fp32 tensors on its device.

    One ``torch._foreach_norm`` call for all of ``grads`` (which share a device): a
    reduction launched per gradient made the answer CPU-bound with many small regions.
    ``as_norm``: their ``norm_type`` norms (for clipping). Otherwise their L1 norms, finite
    exactly when every element is (the overflow check): fp16 gradients are at most 65504
    per element and micro-batch, so the fp32 sum of any model that fits in memory cannot
    overflow by itself. A gradient's partial does not depend on the other tensors of the
    call (on the CPU each is reduced alone; CUDA's multi-tensor kernel reduces each
    tensor's chunks in a fixed order), so partials computed one region at a time in the
    grad-ready hooks equal those computed together after backward.
    """
    ord_ = norm_type if as_norm else 1.0
    return list(torch._foreach_norm(grads, ord_, dtype=torch.float32))


def combine(
    optimizer: HybridAdam,
    norm_type: float,
    *,
    as_norm: bool,
    regions: set[int],
    device_parts: dict[int, list[torch.Tensor]],
    partials: dict[int, torch.Tensor],
    replicated: bool = True,
) -> tuple[torch.Tensor, bool]:
    """Combine every gradient's partial: (total on the CPU, whether it is a norm).

    ``as_norm``: ``norm_type`` norms (clipping, or a norm asked for), else L1 partials (the
    overflow check). ``regions``: those whose gradients arrived; regions with
    ``device_parts`` count too (DEVICE_ANSWER: their gradients may still be in flight). A
    host-state region's partials are its ``device_parts`` when the window took them, else
    its hook's (``partials``); the rest are computed here, one batched call per device.
    They are combined in region order whoever computed them, so that the total does not
    depend on the overlap. Reads one value per device back to the host: a sync point.
    ``replicated=False`` leaves out device-state regions and plain parameters, which
    every data-parallel rank steps, so that one rank alone counts them
    (``offload_runtime.distributed.across_ranks`` then combines the ranks' totals).
    """
    # Per device: (slot -> partial) in region order; missing ones computed below.
    slots: dict[torch.device, list[torch.Tensor | None]] = {}
    missing: dict[torch.device, tuple[list[int], list[torch.Tensor]]] = {}
    for r in sorted(regions | set(device_parts)):
        if not optimizer.has_region(r):
            continue
        if not replicated and not optimizer.region_storage(r).host_state:
            continue
        if r in device_parts:
            for dpart in device_parts[r]:
                slots.setdefault(dpart.device, []).append(dpart)
            continue
        grad = optimizer.region_grad(r)
        part = partials.get(r)
        device_slots = slots.setdefault(grad.device, [])
        if part is None:
            where, grads = missing.setdefault(grad.device, ([], []))
            where.append(len(device_slots))
            grads.append(grad)
        device_slots.append(part)
    for g in optimizer.plain_grads() if replicated else ():
        where, grads = missing.setdefault(g.device, ([], []))
        device_slots = slots.setdefault(g.device, [])
        where.append(len(device_slots))
        grads.append(g)
        device_slots.append(None)
    for device, (where, grads) in missing.items():
        for i, part in zip(where, partials_of(grads, norm_type, as_norm), strict=True):
            slots[device][i] = part
    if not slots:
        return torch.zeros(()), as_norm
    host = torch.cat(
        [torch.stack(cast(list[torch.Tensor], parts)).to("cpu") for parts in slots.values()]
    )
    if as_norm:
        return torch.linalg.vector_norm(host, norm_type), True
    return host.sum(), False


def clip_coefficient(max_norm: float, unscaled: torch.Tensor) -> float:
    """The factor that brings a finite gradient norm ``unscaled`` down to ``max_norm``
    (at most 1), as ``torch.nn.utils.clip_grad_norm_`` computes it."""
    return float((max_norm / (unscaled + CLIP_EPS)).clamp(max=1.0))
