"""Every stream and worker thread of offloaded training, created in one place.

[Note: streams and threads]
One :class:`StreamSet` per ``OffloadModule`` owns them all; the runtime reaches it as
``controller.streams``, and an optimizer bound to the module asks it for the ones it
uses, never making its own. Each is made at its first use (the compute stream is the
caller's, taken when the module is built) and lives as long as the module;
:meth:`StreamSet.close` (``OffloadModule.close``) stops the threads, in one place.

Streams (device work; no-ops on a machine without CUDA, where "copies" are host-to-host
and run in program order):
- *compute*: the caller's current stream. Forward, backward, synchronous uploads (which
  block compute by design), the device-state regions' optimizer step and the optimizer's
  device partials of the step's answer run there.
- *h2d*: asynchronous prefetches of offloaded regions (issued ahead of their use, as the
  plan says) and the upload of a resident host-state region's new parameters after its
  host step (its publish, on the host worker). They overlap forward and backward
  compute; the compute stream waits for each on the device, by its event.
- *d2h*: each region's gradients to pinned host memory as soon as its backward ends,
  overlapping the backward of the regions before it in forward order.
- the ring's *up*, *step* and *down* streams (:meth:`StreamSet.ring_streams`; streamed
  host-state regions, ``offload_optim.streamed``): a chunk's state copied into a ring slot,
  stepped by the fused device Adam, and copied back, so that one slot uploads while
  another steps and a third downloads. They overlap the host steps of the other host-state
  regions and the next forward. One triple for the module's life: the caching allocator
  reuses a freed block only on the stream it was allocated on, so a ring on new streams
  each step would allocate anew each step, its reserved memory growing past the budget.
Cross-stream order is kept with events only (``wait_event``), never by a host
synchronisation, except where a comment flags a host sync point.

Threads (host work; each a one-thread executor, so its tasks run in submission order):
- the *host worker* (``offload-host``, :meth:`StreamSet.host_worker`): all host-side
  gradient work (wait for a region's d2h copy, widen or add it into the fp32
  accumulator), the optimizer's gradient-ready hooks that run behind it, and the
  optimizer steps ``step()`` queues. One FIFO thread keeps that work in backward order
  and off the thread that launches kernels, so the host step of a region overlaps the
  backward of the regions before it and, after backward, the next forward. A module built
  with ``host_worker=False`` (the default without CUDA) runs that work inline instead.
- the *speculation thread* (``offload-speculate``, :meth:`StreamSet.speculation_thread`;
  ``PlanOptions.speculation_thread``): the speculative fp16 host steps the hooks
  submit, so that the host worker keeps taking landed gradients while one runs and
  ``step()`` has its answer without waiting for the step in flight.
- the *issuing thread* (``offload-stream-issue``, :meth:`StreamSet.issuing_thread`): issues
  a step's streamed regions on the ring's streams (pacing the ring, which blocks it) and
  publishes those that land and cast nothing on the host, while the host worker steps the
  other host-state regions from the start.
What each optimizer thread may touch and when is in offload_optim/host_steps.py (the
order of a step's host work), [Note: speculative steps] in offload_optim/speculation.py
and [Note: streamed steps] in offload_optim/streamed/__init__.py. The hardware probes
(``offload_runtime.hardware``) make streams of their own to measure copy rates: that is
measurement, not training, and not owned here.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext

import torch


class Event:
    """A point in one stream's work; a no-op on the CPU."""

    def __init__(self, cuda_event: torch.cuda.Event | None) -> None:
        self._event = cuda_event

    def wait_on(self, stream: Stream) -> None:
        """Make ``stream``'s later work wait for this event (device-side, no host sync)."""
        if self._event is not None and stream.cuda is not None:
            stream.cuda.wait_event(self._event)

    def synchronize(self) -> None:
        """Block the calling host thread until the event has happened (a host sync point)."""
        if self._event is not None:
            self._event.synchronize()

    def query(self) -> bool:
        return True if self._event is None else bool(self._event.query())  # type: ignore[no-untyped-call]


class Stream:
    """A CUDA stream, or nothing on the CPU."""

    def __init__(self, cuda_stream: torch.cuda.Stream | None) -> None:
        self.cuda = cuda_stream

    def record(self) -> Event:
        """Record an event at the current end of this stream's queued work."""
        if self.cuda is None:
            return Event(None)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(self.cuda)
        return Event(event)

    def wait(self, event: Event | None) -> None:
        if event is not None:
            event.wait_on(self)

    def context(self) -> AbstractContextManager[object]:
        """Make this the current stream inside a ``with`` block."""
        if self.cuda is None:
            return nullcontext()
        return torch.cuda.stream(self.cuda)


RingStreams = tuple[Stream, Stream, Stream]
"""(up, step, down): the streams a streamed-state ring runs on ([Note: streams and
threads])."""

NO_STREAM = Stream(None)
"""The stream of a machine without CUDA: every operation on it is a no-op."""

HOST_WORKER_NAME = "offload-host"
SPECULATION_THREAD_NAME = "offload-speculate"
ISSUING_THREAD_NAME = "offload-stream-issue"
"""Thread name prefixes, as ``threading.current_thread().name`` shows them."""


class StreamSet:
    """The streams and worker threads of one OffloadModule (see [Note: streams and
    threads]): the one place that creates them, each at its first use, and closes them.

    Any thread may ask for any of them; creation is under a lock, so each is made once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        # Compute is whatever stream the caller runs the model on (usually the default),
        # taken now, when the module is built.
        self.compute = Stream(torch.cuda.current_stream(device)) if self._cuda else NO_STREAM
        self._lock = threading.Lock()
        self._h2d: Stream | None = None
        self._d2h: Stream | None = None
        self._ring: RingStreams | None = None
        self._host_worker: ThreadPoolExecutor | None = None
        self._speculation: ThreadPoolExecutor | None = None
        self._issuing: ThreadPoolExecutor | None = None
        self._closed = False

    @property
    def is_cuda(self) -> bool:
        return self._cuda

    def _new_stream(self) -> Stream:
        if not self._cuda:
            return NO_STREAM
        return Stream(torch.cuda.Stream(self.device))  # type: ignore[no-untyped-call]

    @property
    def h2d(self) -> Stream:
        """Prefetches and post-step uploads; overlaps forward and backward compute."""
        stream = self._h2d
        if stream is None:
            with self._lock:
                if self._h2d is None:
                    self._h2d = self._new_stream()
                stream = self._h2d
        return stream

    @property
    def d2h(self) -> Stream:
        """Gradients to the host; overlaps the backward of the regions that come after."""
        stream = self._d2h
        if stream is None:
            with self._lock:
                if self._d2h is None:
                    self._d2h = self._new_stream()
                stream = self._d2h
        return stream

    def ring_streams(self) -> RingStreams:
        """(up, step, down) of the streamed-state ring: one triple for the module's life,
        shared by every ring built on it (so that each ring reuses the last one's freed
        device memory)."""
        ring = self._ring
        if ring is None:
            with self._lock:
                if self._ring is None:
                    self._ring = (self._new_stream(), self._new_stream(), self._new_stream())
                ring = self._ring
        return ring

    def _executor(self, attr: str, name: str) -> ThreadPoolExecutor:
        executor: ThreadPoolExecutor | None = getattr(self, attr)
        if executor is not None:
            return executor
        with self._lock:
            executor = getattr(self, attr)
            if executor is None:
                if self._closed:
                    raise RuntimeError(
                        f"the {name} thread is asked for after the module was closed; "
                        "build a new module (memory_optimize) to train again"
                    )
                executor = ThreadPoolExecutor(1, thread_name_prefix=name)
                setattr(self, attr, executor)
            return executor

    def host_worker(self) -> ThreadPoolExecutor:
        """The host worker: host gradient work, gradient-ready hooks and queued optimizer
        steps, in submission order."""
        return self._executor("_host_worker", HOST_WORKER_NAME)

    def speculation_thread(self) -> ThreadPoolExecutor:
        """The thread speculative host steps run on, in submission order."""
        return self._executor("_speculation", SPECULATION_THREAD_NAME)

    def issuing_thread(self) -> ThreadPoolExecutor:
        """The thread a step's streamed regions are issued (and partly published) from."""
        return self._executor("_issuing", ISSUING_THREAD_NAME)

    def close(self) -> None:
        """Stop every worker thread once its queued work is done (blocks for it): the host
        worker first, since its tasks may wait for the other two, then the issuing and
        speculation threads. Later requests for a thread raise; closing twice is
        harmless."""
        with self._lock:
            self._closed = True
            executors = (self._host_worker, self._issuing, self._speculation)
        for executor in executors:
            if executor is not None:
                executor.shutdown(wait=True)


def make_streams(device: torch.device) -> StreamSet:
    """The owner of the streams and worker threads for ``device``; one per OffloadModule."""
    return StreamSet(device)
