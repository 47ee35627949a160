"""Data-parallel training through ``memory_optimize`` under ``torch.distributed`` (gloo on
the CPU): ranks that each train on a share of the batch, each stepping its own regions,
end where one process training on the whole batch ends ([Note: data parallel] in
``offload_runtime.distributed``); their distributed checkpoints resume on any number of
ranks ([Note: distributed checkpoints] in ``offload_optim.dist_checkpoint``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.multiprocessing as mp
from data_parallel_ranks import STEPS, same_everywhere, spawn, train


@pytest.mark.parametrize(
    ("world", "options"),
    [
        (2, {}),
        (4, {}),
        # Clipping at a norm below the gradients': the ranks agree on the global norm.
        (2, {"clip": 0.05}),
        # Every region on the device, device-state: gradients all-reduced, folded in
        # batches at the end of backward.
        (2, {"budget": -1}),
        # Two micro-batches a step, clipped: the norm of the owners' accumulated sums.
        (2, {"accumulate": 2, "clip": 0.05}),
    ],
    ids=["2", "4", "2-clip", "2-device", "2-accumulate-clip"],
)
def test_ranks_on_shares_of_the_batch_end_where_one_process_on_all_of_it_does(
    tmp_path: Path, world: int, options: dict[str, Any]
) -> None:
    """Each rank keeps and steps only its own host-state regions (checked in every rank:
    ``_check_sharding``) and ends with the weights one process ends with."""
    expected = train(0, 1, **options)
    same_everywhere(spawn(tmp_path, world, **options), expected)


def test_an_overflow_on_one_rank_skips_the_step_on_every_rank(tmp_path: Path) -> None:
    """fp16: rank 1's gradients of a region rank 0 steps overflow in step 1. Only rank 0
    sees the inf after the reduction, yet both ranks skip that step (and only it) and
    stay bit-identical."""
    files = spawn(tmp_path, 2, fp16_overflow_at=1)
    skipped = [(tmp_path / f"masters.{rank}.skipped").read_text() for rank in range(2)]
    assert skipped == [repr([False, True, False, False])] * 2
    ranks = [torch.load(f, weights_only=True) for f in files]
    for name, value in ranks[0].items():
        assert torch.equal(value, ranks[1][name]), name


def test_a_checkpoint_saved_on_two_ranks_resumes_on_four_and_on_one(tmp_path: Path) -> None:
    """Half the steps on 2 ranks, saved with ``save_distributed``; the other half resumed
    from it on 4 ranks, and in one process, end where the uninterrupted steps end."""
    expected = train(0, 1)
    saved, half = tmp_path / "ckpt", STEPS // 2
    spawn(tmp_path / "two", 2, steps=(0, half), save=str(saved))
    resumed_on_4 = spawn(tmp_path / "four", 4, steps=(half, STEPS), resume=str(saved))
    same_everywhere(resumed_on_4, expected)
    resumed = train(0, 1, steps=(half, STEPS), resume=str(saved))
    for name, want in expected.items():
        torch.testing.assert_close(resumed[name], want, rtol=1e-5, atol=1e-6, msg=name)


def test_a_rank_that_fails_mid_training_ends_every_rank(tmp_path: Path) -> None:
    """Rank 1 raises in its second step while rank 0 waits for it in a collective: the
    launcher ends both, and the error names the failed rank and its message."""
    with pytest.raises(mp.ProcessRaisedException, match="rank 1 fails in step 1"):
        spawn(tmp_path, 2, fail_at=1)


def test_an_optimizer_over_tensors_outside_the_module_is_refused(tmp_path: Path) -> None:
    """No rank averages the gradients of a tensor the module does not own."""
    spawn(tmp_path, 2, plain=True)
    for rank in range(2):
        error = (tmp_path / f"masters.{rank}.error").read_text()
        assert error.startswith("ValueError: data parallel: the HybridAdam steps 1 tensors")


def test_ranks_with_different_weights_are_refused(tmp_path: Path) -> None:
    spawn(tmp_path, 2, seed=1)
    for rank in range(2):
        error = (tmp_path / f"masters.{rank}.error").read_text()
        assert "the weights of ranks [1] differ from rank 0's" in error


def test_a_rank_whose_planning_fails_fails_every_rank(tmp_path: Path) -> None:
    """Rank 1's budget is too small: it raises the planner's error, and rank 0, instead of
    waiting for it in the next collective, raises an error that names it."""
    spawn(tmp_path, 2, fail_rank=1)
    own = (tmp_path / "masters.1.error").read_text()
    assert own.startswith("InfeasibleBudgetError: memory budget 1 bytes")
    other = (tmp_path / "masters.0.error").read_text()
    assert other.startswith("RuntimeError: data parallel: rank(s) [1] failed while planning")
    assert "InfeasibleBudgetError: memory budget 1 bytes" in other
