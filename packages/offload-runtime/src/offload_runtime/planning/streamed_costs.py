"""What a streamed-state ring moves and holds: the costs the planner offers the solver
(:func:`streamed_step_costs`) and the ring ``offload_optim``'s ``HybridAdam`` builds to a
plan (:func:`ring_shape`). See [Note: streamed steps] in ``offload_optim/streamed/__init__.py``.

[Note: more slots to stage]
The backward stages one chunk per ring slot, so with :data:`STREAM_SLOTS` (3) it stages 3
chunks; the rest of the streamed regions' state goes up at the step boundary.
``streamed_step_costs(slots=N)`` plans a ring of N slots (chunks of the same size, within
the budget's tenth, so a small budget gets more, smaller chunks): N chunks staged in the
backward, the ring's N slots of device memory held from the staging hook, which the
planner counts. The optimizer builds its ring as the plan says (:func:`ring_shape`:
``staged_chunks`` slots of ``staged_chunk_numel``). A slot count other than the default
needs staging: a plan that stages nothing records no slot count. Values do not depend on
it. The simulator models the ring unpaced ([Note: paced ring] in
``offload_optim/streamed/ring.py``) and so
predicts no change from more slots (``python benchmarks/replay_bench.py --stream-slots
N`` replays recorded runs with N slots); whether the paced ring gains from them is for a
GPU run to say.
"""

from __future__ import annotations

import dataclasses

import torch

from offload_solver import StreamedStepCosts

STREAM_CHUNK_NUMEL = 16 << 20
"""Elements of a region streamed at a time (one slot of the ring)."""
STREAM_SLOTS = 3
"""Buffer sets in the ring: one uploading, one stepping, one downloading."""
RING_BUDGET_SHARE = 0.1
"""At most this share of the device budget goes to the ring when
:func:`streamed_step_costs` is given the budget (a 3 GiB budget: a ring of at most 0.3
GiB, where full chunks would take 0.81)."""
MIN_CHUNK_NUMEL = 1 << 16
"""The smallest chunk :func:`streamed_step_costs` sizes a ring to."""

MASTER_BYTES = 4


def _sizes(moments_dtype: torch.dtype, fp16_io: bool) -> tuple[int, int]:
    """(bytes of one moment, bytes of the gradient streamed up) per parameter: fp16 I/O
    streams the fp16 gradient from the staging buffer, otherwise the fp32 accumulator."""
    return moments_dtype.itemsize, (2 if fp16_io else 4)


def stream_slot_bytes(
    moments_dtype: torch.dtype,
    fp16_io: bool,
    *,
    chunk_numel: int = STREAM_CHUNK_NUMEL,
    slots: int = STREAM_SLOTS,
) -> int:
    """Device bytes the optimizer's ``StreamRing`` holds while it streams: per slot, master,
    moments, gradient (and the fp16 copy with ``fp16_io``) of ``chunk_numel`` elements,
    plus one set of fp32 work buffers for what is narrower than fp32."""
    moment, grad = _sizes(moments_dtype, fp16_io)
    per_slot = MASTER_BYTES + 2 * moment + grad + (2 if fp16_io else 0)
    work = (4 if grad < 4 else 0) + (8 if moment < 4 else 0)
    return chunk_numel * (slots * per_slot + work)


def streamed_step_costs(
    moments_dtype: torch.dtype,
    fp16_io: bool,
    *,
    budget_bytes: int | None = None,
    chunk_numel: int | None = None,
    write_resident: bool = True,
    stage_in_backward: bool = True,
    slots: int = STREAM_SLOTS,
) -> StreamedStepCosts:
    """What the optimizer's ``StreamRing`` moves per parameter and holds on the device,
    for the solver (``solve(streamed=...)``): pass the host moments' dtype and the plan's
    ``fp16_io``, and the device budget in bytes so that the ring takes at most
    ``RING_BUDGET_SHARE`` of it (chunks of ``STREAM_CHUNK_NUMEL`` elements at most,
    ``MIN_CHUNK_NUMEL`` at least). ``chunk_numel`` sets the chunk instead. The optimizer
    builds its rings to the plan's ``slot_bytes`` (:func:`chunk_numel_for`).
    ``write_resident`` (default True): a resident region's device step writes its new
    parameters on the device ([Note: writing resident parameters] in streamed/steps.py);
    False: they come down with its state and go up again after it. The optimizer follows
    the plan's choice. ``stage_in_backward`` (default True, the plan's
    ``PlanOptions.stage_in_backward``): the optimizer stages state in the backward, so the
    solver counts the master weights and moments of one chunk per ring slot going up in the
    backward, and the ring held from there ([Note: staging the state in backward] in
    ``offload_optim/streamed/ring.py``). ``slots`` (default
    :data:`STREAM_SLOTS`): buffer sets in the ring, and so, with staging, chunks staged
    in the backward; the optimizer builds its ring with the plan's (``staged_chunks``).
    Another count than the default needs ``stage_in_backward``: a plan without staging
    records no slot count for the optimizer to follow ([Note: more slots to stage])."""
    if isinstance(slots, bool) or not isinstance(slots, int) or slots < 2:
        raise ValueError(f"slots={slots!r} must be an int >= 2 (one copying, one stepping)")
    if chunk_numel is None:
        chunk_numel = STREAM_CHUNK_NUMEL
        if budget_bytes is not None:
            if budget_bytes <= 0:
                raise ValueError(f"budget_bytes={budget_bytes} must be > 0")
            per = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=1, slots=slots)
            cap = int(budget_bytes * RING_BUDGET_SHARE) // per
            chunk_numel = max(MIN_CHUNK_NUMEL, min(chunk_numel, cap))
    up, down = stream_copy_bytes(moments_dtype, fp16_io)
    slot = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=chunk_numel, slots=slots)
    costs = StreamedStepCosts(
        up_bytes_per_param=up,
        down_bytes_per_param=down,
        slot_bytes=slot,
        resident_down_bytes_per_param=resident_down_bytes(moments_dtype)
        if write_resident
        else None,
    )
    stage = stage_in_backward
    if slots != STREAM_SLOTS and not stage:
        raise ValueError(
            f"slots={slots} needs stage_in_backward: a plan that stages nothing records "
            f"no slot count, so the optimizer would build its ring of {STREAM_SLOTS}"
        )
    return with_stage_in_backward(costs, moments_dtype, fp16_io, stage, slots=slots)


def with_stage_in_backward(
    costs: StreamedStepCosts,
    moments_dtype: torch.dtype,
    fp16_io: bool,
    stage: bool = True,
    *,
    slots: int = STREAM_SLOTS,
) -> StreamedStepCosts:
    """``costs`` as an optimizer that stages (``stage``) with these moments and ``fp16_io``
    moves them, its ring ``slots`` buffer sets of ``costs.slot_bytes`` in all: with
    ``stage``, one chunk per ring slot (the chunk its ring builds from ``costs.slot_bytes``,
    :func:`chunk_numel_for`) of master weights and moments going up in the backward ([Note:
    staging the state in backward] in ``offload_optim/streamed/ring.py``); without, none."""
    if not stage:
        return dataclasses.replace(
            costs, staged_chunks=0, staged_chunk_numel=0, staged_bytes_per_param=0.0
        )
    return dataclasses.replace(
        costs,
        staged_chunks=slots,
        staged_chunk_numel=chunk_numel_for(costs.slot_bytes, moments_dtype, fp16_io, slots=slots),
        staged_bytes_per_param=float(resident_down_bytes(moments_dtype)),
    )


def ring_shape(
    costs: StreamedStepCosts | None, moments_dtype: torch.dtype, fp16_io: bool
) -> tuple[int, int]:
    """(chunk elements, slots) of the ring the optimizer builds for a plan with these
    streaming ``costs``: a staging plan's ``staged_chunks`` slots of its
    ``staged_chunk_numel`` elements (what the planner counted going up in the backward);
    otherwise :data:`STREAM_SLOTS` slots sized to ``costs.slot_bytes``; with no costs
    (streamed regions set by hand) :data:`STREAM_SLOTS` slots of
    :data:`STREAM_CHUNK_NUMEL`, read at the call (tests make it small)."""
    if costs is None:
        return STREAM_CHUNK_NUMEL, STREAM_SLOTS
    if costs.staged_chunks:
        return costs.staged_chunk_numel, costs.staged_chunks
    return chunk_numel_for(costs.slot_bytes, moments_dtype, fp16_io), STREAM_SLOTS


def chunk_numel_for(
    slot_bytes: int, moments_dtype: torch.dtype, fp16_io: bool, *, slots: int = STREAM_SLOTS
) -> int:
    """The chunk of a ring that holds ``slot_bytes`` device bytes (the inverse of
    :func:`stream_slot_bytes`, rounded down)."""
    per = stream_slot_bytes(moments_dtype, fp16_io, chunk_numel=1, slots=slots)
    if slot_bytes < per:
        raise ValueError(
            f"a ring of {slot_bytes} bytes holds no element ({per} bytes per element with "
            f"{slots} slots)"
        )
    return slot_bytes // per


def stream_copy_bytes(moments_dtype: torch.dtype, fp16_io: bool) -> tuple[int, int]:
    """(bytes up, bytes down) per streamed parameter and step: master, moments and
    gradient up; master, moments (and the fp16 copy with ``fp16_io``) down."""
    _, grad = _sizes(moments_dtype, fp16_io)
    state = resident_down_bytes(moments_dtype)
    return state + grad, state + (2 if fp16_io else 0)


def resident_down_bytes(moments_dtype: torch.dtype) -> int:
    """Bytes down per parameter of a resident streamed region whose device step writes
    its parameters on the device: master and moments only (the state every streamed
    region moves each way, :func:`stream_copy_bytes`)."""
    return MASTER_BYTES + 2 * moments_dtype.itemsize


WRITE_RESIDENT = True
"""Whether the optimizer, given a plan that recorded no streaming costs (streamed regions
set by hand, as tests do), writes resident streamed regions' parameters on the device;
with costs it does what they say (``StreamedStepCosts.resident_down_bytes_per_param``)."""
