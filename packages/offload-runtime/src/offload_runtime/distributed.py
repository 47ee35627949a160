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
- Optimizer state: sharded by region. Each host-state region with something to step
  has one *owner* (:func:`assign_owners`: in forward order, the rank that owns the
  fewest trainable parameters so far, so that every rank's regions spread over the
  backward). Only the owner keeps that region's Adam moments, brings its gradients down
  and steps it on the host; the other ranks' optimizers leave it out
  (:attr:`Sharding.elsewhere`), and they free its gradient buffers. Device-state regions
  are stepped on every rank: their state costs device memory the plan counts on every
  rank already, and their step is GPU work.
- Gradients: when a region's gradients are complete on the device, before they are
  folded into device state or copied to the host, they are averaged over the group:
  reduced to the owner of a sharded region (the others drop theirs), all-reduced for
  the rest (:func:`shard_host_state` installs the reducer: one collective per region, on
  the backward thread, in the backward's region order, which is the same on every rank).
- Global answers: the fp16 overflow check and the clipping norm combine every rank's
  partials over the regions it owns (device-state regions and plain parameters counted
  on rank 0 alone) with one all-gather (:func:`across_ranks`), so every rank decides the
  same skip and clip factor.
- Updated weights: once a step's host steps are done, each sharded region's master
  weights are broadcast from its owner (:func:`share_updates`, in region order) and the
  other ranks copy them into their training-dtype copies. Every rank therefore holds
  every master (4 bytes a parameter, 2 with bf16 masters) but only its regions' moments
  and gradient work. The broadcast waits for the host steps: the next forward does not
  overlap them under data parallel.
- Host share: the ranks of one machine share its cores and DRAM, so the planner plans
  each rank with its share of the host (``HardwareProfile.shared_host`` over
  :func:`ranks_on_this_host`), and, unless ``OffloadConfig.host_threads`` says otherwise,
  gives each rank its share of the cores as host threads (:func:`host_threads_per_rank`:
  ``torchrun`` sets ``OMP_NUM_THREADS=1``, which would step the host state on one core).
  The collectives are not in the simulation: on the CPU they are cheap, and no machine
  with several GPUs has measured them yet.

With one process, or without an initialised process group, nothing changes.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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


def host_threads_per_rank(ranks: int) -> int:
    """CPU threads for one of ``ranks`` processes on this machine: the cores this process
    may run on, divided among the ranks unless a launcher already bound it to fewer than
    the machine's (then all of them)."""
    every = os.cpu_count() or 1
    mine = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else every
    return mine if mine < every else max(1, mine // ranks)


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


@dataclass(frozen=True)
class Sharding:
    """Which rank steps each region of a data-parallel module (see [Note: data parallel])."""

    rank: int
    world: int
    owners: tuple[int | None, ...]
    """Per region: the rank that keeps and steps its host state; None where every rank
    steps it (device-state regions, and regions with no trainable parameter)."""

    @property
    def elsewhere(self) -> frozenset[int]:
        """Regions another rank steps: this rank keeps no optimizer state for them."""
        return frozenset(r for r, o in enumerate(self.owners) if o not in (None, self.rank))

    @property
    def owned(self) -> list[int]:
        """Sharded regions this rank steps, in forward order."""
        return [r for r, o in enumerate(self.owners) if o == self.rank]

    def describe(self) -> str:
        """One line: the world size and which regions this rank owns and steps."""
        sharded = sum(o is not None for o in self.owners)
        everywhere = [r for r, o in enumerate(self.owners) if o is None]
        if not sharded:
            return (
                f"data parallel: world size {self.world}, rank {self.rank} of {self.world} "
                "owns no regions: the plan keeps all optimizer state on the device, and "
                f"every rank steps regions {everywhere}; gradients are averaged over the ranks"
            )
        return (
            f"data parallel: world size {self.world}, rank {self.rank} of {self.world} owns "
            f"host-state regions {self.owned} ({len(self.owned)} of {sharded}: their "
            f"optimizer state and host steps are on this rank) and steps regions "
            f"{everywhere} as every rank does; gradients are averaged over the ranks"
        )


def assign_owners(trainable: Sequence[int | None], world: int) -> tuple[int | None, ...]:
    """An owner per region: ``trainable[r]`` is region ``r``'s number of trainable
    parameters where its state is sharded (host state), None where it is not. In forward
    order, each sharded region with parameters to step goes to the rank that owns the
    fewest so far (the lowest such rank on a tie)."""
    loads = [0] * world
    owners: list[int | None] = []
    for n in trainable:
        if not n:
            owners.append(None)
            continue
        rank = min(range(world), key=lambda k: (loads[k], k))
        loads[rank] += n
        owners.append(rank)
    return tuple(owners)


def _collective_device() -> torch.device:
    """Where the default group's collectives take tensors: the current GPU under NCCL,
    else the CPU."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def shard_host_state(module: OffloadModule) -> Sharding | None:
    """Shard ``module``'s host state over the default process group and reduce each
    region's gradients where they are stepped (see [Note: data parallel]); sets and
    returns ``module.sharding``. None (and nothing changes) with one rank."""
    size = world_size()
    if size == 1:
        return None
    rank = dist.get_rank()
    owners = assign_owners(
        [st.trainable_numel if st.host_state else None for st in module.storages], size
    )
    sharding = Sharding(rank, size, owners)
    module.sharding = sharding
    for r in sharding.elsewhere:
        module.storages[r].free_gradients()

    # gloo reduces CPU tensors only: with device gradients it all-reduces them instead.
    to_owner = dist.get_backend() != "gloo" or module.device.type == "cpu"

    def reduce(r: int, grads: Sequence[torch.Tensor]) -> bool:
        owner = owners[r]
        with torch.no_grad():
            flat = torch.cat([g.reshape(-1) for g in grads])
            flat.div_(size)
            if owner is not None and to_owner:
                dist.reduce(flat, dst=owner)
            else:
                dist.all_reduce(flat)
            if owner not in (None, rank):
                return False
            pieces = torch.split(flat, [g.numel() for g in grads])
            torch._foreach_copy_(
                list(grads), [p.view_as(g) for p, g in zip(pieces, grads, strict=True)]
            )
        return True

    module.controller.grad_reducer = reduce
    log.info("%s", sharding.describe())
    return sharding


def across_ranks(total: torch.Tensor, is_norm: bool, norm_type: float) -> torch.Tensor:
    """The group's answer from each rank's ``total`` over the gradients it counts (see
    [Note: data parallel]): the ``norm_type`` norm of the ranks' norms, or the sum of
    their L1 sums (the overflow check); on the CPU, the same on every rank."""
    if world_size() == 1:
        return total
    mine = total.detach().reshape(1).to(_collective_device(), torch.float32)
    parts = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(parts, mine)
    every = torch.cat(parts).cpu()
    return torch.linalg.vector_norm(every, norm_type) if is_norm else every.sum()


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` holds on any rank of the default process group (one all-reduce;
    ``flag`` itself with one rank): e.g. for every rank to stop after the same step."""
    if world_size() == 1:
        return flag
    t = torch.tensor([int(flag)], device=_collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


SHARE_CHUNK_BYTES = 64 << 20
"""Device staging for broadcasting host masters under NCCL, which takes device tensors."""


def _broadcast_host(t: torch.Tensor, src: int) -> None:
    """Broadcast the host tensor ``t`` from rank ``src``, through the collective device in
    chunks of at most :data:`SHARE_CHUNK_BYTES` where that is not the CPU."""
    device = _collective_device()
    if device.type == "cpu":
        dist.broadcast(t, src=src)
        return
    chunk = max(1, SHARE_CHUNK_BYTES // t.element_size())
    buf = torch.empty(min(chunk, t.numel()), dtype=t.dtype, device=device)
    mine = dist.get_rank() == src
    for start in range(0, t.numel(), chunk):
        piece = t[start : start + chunk]
        staged = buf[: piece.numel()]
        if mine:
            staged.copy_(piece)
        dist.broadcast(staged, src=src)
        if not mine:
            piece.copy_(staged)


def share_updates(module: OffloadModule, sharding: Sharding) -> None:
    """Give every rank the new master weights of each sharded region, from its owner, in
    region order, and refresh the training-dtype copies of those it does not own (see
    [Note: data parallel]). Call once the owners' steps are done."""
    with torch.no_grad():
        for r, owner in enumerate(sharding.owners):
            if owner is None:
                continue
            st = module.storages[r]
            _broadcast_host(st.master[: st.trainable_numel], owner)
            if owner != sharding.rank:
                st.publish_now()


__all__ = [
    "Sharding",
    "across_ranks",
    "agree",
    "any_rank",
    "assign_owners",
    "check_same_weights",
    "host_threads_per_rank",
    "plan_together",
    "ranks_on_this_host",
    "shard_host_state",
    "share_plan",
    "share_updates",
    "world_size",
]
