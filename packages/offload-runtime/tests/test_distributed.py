"""Who steps which region under data parallel (``offload_runtime.distributed``); training
across processes is tested in offload-optim's ``test_data_parallel.py``."""

from __future__ import annotations

import os

import pytest
import torch

from offload_runtime.distributed import (
    Sharding,
    across_ranks,
    any_rank,
    assign_owners,
    host_threads_per_rank,
)


def test_owners_balance_trainable_parameters_in_forward_order() -> None:
    # None: device state (every rank steps it); 0: nothing trainable (no owner either).
    owners = assign_owners([100, None, 60, 50, 0, 40, 10], 2)
    assert owners == (0, None, 1, 1, None, 0, 1)
    loads = [0, 0]
    for n, o in zip([100, None, 60, 50, 0, 40, 10], owners, strict=True):
        if o is not None:
            loads[o] += n or 0
    assert loads == [140, 120]
    # One rank owns everything; more ranks than regions leave some with none.
    assert assign_owners([5, 5], 1) == (0, 0)
    assert assign_owners([5, 5], 4) == (0, 1)


def test_a_sharding_says_what_each_rank_keeps() -> None:
    owners = (0, None, 1, 1, None, 0)
    zero, one = Sharding(0, 2, owners), Sharding(1, 2, owners)
    assert zero.owned == [0, 5] and one.owned == [2, 3]
    assert zero.elsewhere == {2, 3} and one.elsewhere == {0, 5}
    assert zero.describe() == (
        "data parallel: world size 2, rank 0 of 2 owns host-state regions [0, 5] (2 of 4: "
        "their optimizer state and host steps are on this rank) and steps regions [1, 4] as "
        "every rank does; gradients are averaged over the ranks"
    )
    assert Sharding(1, 2, (None, None)).describe() == (
        "data parallel: world size 2, rank 1 of 2 owns no regions: the plan keeps all "
        "optimizer state on the device, and every rank steps regions [0, 1]; gradients are "
        "averaged over the ranks"
    )


def test_one_process_answers_alone() -> None:
    total = torch.tensor(3.0)
    assert across_ranks(total, True, 2.0) is total
    assert any_rank(True) and not any_rank(False)


def test_each_rank_takes_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: set(range(16)), raising=False)
    assert host_threads_per_rank(4) == 4
    assert host_threads_per_rank(32) == 1
    # A launcher bound this rank to 3 cores already: all of them.
    monkeypatch.setattr(os, "sched_getaffinity", lambda _: {0, 1, 2}, raising=False)
    assert host_threads_per_rank(4) == 3
