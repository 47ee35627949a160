"""Data-parallel training through ``memory_optimize`` under ``torch.distributed`` (gloo on
the CPU): ranks that each train on a share of the batch end where one process training on
the whole batch ends ([Note: data parallel] in ``offload_runtime.distributed``)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).parent))

from optim_helpers import batch, loss_of, masters, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig, OffloadModule, default_cpu_profile, memory_optimize
from offload_solver import InfeasibleBudgetError, ParamPlacement

STEPS = 4
BATCH = 4


def _least_budget(model: torch.nn.Module, example: dict[str, torch.Tensor]) -> int:
    """The least budget the planner accepts for ``model`` (it offloads all it can there);
    the same on every rank, planned for the CPU default profile."""
    with pytest.raises(InfeasibleBudgetError) as info:
        _build(model, example, 1)
    return info.value.least_budget_bytes


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


def _train(rank: int, world: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Train ``STEPS`` steps on rows ``rank::world`` of each batch; the final masters."""
    share = BATCH // world

    def part(step: int) -> dict[str, torch.Tensor]:
        return {k: v[rank * share : (rank + 1) * share] for k, v in batch(step, BATCH).items()}

    model = tiny_gpt2(seed=seed)
    module = _build(model, part(0), _least_budget(model, part(0)))
    assert any(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions)
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


def _rank_main(rank: int, world: int, store: str, out: str, seed: int) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        # Rank 1 builds its model from another seed when asked to: the check must say so.
        torch.save(_train(rank, world, seed if rank == 1 else 0), f"{out}.{rank}")
    except ValueError as exc:
        Path(f"{out}.{rank}.error").write_text(str(exc))
    finally:
        dist.destroy_process_group()


def _spawn(tmp_path: Path, world: int, seed: int = 0) -> list[Path]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "masters"
    mp.spawn(_rank_main, args=(world, str(tmp_path / "store"), str(out), seed), nprocs=world)
    return [tmp_path / f"masters.{rank}" for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_shares_of_the_batch_end_where_one_process_on_all_of_it_does(
    tmp_path: Path, world: int
) -> None:
    expected = _train(0, 1)
    files = _spawn(tmp_path, world)
    ranks = [torch.load(f, weights_only=True) for f in files]
    for name, want in expected.items():
        for rank, got in enumerate(ranks):
            # Every rank holds the same weights, bit for bit.
            assert torch.equal(got[name], ranks[0][name]), (rank, name)
        torch.testing.assert_close(ranks[0][name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_ranks_with_different_weights_are_refused(tmp_path: Path) -> None:
    _spawn(tmp_path, 2, seed=1)
    for rank in range(2):
        error = (tmp_path / f"masters.{rank}.error").read_text()
        assert "the weights of ranks [1] differ from rank 0's" in error
