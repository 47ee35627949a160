"""The one owner of every training stream and worker thread ([Note: streams and threads]
in streams.py): each is made once, at its first use, and closed in one place."""

from __future__ import annotations

import threading

import pytest
import torch

from offload_runtime.streams import NO_STREAM, make_streams


def test_each_thread_is_made_once_and_closed_with_its_owner() -> None:
    streams = make_streams(torch.device("cpu"))
    getters = (streams.host_worker, streams.speculation_thread, streams.issuing_thread)
    executors = [get() for get in getters]
    assert [get() for get in getters] == executors, "asked again: the same thread"
    names = [ex.submit(lambda: threading.current_thread().name).result() for ex in executors]
    assert [name.split("_")[0] for name in names] == [
        "offload-host",
        "offload-speculate",
        "offload-stream-issue",
    ]
    streams.close()
    streams.close()  # twice is harmless
    for ex in executors:
        with pytest.raises(RuntimeError):
            ex.submit(lambda: None)
    unused = make_streams(torch.device("cpu"))
    unused.close()
    with pytest.raises(RuntimeError, match="after the module was closed"):
        unused.issuing_thread()


def test_streams_on_the_cpu_are_no_ops() -> None:
    streams = make_streams(torch.device("cpu"))
    assert not streams.is_cuda
    assert streams.compute is streams.h2d is streams.d2h is NO_STREAM
    assert streams.ring_streams() == (NO_STREAM, NO_STREAM, NO_STREAM)
    assert streams.ring_streams() is streams.ring_streams(), "one triple for the module's life"
    assert streams.h2d.record().query()
    streams.close()
