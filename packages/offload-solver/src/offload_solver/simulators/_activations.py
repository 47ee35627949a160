"""What a region's activation handling (``ActivationPlacement``) does to the levels and
tasks of a simulated step ([Note: activations]).

[Note: activations]
Each region's activations, the saved bytes of its operations (``Operation.saved_bytes``;
[Note: memory model] in ``offload_solver.profile``), are handled one of three ways
(``SimulationContext.activations``, one per region; KEEP for all unless a solver or the
caller picks otherwise with ``SimulationContext.with_activations``):

- KEEP: held from the operation's forward to its backward, as the memory model says.
- RECOMPUTE: while the region's forward runs, its saved bytes accumulate as under KEEP
  (an upper bound: a checkpointed forward runs without saving, but its backward's
  recomputation re-creates them all at once anyway, so the peak is the same). When the
  forward ends only its inputs stay until its backward (``boundary_bytes``): every
  storage made before the region that its operations read (``Operation.reads``; a view
  holds its whole storage), counted once: a storage that an earlier RECOMPUTE region
  holds already costs nothing more. The model's own inputs and the parameters are held
  anyway and count nothing. A profile without reads approximates them by the
  ``fwd_out_bytes`` of the operation just before the region's first, at most the
  region's saved bytes. Just before the region's backward, once its parameters are on the
  device (after its upload or the wait for its prefetch), its forward runs again on the
  compute lane (a ``recompute`` task of the region's forward seconds) and re-creates
  its saved bytes at the levels of a forward; its backward then releases them operation
  by operation as under KEEP.
- HOST: when the region's forward ends its saved bytes are copied to the host on the
  D2H lane (``act_offload``, FIFO with the gradient copies) and stay on the device
  until that copy ends. They come back on the H2D lane (``act_fetch``) issued like a
  backward prefetch: at the backward issue point of the next region in forward order
  (the last region's own), after the parameter prefetches issued there, and not before
  the copy down has ended; the region's backward waits for it. The device holds them
  again from the copy back's start; from the region's backward start they are its
  backward's saved bytes as under KEEP.
- RECOMPUTE_WITH_PREVIOUS: a *run* is a RECOMPUTE region and the RECOMPUTE_WITH_PREVIOUS
  regions right after it. Each region of a run holds, from its forward to the run's
  backward, the storages its operations read that were made before the run's first
  region (counted once, as above): what the run makes itself is recomputed. Just before
  the backward of the run's last region, once that region's parameters are on the device
  (the others' are resident), the run's forward runs again from its first region on (one
  ``recompute`` task of the run's forward seconds), re-creating the saved bytes of every
  region of the run; each region's backward then releases its own. So during the
  backward of a region of a run the device also holds the saved bytes of the run's
  earlier regions (``saved_prefix_bwd``).

The per-operation levels of the memory model keep their form: operation ``j`` of region
``r`` sees ``base[r]`` (what earlier regions hold between their forward and backward:
their saved bytes under KEEP, their boundary if recomputed, nothing under HOST) plus
the saved bytes of the operations of ``r`` before it (``saved_prefix[j]``, and
``saved_after[j]`` once it has saved its own). HOST regions' bytes in flight are
time-dependent events instead: with any region not KEEP the peak is read off the memory
curve's walk (``_memory.curve_levels``), which applies them and the recomputations,
instead of the step's analytic running maximum. Not modelled: the ring of streamed-step
buffers' window levels (``_memory.stream_level``) see the levels above but not HOST
regions' copies in flight, nor recomputations; host-memory contention of activation
copies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from offload_solver.hardware import HardwareProfile
from offload_solver.plan import ActivationPlacement, Region
from offload_solver.profile import Operation

KEEP, RECOMPUTE, HOST, WITH_PREVIOUS = (
    ActivationPlacement.KEEP,
    ActivationPlacement.RECOMPUTE,
    ActivationPlacement.HOST,
    ActivationPlacement.RECOMPUTE_WITH_PREVIOUS,
)


@dataclass(frozen=True)
class ActivationLevels:
    """Per-operation activation levels and per-region activation costs of one choice of
    activation handling (see the note)."""

    saved_prefix: list[int]
    """Per operation ``j``: ``base`` of its region plus the saved bytes of its region's
    operations before ``j``; entry ``n_ops`` is what all regions hold at the end of the
    forward."""
    saved_after: list[int]
    """Per operation: ``saved_prefix[j]`` plus its own saved bytes."""
    saved_prefix_bwd: list[int]
    """Per operation, ``saved_prefix`` as its backward (and its recomputation) sees it:
    in a region of a run, with the saved bytes of the run's earlier regions, which the
    run's recomputation re-created, in place of their boundaries."""
    act_rec: list[int]
    """Per operation, its level while a recomputation runs it forward again."""
    saved_after_bwd: list[int]
    """Per operation, ``saved_prefix_bwd[j]`` plus its own saved bytes: what stays once a
    recomputation has run it."""
    act_fwd: list[int]
    act_bwd: list[int]
    saved_bytes: list[int]
    """Per region, the saved bytes of its operations (what HOST moves each way)."""
    boundary_bytes: list[int]
    """Per region, what RECOMPUTE holds from its forward to its backward."""
    recompute: list[bool]
    """Per region, whether a recomputation runs right before its backward (a RECOMPUTE
    region that no region chains onto, or the last region of a run)."""
    recompute_from: list[int]
    """Per region where ``recompute`` holds, the first region of what runs again (itself
    unless it ends a run); -1 elsewhere."""
    host: list[bool]
    """Per region, whether its saved bytes go to the host (HOST with bytes to move)."""
    d2h_s: list[float]
    """Per region, seconds of its activations' copy down (HOST)."""
    h2d_s: list[float]
    """Per region, seconds of its activations' copy back (HOST)."""


def run_starts(activations: Sequence[ActivationPlacement]) -> list[int]:
    """Per region, the first region of the run it belongs to (itself unless it is
    RECOMPUTE_WITH_PREVIOUS)."""
    out: list[int] = []
    for r, mode in enumerate(activations):
        out.append(out[r - 1] if mode is WITH_PREVIOUS and r > 0 else r)
    return out


@dataclass(frozen=True)
class StorageReads:
    """Which storages each region reads, from a profile with ``Operation.reads``."""

    reads: list[frozenset[int]]
    """Per region, the numbers of the storages its operations read."""
    first: list[int]
    """Per region, the number of the first storage it makes."""
    sizes: list[int]
    """Per storage number, its bytes."""

    @classmethod
    def of(cls, ops: Sequence[Operation], regions: Sequence[Region]) -> StorageReads | None:
        """None for a profile without reads."""
        if not any(op.reads for op in ops):
            return None
        first, reads = [], []
        made = 0
        for reg in regions:
            first.append(made)
            mine = range(reg.op_start, reg.op_end)
            made += sum(len(ops[j].out_storage_bytes) for j in mine)
            reads.append(frozenset(s for j in mine for s in ops[j].reads))
        return cls(reads, first, [b for op in ops for b in op.out_storage_bytes])

    def held(self, r: int, since: int, skip: set[int]) -> set[int]:
        """The storages region ``r`` reads that were made before region ``since``, less
        ``skip``."""
        limit = self.first[since]
        return {s for s in self.reads[r] if s < limit and s not in skip}

    def bytes(self, storages: set[int]) -> int:
        return sum(self.sizes[s] for s in storages if s < len(self.sizes))


def boundary_bytes(
    ops: Sequence[Operation],
    regions: Sequence[Region],
    activations: Sequence[ActivationPlacement] | None = None,
) -> list[int]:
    """Per region, what it holds from its forward to its backward when recomputed (see
    the note): the storages its operations read that were made before it (before its
    run's first region, if it is RECOMPUTE_WITH_PREVIOUS), less those that an earlier
    recomputed region of ``activations`` (None: none) holds already."""
    reads = StorageReads.of(ops, regions)
    if reads is None:
        return approximate_boundary(ops, regions, activations)
    start = run_starts(activations) if activations is not None else range(len(regions))
    held: set[int] = set()
    out = []
    for r in range(len(regions)):
        mine = reads.held(r, start[r], held)
        out.append(reads.bytes(mine))
        if activations is not None and activations[r] in (RECOMPUTE, WITH_PREVIOUS):
            held |= mine
    return out


def approximate_boundary(
    ops: Sequence[Operation],
    regions: Sequence[Region],
    activations: Sequence[ActivationPlacement] | None,
) -> list[int]:
    """A profile without ``Operation.reads``: the output of the operation just before
    the region's first, at most the region's saved bytes (nothing for a
    RECOMPUTE_WITH_PREVIOUS region, whose input its run makes)."""
    out = []
    for r, reg in enumerate(regions):
        full = sum(ops[j].saved_bytes for j in range(reg.op_start, reg.op_end))
        edge = ops[reg.op_start - 1].fwd_out_bytes if reg.op_start > 0 else 0
        chained = activations is not None and activations[r] is WITH_PREVIOUS
        out.append(0 if chained else min(edge, full))
    return out


def activation_levels(
    ops: Sequence[Operation],
    regions: Sequence[Region],
    hardware: HardwareProfile,
    activations: Sequence[ActivationPlacement],
) -> ActivationLevels:
    """The levels and costs of ``activations`` (one per region; see the note)."""
    n_ops = len(ops)
    pre = [0] * (n_ops + 1)
    pre_b = [0] * (n_ops + 1)
    base = 0
    full_bytes: list[int] = []
    edges = boundary_bytes(ops, regions, activations)
    start = run_starts(activations)
    run_base = 0  # in a run: base at its first region plus the saved bytes of the run so far
    for r, reg in enumerate(regions):
        if start[r] == r:
            run_base = base
        acc, acc_b = base, run_base
        for j in range(reg.op_start, reg.op_end):
            pre[j], pre_b[j] = acc, acc_b
            acc += ops[j].saved_bytes
            acc_b += ops[j].saved_bytes
        full = acc - base
        full_bytes.append(full)
        mode = activations[r]
        base += full if mode is KEEP else edges[r] if mode in (RECOMPUTE, WITH_PREVIOUS) else 0
        run_base += full
    pre[n_ops] = pre_b[n_ops] = base
    after = [pre[j] + op.saved_bytes for j, op in enumerate(ops)]
    after_b = [pre_b[j] + op.saved_bytes for j, op in enumerate(ops)]
    host = [a is HOST and b > 0 for a, b in zip(activations, full_bytes, strict=True)]
    n_reg = len(regions)
    recompute = [
        a in (RECOMPUTE, WITH_PREVIOUS)
        and not (r + 1 < n_reg and activations[r + 1] is WITH_PREVIOUS)
        for r, a in enumerate(activations)
    ]
    return ActivationLevels(
        saved_prefix=pre,
        saved_after=after,
        saved_prefix_bwd=pre_b,
        act_rec=[pre_b[j] + op.fwd_out_bytes + op.fwd_tmp_bytes for j, op in enumerate(ops)],
        saved_after_bwd=after_b,
        act_fwd=[pre[j] + op.fwd_out_bytes + op.fwd_tmp_bytes for j, op in enumerate(ops)],
        act_bwd=[after_b[j] + op.bwd_out_bytes + op.bwd_tmp_bytes for j, op in enumerate(ops)],
        saved_bytes=full_bytes,
        boundary_bytes=edges,
        recompute=recompute,
        recompute_from=[start[r] if rec else -1 for r, rec in enumerate(recompute)],
        host=host,
        d2h_s=[hardware.d2h_time_s(b) if h else 0.0 for b, h in zip(full_bytes, host, strict=True)],
        h2d_s=[hardware.h2d_time_s(b) if h else 0.0 for b, h in zip(full_bytes, host, strict=True)],
    )


__all__ = [
    "ActivationLevels",
    "StorageReads",
    "activation_levels",
    "approximate_boundary",
    "boundary_bytes",
    "run_starts",
]
