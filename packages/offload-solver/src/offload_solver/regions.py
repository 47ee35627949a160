"""Linearise a profile's operations into regions and choose the device-pool block size.

[Note: regions]
Operations run in the profile's order; a region is a contiguous run of them together with
the parameters whose storage it owns. Building them takes three steps:

1. Linearise. A new region starts at an operation that uses a parameter (tied groups
   resolved to the group's first member) that no region owns yet, provided the current
   region already owns one. Operations before the first parameter use join region 0. A
   region owns the parameters first used inside it, so tied storage is owned, and counted,
   once. Parameters no operation uses are given to the last region so their storage is
   still counted on the device.
2. Pin. A region is pinned when a parameter it owns is read by an operation outside its
   own operations (GPT-2's ``wte`` read again by ``lm_head``): releasing it after its own
   operations would break the later reader, so solvers keep it resident. Pinned regions
   never join the device pool, so they take no part in the block-size search or merging.
3. Pack. Offloaded regions live in a device pool of equal blocks, one region per block, so
   a block must hold the largest region. For each block size ``B`` the runs of consecutive
   non-pinned regions (pinned regions split runs) are packed in order into blocks, a block
   closing when the next region does not fit; the waste is the unused bytes of all blocks,
   ``blocks(B) * B - total``. The block size with least waste is chosen among
   ``max_size + k * step`` for ``k * step <= search range`` (smallest on ties), and the
   regions packed into one block are merged into one region, which therefore never exceeds
   the block.

The reference scans every candidate. :func:`search_block_size` gives the same answer
without the scan: the block count is non-increasing in ``B`` (a larger block never ends
a packed block earlier), and for a fixed count the waste grows with ``B``, so only the
smallest ``B`` reaching each count can be the minimum; those are found by bisection, and
counts that cannot beat the best waste so far are skipped with one evaluation.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass

from offload_solver.plan import Region
from offload_solver.profile import ModelProfile

BLOCK_SEARCH_STEP_BYTES = 1024
"""Granularity of the block-size search (the reference's 1 KiB)."""
BLOCK_SEARCH_RANGE_BYTES = 128 * 2**20
"""How far above the largest region the block-size search looks (the reference's 128 MiB)."""


@dataclass(frozen=True)
class RegionLayout:
    """The regions of a profile and the device-pool block size chosen for them."""

    regions: tuple[Region, ...]
    block_size_bytes: int
    """Bytes of one pool block; every non-pinned region fits in one block."""
    wasted_bytes: int
    """Unused bytes when the pre-merge regions are packed into blocks of that size."""


def linearise(profile: ModelProfile) -> tuple[Region, ...]:
    """Split the operations into regions at parameter boundaries (steps 1-2 of the note)."""
    canon = profile.canonical_names()
    params = profile.parameter_map
    owner: dict[str, int] = {}
    bounds: list[list[int]] = [[0, 0]]
    owned: list[list[str]] = [[]]
    for i, op in enumerate(profile.operations):
        new: list[str] = []
        for name in op.param_names:
            c = canon[name]
            if c not in owner and c not in new:
                new.append(c)
        if new and owned[-1]:
            bounds[-1][1] = i
            bounds.append([i, 0])
            owned.append([])
        for c in new:
            owner[c] = len(owned) - 1
        owned[-1].extend(new)
    bounds[-1][1] = len(profile.operations)
    for p in profile.parameters:
        c = canon[p.name]
        if c not in owner:
            owner[c] = len(owned) - 1
            owned[-1].append(c)

    pinned = [False] * len(owned)
    for i, op in enumerate(profile.operations):
        for name in op.param_names:
            r = owner[canon[name]]
            if not bounds[r][0] <= i < bounds[r][1]:
                pinned[r] = True
    return tuple(
        Region(
            index=r,
            op_start=bounds[r][0],
            op_end=bounds[r][1],
            param_names=tuple(names),
            numel=sum(params[c].numel for c in names),
            size_bytes=sum(params[c].size_bytes for c in names),
            pinned=pinned[r],
            trainable_numel=sum(params[c].numel for c in names if params[c].trainable),
            trainable_size_bytes=sum(params[c].size_bytes for c in names if params[c].trainable),
        )
        for r, names in enumerate(owned)
    )


def _runs(regions: Sequence[Region]) -> list[list[Region]]:
    """Maximal runs of consecutive non-pinned regions."""
    runs: list[list[Region]] = [[]]
    for reg in regions:
        if reg.pinned:
            if runs[-1]:
                runs.append([])
        else:
            runs[-1].append(reg)
    return [run for run in runs if run]


def block_waste_bytes(runs: Sequence[Sequence[int]], block_size_bytes: int) -> int:
    """Unused bytes when each run of sizes is packed in order into blocks of the given size.

    A block closes when the next size does not fit in what is left of it; every size must
    be at most ``block_size_bytes``. This is the plain definition the fast search is tested
    against.
    """
    waste = 0
    for run in runs:
        if not run:
            continue
        left = 0
        for size in run:
            if left + size > block_size_bytes:
                waste += block_size_bytes - left
                left = 0
            left += size
        waste += block_size_bytes - left
    return waste


def search_block_size_brute_force(
    runs: Sequence[Sequence[int]],
    step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
    range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
) -> int:
    """The reference's scan: every candidate from the largest size upward, least waste wins."""
    sizes = [s for run in runs for s in run]
    if not sizes:
        return 0
    start = max(sizes)
    best_size, best_waste = start, block_waste_bytes(runs, start)
    for k in range(1, range_bytes // step_bytes + 1):
        size = start + k * step_bytes
        waste = block_waste_bytes(runs, size)
        if waste < best_waste:
            best_size, best_waste = size, waste
    return best_size


def search_block_size(
    runs: Sequence[Sequence[int]],
    step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
    range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
) -> int:
    """Same answer as :func:`search_block_size_brute_force`, without the scan (see the note)."""
    if step_bytes <= 0 or range_bytes < 0:
        raise ValueError(
            f"block search step_bytes={step_bytes} and range_bytes={range_bytes}: "
            "the step must be > 0 and the range >= 0"
        )
    sizes = [s for run in runs for s in run]
    if not sizes:
        return 0
    start = max(sizes)
    total = sum(sizes)
    prefixes: list[list[int]] = []
    for run in runs:
        acc = [0]
        for s in run:
            acc.append(acc[-1] + s)
        if len(acc) > 1:
            prefixes.append(acc)

    def count(k: int) -> int:
        """Blocks used at candidate ``k``: each block takes the longest prefix that fits."""
        cap = start + k * step_bytes
        n = 0
        for acc in prefixes:
            i, m = 0, len(acc) - 1
            while i < m:
                i = bisect_right(acc, acc[i] + cap, i + 1) - 1
                n += 1
        return n

    last_k = range_bytes // step_bytes
    n = count(0)
    best_k, best_waste = 0, n * start - total
    n_end = count(last_k)
    lo = 0  # the smallest candidate reaching the last count found: later ones lie above it
    n -= 1
    while n >= n_end:
        # A count of n (or fewer) beats the best only at a size below (best + total) / n.
        room = best_waste + total - n * start
        if room <= 0:
            n -= 1
            continue
        k_hi = min(last_k, (room - 1) // (n * step_bytes))
        if k_hi < lo or count(k_hi) > n:
            n -= 1
            continue
        a, b = lo, k_hi
        while a < b:
            mid = (a + b) // 2
            if count(mid) <= n:
                b = mid
            else:
                a = mid + 1
        lo = a
        c = count(a)
        waste = c * (start + a * step_bytes) - total
        if waste < best_waste:
            best_k, best_waste = a, waste
        n = c - 1
    return start + best_k * step_bytes


def build_regions(
    profile: ModelProfile,
    *,
    step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
    range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
) -> RegionLayout:
    """Regions of ``profile`` after the block-size search and merging (see the note)."""
    initial = linearise(profile)
    runs = _runs(initial)
    sizes = [[reg.size_bytes for reg in run] for run in runs]
    block = search_block_size(sizes, step_bytes, range_bytes)
    waste = block_waste_bytes(sizes, block) if runs else 0

    groups: list[list[Region]] = []
    run_of = {reg.index: i for i, run in enumerate(runs) for reg in run}
    fill = 0
    for reg in initial:
        if reg.pinned:
            groups.append([reg])
            continue
        prev = groups[-1][-1] if groups else None
        same_run = prev is not None and run_of.get(prev.index) == run_of[reg.index]
        if same_run and fill + reg.size_bytes <= block:
            groups[-1].append(reg)
            fill += reg.size_bytes
        else:
            groups.append([reg])
            fill = reg.size_bytes

    merged = [
        Region(
            index=i,
            op_start=group[0].op_start,
            op_end=group[-1].op_end,
            param_names=tuple(n for reg in group for n in reg.param_names),
            numel=sum(reg.numel for reg in group),
            size_bytes=sum(reg.size_bytes for reg in group),
            pinned=group[0].pinned,
            trainable_numel=sum(reg.stepped_numel for reg in group),
            trainable_size_bytes=sum(reg.stepped_size_bytes for reg in group),
        )
        for i, group in enumerate(groups)
    ]
    return RegionLayout(regions=tuple(merged), block_size_bytes=block, wasted_bytes=waste)


__all__ = [
    "BLOCK_SEARCH_RANGE_BYTES",
    "BLOCK_SEARCH_STEP_BYTES",
    "RegionLayout",
    "block_waste_bytes",
    "build_regions",
    "linearise",
    "search_block_size",
    "search_block_size_brute_force",
]
