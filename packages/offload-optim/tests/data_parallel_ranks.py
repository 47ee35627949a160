"""What each rank of ``test_data_parallel.py`` runs: a module the spawned processes import
by name (the test module itself is imported under a path-derived name they cannot)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from optim_helpers import batch, loss_of, masters, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam, load_distributed, save_distributed
from offload_runtime import OffloadConfig, OffloadModule, default_cpu_profile, memory_optimize
from offload_solver import InfeasibleBudgetError, ParamPlacement

STEPS = 4
BATCH = 4


def _least_budget(model: torch.nn.Module, example: dict[str, torch.Tensor]) -> int:
    """The least budget the planner accepts for ``model`` (it offloads all it can there);
    the same on every rank, planned for the CPU default profile."""
    try:
        _build(model, example, 1)
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes
    raise AssertionError("the planner accepted a 1-byte budget")


def _build(model: torch.nn.Module, example: dict[str, torch.Tensor], budget: int) -> OffloadModule:
    return memory_optimize(
        model,
        example,
        budget,
        config=OffloadConfig(dtype=torch.float32),
        hardware=default_cpu_profile(),
        device="cpu",
        progress=False,
    )


def train(
    rank: int,
    world: int,
    seed: int = 0,
    budget: int = 0,
    *,
    clip: float = 0.0,
    steps: tuple[int, int] = (0, STEPS),
    save: str = "",
    resume: str = "",
    fail_at: int = -1,
) -> dict[str, torch.Tensor]:
    """Train steps ``range(*steps)`` on rows ``rank::world`` of each batch at ``budget``
    bytes (0: the least the planner accepts; -1: 100 times that, where every region
    stays on the device); the final masters. ``clip``: the clipping norm; ``resume``:
    first load this distributed checkpoint; ``save``: save one after the last step;
    ``fail_at``: raise in that step's backward instead."""
    share = BATCH // world

    def part(step: int) -> dict[str, torch.Tensor]:
        return {k: v[rank * share : (rank + 1) * share] for k, v in batch(step, BATCH).items()}

    model = tiny_gpt2(seed=seed)
    least = _least_budget(model, part(0))  # on every rank: it plans collectively
    module = _build(model, part(0), {0: least, -1: 100 * least}.get(budget, budget))
    if budget == 0:
        assert any(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions)
        # Host state to shard: every rank owns some.
        assert world == 1 or (module.sharding is not None and module.sharding.owned)
    if budget == -1:
        # Device state, its gradients folded in at the end of backward.
        assert module.controller.batched_device_regions
    # The ranks share this machine's host: each planned with its share of it.
    assert ("host shared by" in module.plan.hardware_name) == (world > 1)
    # The attention's key bias gets a gradient that is zero up to rounding (softmax ignores
    # a shift shared by all keys), and Adam's normalised step turns zeros rounded another
    # way into steps of up to lr: an eps well above that rounding keeps them small.
    adam = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-5)
    amp = AMPOptimizer(adam, module, clipping_norm=clip)
    _check_sharding(module, adam, rank, world)
    if resume:
        assert load_distributed(amp, resume) == {"done": steps[0]}
    before = masters(module)
    for step in range(*steps):
        amp.zero_grad()
        b = part(step)
        if step == fail_at:
            raise RuntimeError(f"rank {rank} fails in step {step}")
        amp.backward(loss_of(module(**b), b["input_ids"]))
        amp.step()
        if clip:
            report = amp.last_step
            assert report is not None and report.clip_coef < 1.0  # clipping did clip
    if save:
        save_distributed(amp, save, {"done": steps[1]})
    out = masters(module)
    assert any(not torch.equal(before[name], out[name]) for name in out)
    module.close()
    return out


def _check_sharding(module: OffloadModule, adam: HybridAdam, rank: int, world: int) -> None:
    """Each host-state region with trainable parameters has one owner, the only rank
    whose optimizer keeps its state and gradients; every rank keeps every device-state
    region's."""
    sharding = module.sharding
    if world == 1:
        assert sharding is None
        return
    assert sharding is not None and (sharding.rank, sharding.world) == (rank, world)
    for st in module.storages:
        owner = sharding.owners[st.index]
        if st.host_state and st.trainable_numel:
            assert owner is not None and 0 <= owner < world
            assert adam.has_region(st.index) == (owner == rank)
            # A region stepped elsewhere keeps no gradient buffers here.
            assert st.grad.numel() == (st.numel if owner == rank else 0)
        else:
            assert owner is None
            assert adam.has_region(st.index) == bool(st.trainable_numel)


def rank_main(rank: int, world: int, store: str, out: str, options: dict[str, Any]) -> None:
    """One rank of ``train(rank, world, **options)``: its final masters to ``out.RANK``,
    and the sharded regions it owns to ``out.RANK.owned``. Its error goes to
    ``out.RANK.error`` and it returns, or with ``fail_at`` in ``options`` it raises.
    ``options["seed"]`` is rank 1's seed (the others build from 0); ``fail_rank`` plans
    at a 1-byte budget."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    options = dict(options)
    seed = options.pop("seed", 0)
    if options.pop("fail_rank", -1) == rank:
        options["budget"] = 1
    if "fail_at" in options and rank != 1:
        options.pop("fail_at")
    try:
        final = train(rank, world, seed if rank == 1 else 0, **options)
        torch.save(final, f"{out}.{rank}")
    except Exception as exc:
        if "fail_at" in options:
            raise
        Path(f"{out}.{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
