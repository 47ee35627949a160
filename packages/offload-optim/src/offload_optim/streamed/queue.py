"""The streamed regions issued and not yet published, and who publishes them (see
[Note: streamed steps] in streamed/__init__.py).

[Note: publishing while issuing]
Paced, the issuing thread can still be issuing when step()'s host task has finished its
host steps. The task then keeps publishing what has landed, checking every
``PUBLISH_POLL_S``, until the issuing thread is done, rather than waiting for the thread
first: the next forward waits for each region's publish, and a region that has landed
should not wait for a later one's issue. That is what the planner assumes: a streamed
region is published when its downloads land.

[Note: the issuing thread publishes]
Between host steps is still late when the host worker is in one: a region that lands
during a host step would wait for that step to end. So the issuing thread publishes too:
whatever has landed while it waits for a free slot, after each region it issues, and
then each region as it lands until none is left (:meth:`StreamedQueue.publish_until_empty`),
before it reports itself done. It publishes only regions whose publish casts nothing on
the host: those whose device step wrote their device parameters, or (fp16 I/O) their
upload copy. Any other publish casts the new master on the host, which would hold up the
issuing, so the issuing thread stops at the first such entry and leaves it, and the
entries after it, to the host worker. The queue takes each entry once and in order
whichever thread publishes (one publishes at a time; the issuing thread skips a round
rather than wait for the host worker). The ring is still closed by the host worker, at
its first check after the issuing thread is done.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable

from offload_runtime.streams import Event

PUBLISH_POLL_S = 5e-4
"""Seconds step()'s host task waits for the issuing thread between checks for landed
streamed regions, once its host steps are done ([Note: publishing while issuing])."""


class StreamedQueue:
    """Streamed regions issued on the host worker, published in issue order once landed.

    Each entry carries its own ``publish(start_s, end_s)``: a step's host task and the
    hooks of regions landing after the step's answer share one queue (and one ring).
    :meth:`add` runs on the issuing thread (a step's regions) or the host worker (a
    hook's) while the other publishes; so may publishing, of entries that cast nothing on
    the host ([Note: the issuing thread publishes])."""

    def __init__(self) -> None:
        self._pending: deque[
            tuple[int, Event | None, float, Callable[[float, float], None], bool]
        ] = deque()
        self._lock = threading.Lock()
        self._publishing = threading.RLock()
        """Held while a thread publishes, so that the two publishing threads (the host
        worker and the issuing thread) take each entry once and in order."""

    def add(
        self,
        r: int,
        landed: Event | None,
        start_s: float,
        publish: Callable[[float, float], None],
        *,
        casts: bool = False,
    ) -> None:
        """Queue region ``r``, issued at ``start_s`` (``time.perf_counter()``), whose
        downloads are done at ``landed``; ``publish(start_s, end_s)`` runs once they are.
        ``casts``: the publish casts the new master on the host (the host worker's work,
        not the issuing thread's)."""
        with self._lock:
            self._pending.append((r, landed, start_s, publish, casts))

    def publish_landed(
        self, wait: bool = False, *, block: bool = True, casting: bool = True
    ) -> None:
        """Publish the regions whose downloads have landed, in issue order; with ``wait``,
        all of them, blocking for each (a host sync point). ``block=False``: return at
        once if another thread is publishing; ``casting=False``: stop at the first entry
        whose publish casts on the host (the issuing thread)."""
        if not self._publishing.acquire(blocking=block):
            return
        try:
            while True:
                with self._lock:
                    if not self._pending:
                        return
                    _, landed, start, publish, casts = self._pending[0]
                if casts and not casting:
                    return
                if landed is not None and not landed.query():
                    if not wait:
                        return
                    landed.synchronize()
                with self._lock:
                    self._pending.popleft()
                publish(start, time.perf_counter())
        finally:
            self._publishing.release()

    def publish_until_empty(self, poll_s: float = PUBLISH_POLL_S) -> None:
        """Publish each region as it lands, polling every ``poll_s`` seconds, until none
        is left (entries added meanwhile included) or the first left casts on the host:
        the issuing thread, once it has issued everything ([Note: the issuing thread
        publishes])."""
        while self._castless_head():
            self.publish_landed(block=False, casting=False)
            if self._castless_head():
                time.sleep(poll_s)

    def _castless_head(self) -> bool:
        """Whether an entry is queued and the first one's publish casts nothing."""
        with self._lock:
            return bool(self._pending) and not self._pending[0][4]

    def regions(self) -> list[int]:
        """The regions queued and not yet published, in issue order."""
        with self._lock:
            return [entry[0] for entry in self._pending]
