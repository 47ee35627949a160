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

The per-operation levels of the memory model keep their form: operation ``j`` of region
``r`` sees ``base[r]`` (what earlier regions hold between their forward and backward:
their saved bytes under KEEP, their boundary under RECOMPUTE, nothing under HOST) plus
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

KEEP, RECOMPUTE, HOST = (
    ActivationPlacement.KEEP,
    ActivationPlacement.RECOMPUTE,
    ActivationPlacement.HOST,
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
    act_fwd: list[int]
    act_bwd: list[int]
    saved_bytes: list[int]
    """Per region, the saved bytes of its operations (what HOST moves each way)."""
    boundary_bytes: list[int]
    """Per region, what RECOMPUTE holds from its forward to its backward."""
    recompute: list[bool]
    host: list[bool]
    """Per region, whether its saved bytes go to the host (HOST with bytes to move)."""
    d2h_s: list[float]
    """Per region, seconds of its activations' copy down (HOST)."""
    h2d_s: list[float]
    """Per region, seconds of its activations' copy back (HOST)."""


def boundary_bytes(
    ops: Sequence[Operation],
    regions: Sequence[Region],
    activations: Sequence[ActivationPlacement] | None = None,
) -> list[int]:
    """Per region, what it holds from its forward to its backward under RECOMPUTE (see
    the note): the storages its operations read that were made before it, less those
    that an earlier RECOMPUTE region of ``activations`` (None: none) holds already."""
    if not any(op.reads for op in ops):
        return _approximate_boundary(ops, regions)
    sizes = [b for op in ops for b in op.out_storage_bytes]
    first = []  # per region, the number of the first storage it makes
    made = 0
    for reg in regions:
        first.append(made)
        for j in range(reg.op_start, reg.op_end):
            made += len(ops[j].out_storage_bytes)
    held: set[int] = set()
    out = []
    for r, reg in enumerate(regions):
        mine = {
            s
            for j in range(reg.op_start, reg.op_end)
            for s in ops[j].reads
            if s < first[r] and s not in held
        }
        out.append(sum(sizes[s] for s in mine if s < len(sizes)))
        if activations is not None and activations[r] is RECOMPUTE:
            held |= mine
    return out


def _approximate_boundary(ops: Sequence[Operation], regions: Sequence[Region]) -> list[int]:
    """A profile without ``Operation.reads``: the output of the operation just before
    the region's first, at most the region's saved bytes."""
    out = []
    for reg in regions:
        full = sum(ops[j].saved_bytes for j in range(reg.op_start, reg.op_end))
        edge = ops[reg.op_start - 1].fwd_out_bytes if reg.op_start > 0 else 0
        out.append(min(edge, full))
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
    base = 0
    full_bytes: list[int] = []
    edges = boundary_bytes(ops, regions, activations)
    for r, reg in enumerate(regions):
        acc = base
        for j in range(reg.op_start, reg.op_end):
            pre[j] = acc
            acc += ops[j].saved_bytes
        full = acc - base
        full_bytes.append(full)
        mode = activations[r]
        base += full if mode is KEEP else edges[r] if mode is RECOMPUTE else 0
    pre[n_ops] = base
    after = [pre[j] + op.saved_bytes for j, op in enumerate(ops)]
    host = [a is HOST and b > 0 for a, b in zip(activations, full_bytes, strict=True)]
    return ActivationLevels(
        saved_prefix=pre,
        saved_after=after,
        act_fwd=[pre[j] + op.fwd_out_bytes + op.fwd_tmp_bytes for j, op in enumerate(ops)],
        act_bwd=[after[j] + op.bwd_out_bytes + op.bwd_tmp_bytes for j, op in enumerate(ops)],
        saved_bytes=full_bytes,
        boundary_bytes=edges,
        recompute=[a is RECOMPUTE for a in activations],
        host=host,
        d2h_s=[hardware.d2h_time_s(b) if h else 0.0 for b, h in zip(full_bytes, host, strict=True)],
        h2d_s=[hardware.h2d_time_s(b) if h else 0.0 for b, h in zip(full_bytes, host, strict=True)],
    )


__all__ = ["ActivationLevels", "activation_levels", "boundary_bytes"]
