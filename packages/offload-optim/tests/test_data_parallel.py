"""Data-parallel training through ``memory_optimize`` under ``torch.distributed`` (gloo on
the CPU): ranks that each train on a share of the batch end where one process training on
the whole batch ends ([Note: data parallel] in ``offload_runtime.distributed``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from data_parallel_ranks import rank_main, train


def _spawn(tmp_path: Path, world: int, seed: int = 0, fail_rank: int = -1) -> list[Path]:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    out = tmp_path / "masters"
    args = (world, str(tmp_path / "store"), str(out), seed, fail_rank)
    mp.spawn(rank_main, args=args, nprocs=world)
    return [tmp_path / f"masters.{rank}" for rank in range(world)]


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_on_shares_of_the_batch_end_where_one_process_on_all_of_it_does(
    tmp_path: Path, world: int
) -> None:
    expected = train(0, 1)
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


def test_a_rank_whose_planning_fails_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1's budget is too small: it raises the planner's error, and rank 0, instead of
    waiting for it in the next collective, raises an error that names it."""
    _spawn(tmp_path, 2, fail_rank=1)
    own = (tmp_path / "masters.1.error").read_text()
    assert own.startswith("InfeasibleBudgetError: memory budget 1 bytes")
    other = (tmp_path / "masters.0.error").read_text()
    assert other.startswith("RuntimeError: data parallel: rank(s) [1] failed while planning")
    assert "InfeasibleBudgetError: memory budget 1 bytes" in other
