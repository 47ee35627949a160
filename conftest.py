"""Hygiene for tests marked ``gpu``: each starts and ends with the device memory of the
tests before it released.

Training state is full of reference cycles (autograd graphs, hooks that point back at the
runtime), which only the cyclic garbage collector frees; without it one test's gigabytes
stay allocated into the next and its peak-memory or out-of-memory outcome depends on the
order the tests ran in. A failed test's traceback is also kept in ``sys.last_traceback``
(for post-mortem debugging), holding that test's tensors alive.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator

import pytest


def _release_device_memory() -> None:
    sys.last_traceback = None
    sys.last_value = None
    gc.collect()
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


@pytest.fixture(autouse=True)
def _gpu_memory_hygiene(request: pytest.FixtureRequest) -> Iterator[None]:
    if request.node.get_closest_marker("gpu") is None:
        yield
        return
    _release_device_memory()
    yield
    _release_device_memory()
