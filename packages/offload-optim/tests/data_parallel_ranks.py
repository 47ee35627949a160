"""What each rank of ``test_data_parallel.py`` runs: a module the spawned processes import
by name (the test module itself is imported under a path-derived name they cannot)."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from optim_helpers import batch, loss_of, masters, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam
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


def train(rank: int, world: int, seed: int = 0, budget: int = 0) -> dict[str, torch.Tensor]:
    """Train ``STEPS`` steps on rows ``rank::world`` of each batch at ``budget`` bytes
    (0: the least the planner accepts); the final masters."""
    share = BATCH // world

    def part(step: int) -> dict[str, torch.Tensor]:
        return {k: v[rank * share : (rank + 1) * share] for k, v in batch(step, BATCH).items()}

    model = tiny_gpt2(seed=seed)
    least = _least_budget(model, part(0))  # on every rank: it plans collectively
    module = _build(model, part(0), budget or least)
    assert any(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions)
    # The ranks share this machine's host: each planned with its share of it.
    assert ("host shared by" in module.plan.hardware_name) == (world > 1)
    # The attention's key bias gets a gradient that is zero up to rounding (softmax ignores
    # a shift shared by all keys), and Adam's normalised step turns zeros rounded another
    # way into steps of up to lr: an eps well above that rounding keeps them small.
    adam = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-5)
    amp = AMPOptimizer(adam, module)
    before = masters(module)
    for step in range(STEPS):
        amp.zero_grad()
        b = part(step)
        amp.backward(loss_of(module(**b), b["input_ids"]))
        amp.step()
    out = masters(module)
    assert any(not torch.equal(before[name], out[name]) for name in out)
    module.close()
    return out


def rank_main(rank: int, world: int, store: str, out: str, seed: int, fail_rank: int) -> None:
    """One rank: its final masters to ``out.RANK``, or the error it raised to
    ``out.RANK.error``. Rank 1 builds its model from ``seed`` (the others from 0), and rank
    ``fail_rank`` plans at a 1-byte budget."""
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        final = train(rank, world, seed if rank == 1 else 0, 1 if rank == fail_rank else 0)
        torch.save(final, f"{out}.{rank}")
    except Exception as exc:
        Path(f"{out}.{rank}.error").write_text(f"{type(exc).__name__}: {exc}")
    finally:
        dist.destroy_process_group()
