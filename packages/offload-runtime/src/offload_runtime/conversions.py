"""Dtype conversions on the device for host-state regions that convert there
(``convert_on_device``): fp32 masters narrowed after their upload, training-dtype
gradients widened before their copy down, a bounded chunk at a time.

Widening is exact and narrowing on the device rounds as a cast on the host does, so a
module converting here computes what one converting on the host computes, bit for bit;
the host then makes no conversion pass, at twice the PCIe bytes (measured: BENCHMARKS.md,
Decisions, "Dtype conversions on the device").
"""

from __future__ import annotations

import torch

from offload_runtime.storage import RegionStorage

CONVERT_CHUNK_NUMEL = 4 << 20
"""Elements converted at a time on the device with ``convert_on_device``: gradients widened
to fp32 before their d2h copy, fp32 masters uploaded before they are narrowed. One chunk's
fp32 copy, 16 MiB of device memory, exists at a time on each stream that converts (the
planner's 5% budget margin covers it)."""


def copy_up(st: RegionStorage, source: torch.Tensor | None = None) -> None:
    """Queue, on the current stream, the copy of region ``st``'s parameters to the device.

    ``source``: the host buffer to upload; default: the training-dtype host copy, or the
    fp32 master when there is none (``convert_on_device``). An fp32 source crosses in
    chunks of ``CONVERT_CHUNK_NUMEL`` elements that are narrowed on the device: each
    chunk's fp32 block is allocated on the current stream and dropped at once, so the next
    chunk reuses it in stream order and one chunk is all the device memory it takes.
    """
    if source is None:
        source = st.host_params if st.host_params is not None else st.master
    dst = st.device_params
    with torch.no_grad():
        if source.dtype == dst.dtype:
            dst.copy_(source, non_blocking=True)
            return
        for a in range(0, st.numel, CONVERT_CHUNK_NUMEL):
            b = min(st.numel, a + CONVERT_CHUNK_NUMEL)
            wide = source[a:b].to(dst.device, non_blocking=True)
            dst[a:b].copy_(wide)


def widen_down(flats: list[torch.Tensor], dst: torch.Tensor) -> None:
    """Queue, on the current stream, the copy of a region's flat training-dtype gradients
    (layout order, together exactly ``dst``'s elements) into ``dst``, its fp32 host
    accumulator, widened on the device.

    They are packed ``CONVERT_CHUNK_NUMEL`` elements at a time into one fp32 device block
    (one ``_foreach_copy_`` widens every piece of a chunk), which crosses in one copy. Each
    block is allocated on the current stream and dropped at once, so the next chunk reuses
    it in stream order and one chunk is all the device memory it takes. Per chunk that is
    a handful of calls instead of several per parameter: this runs on the thread that
    drives backward, between its kernels, and backward waits for it.
    """
    start = 0  # dst offset of the chunk being packed
    pieces: list[torch.Tensor] = []
    packed = 0
    for flat in flats:
        a = 0
        n = flat.numel()
        while a < n:
            take = min(n - a, CONVERT_CHUNK_NUMEL - packed)
            pieces.append(flat if take == n else flat[a : a + take])
            packed += take
            a += take
            if packed == CONVERT_CHUNK_NUMEL:
                _widen_chunk(pieces, packed, dst[start : start + packed])
                start += packed
                pieces, packed = [], 0
    if packed:
        _widen_chunk(pieces, packed, dst[start : start + packed])
        start += packed
    if start != dst.numel():
        raise AssertionError(f"gradients cover {start} of {dst.numel()} accumulator elements")


def _widen_chunk(pieces: list[torch.Tensor], numel: int, dst: torch.Tensor) -> None:
    wide = torch.empty(numel, dtype=dst.dtype, device=pieces[0].device)
    slots = torch.split_with_sizes(wide, [p.numel() for p in pieces])
    torch._foreach_copy_(list(slots), pieces)
    dst.copy_(wide, non_blocking=True)


__all__ = ["CONVERT_CHUNK_NUMEL", "copy_up", "widen_down"]
