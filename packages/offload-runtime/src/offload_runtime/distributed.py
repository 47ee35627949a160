"""Data-parallel training of an offloaded module over ``torch.distributed``.

[Note: data parallel]
Each rank of a process group trains the same module on its own share of the batch:

- Weights: every rank must start from the same weights (build the model from one seed, or
  load one checkpoint); :func:`check_same_weights` compares a checksum of each rank's and
  names the ranks that differ.
- Plan: one plan for all ranks. Each rank traces and plans (planning reads this rank's
  hardware profile), and the ranks agree on the outcome (:func:`agree`: a rank whose
  planning failed raises its error, the others an error naming it, instead of waiting
  for it in the next collective); :func:`share_plan` then gives every rank rank 0's
  plan, so that all ranks offload, prefetch and recompute the same regions and issue
  their collectives in the same order.
- Gradients: when a region's gradients are complete on the device, before they are
  folded into device state or copied to the host, they are averaged over the group
  (:func:`average_gradients`: one all-reduce per region, on the backward thread, in the
  backward's region order, which is the same on every rank). Every rank then sees the
  gradient of the mean loss over the group's batch, and the optimizer's overflow check,
  clipping norm and steps, which read only those gradients, agree on every rank.
- Optimizer state: replicated. Every rank steps every region, so host-state regions
  cost every rank the host time and memory of a whole step, on cores and DRAM the ranks
  of one machine share: the planner plans each rank with its share of the host
  (``HardwareProfile.shared_host`` over :func:`ranks_on_this_host`). Sharding host state
  by region (each rank stepping only the regions it owns and sharing the updated
  weights) is not built.

With one process, or without an initialised process group, nothing changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from offload_solver import Plan

if TYPE_CHECKING:  # planning imports this module
    from offload_runtime.module import OffloadModule
    from offload_runtime.planning import PlannedModel

log = logging.getLogger(__name__)


def world_size() -> int:
    """Ranks of the default process group; 1 without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def ranks_on_this_host() -> int:
    """Ranks of the default process group on this machine (``torchrun``'s
    ``LOCAL_WORLD_SIZE``; every rank where it is not set); 1 without a group."""
    size = world_size()
    if size == 1:
        return 1
    return int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))


def _weights_digest(model: torch.nn.Module) -> str:
    """A checksum of ``model``'s parameters and buffers (names, shapes, dtypes, bytes)."""
    digest = hashlib.sha256()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            digest.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            if t.device.type != "meta":
                digest.update(t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def check_same_weights(model: torch.nn.Module) -> None:
    """Raise ``ValueError`` naming the ranks whose weights differ from rank 0's (see
    [Note: data parallel]); a no-op with one rank."""
    if world_size() == 1:
        return
    digests: list[str | None] = [None] * world_size()
    dist.all_gather_object(digests, _weights_digest(model))
    differ = [rank for rank, d in enumerate(digests) if d != digests[0]]
    if differ:
        raise ValueError(
            f"data parallel: the weights of ranks {differ} differ from rank 0's; build the "
            "model from the same seed (or load the same checkpoint) on every rank"
        )


def agree(failure: BaseException | None, what: str) -> None:
    """Every rank's outcome of ``what`` (``failure``: this rank's error, None if it
    succeeded), so that no rank goes on to a collective that a failed rank never joins.
    Re-raise this rank's own error; where only other ranks failed, raise
    ``RuntimeError`` naming them and the first one's message. A no-op (re-raising
    ``failure``) with one rank."""
    if world_size() == 1:
        if failure is not None:
            raise failure
        return
    mine = None if failure is None else f"{type(failure).__name__}: {failure}"
    outcomes: list[str | None] = [None] * world_size()
    dist.all_gather_object(outcomes, mine)
    if failure is not None:
        raise failure
    failed = [rank for rank, outcome in enumerate(outcomes) if outcome is not None]
    if failed:
        raise RuntimeError(
            f"data parallel: rank(s) {failed} failed while {what}; the first said: "
            f"{outcomes[failed[0]]}"
        )


def plan_together(plan: Callable[[], PlannedModel]) -> PlannedModel:
    """``plan()`` on this rank, the ranks agreeing on its outcome (:func:`agree`), then
    rank 0's plan (:func:`share_plan`); ``plan()`` alone with one rank."""
    try:
        planned = plan()
    except Exception as exc:
        agree(exc, "planning")  # raises exc
        raise
    agree(None, "planning")
    return share_plan(planned)


def share_plan(planned: PlannedModel) -> PlannedModel:
    """``planned`` with rank 0's plan (see [Note: data parallel]); itself with one rank.

    Raises:
        ValueError: rank 0's plan has another number of regions than this rank's (the
            ranks traced different models or inputs).
    """
    if world_size() == 1:
        return planned
    box: list[str | None] = [planned.plan.to_json() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    text = box[0]
    assert text is not None
    plan = Plan.from_json(text)
    if len(plan.regions) != len(planned.plan.regions):
        raise ValueError(
            f"data parallel: rank 0 planned {len(plan.regions)} regions and rank "
            f"{dist.get_rank()} {len(planned.plan.regions)}; every rank must trace the "
            "same model with inputs of the same shapes"
        )
    return dataclasses.replace(planned, plan=plan)


def average_gradients(module: OffloadModule) -> None:
    """Average each region's gradients over the default process group as the backward
    completes them (see [Note: data parallel]); a no-op with one rank."""
    size = world_size()
    if size == 1:
        return

    def reduce(_: int, grads: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(size)
            dist.all_reduce(flat)
            pieces = torch.split(flat, [g.numel() for g in grads])
            torch._foreach_copy_(
                list(grads), [p.view_as(g) for p, g in zip(pieces, grads, strict=True)]
            )

    module.controller.grad_reducer = reduce
    log.info(
        "data parallel: world size %d, rank %d; every rank steps all %d regions (optimizer "
        "state replicated)",
        size,
        dist.get_rank(),
        len(module.storages),
    )


__all__ = [
    "agree",
    "average_gradients",
    "check_same_weights",
    "plan_together",
    "ranks_on_this_host",
    "share_plan",
    "world_size",
]
