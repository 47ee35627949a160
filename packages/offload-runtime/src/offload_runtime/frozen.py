"""When an offloaded region with frozen parameters is done with its backward.

[Note: releasing regions with frozen parameters]
The controller gives an offloaded region's pool slot back when the region's last gradient
has been accumulated: no backward operation reads a parameter after its own gradient
exists. A frozen parameter (``requires_grad=False``) has no gradient, yet the backward may
still read it (a frozen linear layer between the loss and a trainable one computes its
input's gradient from its weight), possibly after every trainable parameter of its region
has its gradient, and a region with only frozen parameters has no gradient at all.

For such regions (offloaded, with a frozen parameter), :class:`SavedParams` counts the
tensors saved for backward that lie in the region's slot (its parameters and views of
them) and how many of them the backward has unpacked. The region is released once both
hold: every trainable parameter has its gradient, and every such saved tensor was unpacked.
The release itself waits for the next backward event in another autograd node (another
region's first unpack, a gradient hook, the end of backward): the node that unpacked the
last tensor has then queued the work that reads it, which the slot's free event follows.
A saved tensor that the backward never unpacks keeps its region until the end of backward.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from offload_runtime.storage import RegionStorage


class SavedParams:
    """Saved-tensor counts of offloaded regions with frozen parameters (see [Note:
    releasing regions with frozen parameters])."""

    def __init__(self, storages: Sequence[RegionStorage]) -> None:
        self._ranges: dict[int, tuple[torch.device, int, int]] = {}
        for st in storages:
            if st.offloaded and any(not lay.requires_grad for lay in st.layouts):
                start = st.device_params.data_ptr()
                end = start + st.numel * st.device_params.element_size()
                self._ranges[st.index] = (st.device_params.device, start, end)
        self._pending = dict.fromkeys(self._ranges, 0)
        self.ready: list[int] = []
        """Regions whose release waits for the next backward event in another node."""
        self.waiting: set[int] = set()
        """Regions whose gradients are done but whose saved tensors are not all unpacked."""

    @property
    def tracked(self) -> bool:
        return bool(self._ranges)

    def packed(self, r: int, t: torch.Tensor) -> bool:
        """Count ``t`` if it is saved from region ``r``'s slot; whether it was counted."""
        where = self._ranges.get(r)
        if where is None or t.device != where[0] or t.layout is not torch.strided:
            return False
        if not where[1] <= t.data_ptr() < where[2]:
            return False
        self._pending[r] += 1
        return True

    def unpacked(self, r: int, frozen_only: bool) -> None:
        """One of region ``r``'s counted tensors was unpacked. ``frozen_only``: the region
        has no trainable parameter, so nothing else holds it."""
        self._pending[r] = max(0, self._pending[r] - 1)
        if self._pending[r] == 0 and (frozen_only or r in self.waiting):
            self.waiting.discard(r)
            self.ready.append(r)

    def holds(self, r: int) -> bool:
        """Whether region ``r`` still has saved tensors to unpack (its gradients are done:
        it waits for them)."""
        if self._pending.get(r, 0) > 0:
            self.waiting.add(r)
            return True
        return False

    def take_ready(self) -> list[int]:
        ready, self.ready = self.ready, []
        return ready

    def reset(self) -> list[int]:
        """The end of a backward: nothing is pending any more. Returns the regions held
        until now, for the controller to release."""
        held = sorted({*self.ready, *self.waiting})
        self._pending = dict.fromkeys(self._ranges, 0)
        self.ready.clear()
        self.waiting.clear()
        return held
