"""Host-state regions stepped on the device (the plan's ``StatePlacement.STREAMED``).

[Note: streamed steps]
A streamed region keeps its fp32 master and Adam moments in pinned host memory, as a
host-state region does, and its gradient comes down to the host as one's does; but its
Adam step runs on the device. Chunk by chunk (``STREAM_CHUNK_NUMEL`` elements), through a
ring of ``STREAM_SLOTS`` device buffer sets (:class:`~offload_optim.streamed.ring.StreamRing`)
on three streams of its own, which the module's ``StreamSet`` owns
(``StreamSet.ring_streams``; [Note: streams and threads] in offload_runtime/streams.py):

- *up* (h2d): master, moments and gradient of the chunk into a free slot;
- *step*: the gradient and narrow moments widened to fp32 work buffers, torch's fused
  Adam(W) (the kernel device-state regions use), the moments narrowed back and, with fp16
  I/O, the new master narrowed into the slot's fp16 copy;
- *down* (d2h): master, moments (and the fp16 copy, into the region's upload copy) back
  to their host buffers; the slot is free again once they land.

Per parameter with bf16 moments and fp16 I/O that is 10 bytes up and 10 down over PCIe
and no host pass at all, against the host kernel's 20 bytes of host-memory traffic. So
the device and the host step different regions at the same time, which is the point:
the host is the bound of a step whose state is mostly on the host, and the PCIe link is
mostly idle while the host steps (BENCHMARKS.md, Decisions, "Streamed host state").

step()'s host task hands its streamed regions to a thread of their own, the *issuing
thread* (the module's ``StreamSet.issuing_thread``), which issues them in forward order
while the host worker steps the other host-state regions from the start: issuing is
Python and CUDA calls per chunk, taken off the thread that bounds host-heavy steps. The
issuing thread paces the ring ([Note: paced ring] in streamed/ring.py) and publishes what
lands ([Note: the issuing thread publishes] in streamed/queue.py). The queue takes
entries from that thread under a lock. The ring stays open while the thread issues:
between its host steps the task checks whether the thread is done, and the ring closes at
the first check after that once every streamed region has landed. With
``OverlapMode.DEVICE_ANSWER`` a region whose gradients land after the step's answer is
stepped by its own hook instead; a streamed one is only issued there, on the host worker
(``HybridAdam.issue_region``, unpaced), into the same ring and queue, and published once
landed, at a later hook or in the task that ``step()`` queues behind the last hook. The
hook does not wait for the device: the copies of one region take longer than its host
step would.

Values: widening is exact and the narrowing rounds to nearest even, as the host kernels
do, and the update is torch's fused kernel: bit for bit what torch's host kernel
computes, and within rounding (about 1e-7 of an update) of ``"single_pass"``. A streamed
region never steps speculatively (it steps after the step's answer, so nothing needs
undoing), and after its step the region's fp32 gradient accumulator still holds the
gradient as it was (loss scale included): the device divided its own copy.

Device memory: the ring's buffers exist only while a task streams: allocated on the step
stream when the task issues its first streamed region (or the backward stages), freed as
soon as its last streamed region is published (not at the end of the task: the planner
counts the ring until the last download, and a ring held into the next forward would
add to that forward's peak). :func:`stream_slot_bytes` says how many bytes. Every ring
runs on the same streams, so that the caching allocator hands the next ring the last
one's blocks. On a machine without CUDA the "device" is the CPU and every copy runs at
once, in order: the same values, for tests.

The package, by job:
- ``offload_runtime.planning.streamed_costs``: what a ring moves and holds, for the
  planner (``streamed_step_costs``) and for the ring the optimizer builds to the plan;
- :mod:`~offload_optim.streamed.ring`: :class:`StreamRing`, the device buffers and the
  copies and kernels of each chunk;
- :mod:`~offload_optim.streamed.queue`: :class:`StreamedQueue`, the regions issued and
  not yet published, and who publishes them;
- :mod:`~offload_optim.streamed.steps`: :class:`StreamedSteps`, a ``HybridAdam``'s
  streamed regions issued onto a ring (from a step's host task, the issuing thread, or a
  hook), staged in backward and published.
"""

from offload_optim.streamed.queue import PUBLISH_POLL_S, StreamedQueue
from offload_optim.streamed.ring import (
    PACE_POLL_S,
    StreamPiece,
    StreamRing,
    UpCopy,
    up_copy_time,
    wait_polling,
)
from offload_optim.streamed.steps import StreamedSteps

__all__ = [
    "PACE_POLL_S",
    "PUBLISH_POLL_S",
    "StreamPiece",
    "StreamRing",
    "StreamedQueue",
    "StreamedSteps",
    "UpCopy",
    "up_copy_time",
    "wait_polling",
]
