"""Dropping a module and its optimizer returns their memory at once: nothing of theirs sits
in a reference cycle that only the cyclic collector would free (on a GPU their device
memory would otherwise stay allocated, and a next model would be planned beside it)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Iterator

import pytest
import torch
from optim_helpers import batch, loss_of, plan_at_least_budget, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime.streams import HOST_WORKER_NAME


@pytest.fixture
def gc_enabled_again() -> Iterator[None]:
    try:
        yield
    finally:
        gc.enable()


def host_workers() -> int:
    return sum(t.name.startswith(HOST_WORKER_NAME) for t in threading.enumerate())


@pytest.mark.usefixtures("gc_enabled_again")
def test_a_dropped_module_and_optimizer_free_their_storage_and_threads_at_once() -> None:
    workers = host_workers()
    module = plan_at_least_budget(
        tiny_gpt2(), batch(0), dtype=torch.float32, host_worker=True, block_search_range_bytes=0
    )
    optimizer = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-3), module)
    for step in range(2):
        inp = batch(step)
        optimizer.backward(loss_of(module(**inp), inp["input_ids"]))
        optimizer.step()
        optimizer.zero_grad()
    assert any(st.host_state for st in module.storages)  # host steps on the worker
    assert host_workers() == workers + 1
    held = [weakref.ref(module.controller), weakref.ref(optimizer.optimizer)]
    held += [weakref.ref(st) for st in module.storages]
    held += [weakref.ref(s.exp_avg) for s in optimizer.optimizer._layout.regions.values()]
    # Planning leaves cyclic garbage of its own (traced graphs), some of it referring to
    # what the module runs: collected first, as a long run's collector would have. Then
    # the collector is off: what is freed now is freed by reference counts alone.
    gc.collect()
    gc.disable()
    del module, optimizer
    assert [ref() for ref in held] == [None] * len(held)
    deadline = time.monotonic() + 5
    while host_workers() > workers:
        assert time.monotonic() < deadline, "the host worker thread outlived its module"
        time.sleep(0.01)
