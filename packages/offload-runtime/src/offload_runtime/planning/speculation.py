"""How many host-state parameters may step speculatively: their undo buffers must fit in
the host memory the plan's host-resident state leaves (``OffloadConfig.host_memory_bytes``,
or what the machine has available)."""

from __future__ import annotations

import torch

from offload_solver import ParamPlacement, Plan, StatePlacement

SPECULATION_HOST_SHARE = 0.9
"""Share of the host memory left over that undo buffers may take: at plan time here, and
when ``offload_optim``'s ``HybridAdam.prepare_speculation`` allocates them (of the memory
available then)."""


def undo_bytes_per_param(moments: torch.dtype) -> int:
    """Host bytes of a speculative step's undo buffers per parameter: an fp32 master backup
    and a spare pair of moments (12 with fp32 moments, 8 with bf16)."""
    return 4 + 2 * moments.itemsize


def host_state_bytes(plan: Plan, moments: torch.dtype, dtype: torch.dtype) -> int:
    """Host bytes of ``plan``'s host-resident state beside undo buffers: per parameter of
    a region whose state is on the host (stepped there or streamed), its fp32 master and
    gradient accumulator, both moments for a trainable one, and, converting on the host,
    the training-dtype gradient staging and an offloaded region's training-dtype upload
    source."""
    total = 0
    for rp in plan.regions:
        if rp.state is StatePlacement.DEVICE:
            continue
        per = 8
        if not plan.options.convert_on_device:
            per += dtype.itemsize * (1 if rp.placement is ParamPlacement.RESIDENT else 2)
        total += rp.region.numel * per + rp.region.stepped_numel * 2 * moments.itemsize
    return total


def speculative_params_that_fit(
    plan: Plan, moments: torch.dtype, dtype: torch.dtype, host_bytes: int | None
) -> int | None:
    """Trainable host-state parameters of ``plan`` whose undo buffers fit in
    :data:`SPECULATION_HOST_SHARE` of ``host_bytes`` less the plan's host-resident state
    (:func:`host_state_bytes`),
    as whole regions in the order their gradients land (the last region in forward order
    first), up to the first that does not fit: the regions ``HybridAdam.prepare_speculation``
    gives buffers to. None when every host-stepped region fits, or ``host_bytes`` is None
    (unknown)."""
    host = sorted(
        (rp.region for rp in plan.regions if rp.state is StatePlacement.HOST),
        key=lambda r: -r.index,
    )
    if host_bytes is None:
        return None
    room = int((host_bytes - host_state_bytes(plan, moments, dtype)) * SPECULATION_HOST_SHARE)
    per = undo_bytes_per_param(moments)
    params = 0
    for region in host:  # counted in trainable parameters, as the solver counts them
        if (params + region.stepped_numel) * per > room:
            return params
        params += region.stepped_numel
    return None


__all__ = [
    "SPECULATION_HOST_SHARE",
    "host_state_bytes",
    "speculative_params_that_fit",
    "undo_bytes_per_param",
]
