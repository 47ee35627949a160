"""Every stream and event the runtime uses, created in one place.

[Note: streams]
Three streams order the device work of an offloaded step:
- the *compute* stream is the caller's current stream: forward, backward, synchronous
  uploads (which block compute by design) and device optimizer steps run there;
- the *h2d* stream carries asynchronous prefetches of offloaded regions and the upload of
  updated parameters after a host optimizer step, so that they overlap compute;
- the *d2h* stream carries gradients to pinned host memory as each region finishes its
  backward, so that the copies overlap the backward of earlier regions.
Cross-stream order is kept with events only (``wait_event``), never with a host
synchronisation. On a machine without CUDA every stream is a no-op and every event is
complete at once: "copies" are host-to-host and run in program order.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

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


@dataclass(frozen=True)
class StreamSet:
    """The compute, h2d and d2h streams of one device (see [Note: streams])."""

    device: torch.device
    compute: Stream
    h2d: Stream
    d2h: Stream

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"


def make_streams(device: torch.device) -> StreamSet:
    """Create the runtime's streams for ``device``; called once per OffloadModule."""
    if device.type != "cuda":
        none = Stream(None)
        return StreamSet(device=device, compute=none, h2d=none, d2h=none)
    return StreamSet(
        device=device,
        # Compute is whatever stream the caller runs the model on (usually the default).
        compute=Stream(torch.cuda.current_stream(device)),
        # Overlaps prefetches and post-step parameter uploads with forward/backward compute.
        h2d=Stream(torch.cuda.Stream(device)),  # type: ignore[no-untyped-call]
        # Overlaps gradient offload with the backward of the regions that come after.
        d2h=Stream(torch.cuda.Stream(device)),  # type: ignore[no-untyped-call]
    )
