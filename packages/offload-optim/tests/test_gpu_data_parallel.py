"""Data-parallel training on a GPU: two ranks share the one GPU over gloo (NCCL needs a
GPU a rank), so that the device side of sharded host state runs where it runs in
production: pinned host masters broadcast from their owners, device parameters refreshed
from them, device gradients reduced before their copy to the host. Multi-GPU speed is the
benchmark's (BENCHMARKS.md), not a test's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from data_parallel_ranks import same_everywhere, spawn, train

pytestmark = pytest.mark.gpu


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_on_one_gpu_end_where_one_process_ends(tmp_path: Path) -> None:
    """Each rank keeps only its own host-state regions' state (checked in each rank) and
    both end, bit-identical, where one process on the whole batch ends."""
    expected = train(0, 1, device="cuda")
    # cuBLAS picks its kernels by shape, so a rank's half batch rounds otherwise than the
    # whole one, and Adam's normalised steps carry that to a few weights just beyond the
    # CPU test's absolute tolerance.
    same_everywhere(spawn(tmp_path, 2, device="cuda"), expected, atol=1e-5)
