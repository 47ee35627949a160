"""What a plan was made with, for the runtime and the optimizer to execute (``PlanOptions``).

Every choice here changes only speed, never the trained values: the host kernels compute
the same Adam (to within about 1e-7 of an update between kernel families), fp16 I/O is
bit-identical to widening, stepping and narrowing in separate passes, conversions on the
device or the host give the same bits, and a speculative host step is undone exactly when
the step overflows. The planner (``offload_runtime``'s ``plan``) decides them, the solver
prices them, and the ``Plan`` records them so that what runs is what was priced.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload_solver.host_rates import HOST_KERNELS


@dataclass(frozen=True)
class PlanOptions:
    """The speed-only choices a plan was made with. A plan document without them (written
    before plans recorded them) reads with these defaults."""

    host_kernel: str = "torch"
    """Kernels that step host-resident state: ``"torch"`` (torch's fused CPU Adam) or
    ``"single_pass"`` (the one-pass numba kernels)."""
    fp16_io: bool = False
    """fp16 training: host steps read the fp16 gradients from pinned staging and write the
    fp16 upload copy in the same pass (single-pass kernels, conversions on the host)."""
    convert_on_device: bool = False
    """Host-state regions change dtype on the device: fp32 gradients cross to the host and
    fp32 masters come up, at twice the PCIe bytes and no host conversion pass."""
    overlap: bool = True
    """Host steps overlap backward and the next forward; False steps every region after
    backward and waits for it (the reference's behaviour)."""
    host_step_after_backward: bool = False
    """No host step starts before backward ends (fp16 without speculation: the overflow
    answer comes first); priced so by the solver."""
    speculative: bool = False
    """fp16 training: host steps start under backward and are undone exactly on
    overflow."""
    speculative_params: int | None = None
    """With ``speculative``: how many trainable host-state parameters have undo buffers (the
    regions whose gradients land first); None: all."""
    speculative_step_cost: float = 1.0
    """How many plain host steps' time a step taken under backward costs (>= 1)."""
    speculation_thread: bool = False
    """Steps taken under backward run on a thread of their own, so that ``step()`` does
    not wait for the one in flight when backward ends."""
    stage_in_backward: bool = True
    """Streamed regions' state starts up in the backward (one chunk per ring slot)."""
    state_on_device: bool = True
    """Regions may keep their optimizer state on the device (False: all on the host, the
    reference's behaviour)."""
    late_host_work: bool = True
    """Host-state placements moved to later regions where the step gets shorter."""
    micro_batches: int = 1
    """Forward and backward passes per optimizer step (gradient accumulation)."""

    def __post_init__(self) -> None:
        if self.host_kernel not in HOST_KERNELS:
            raise ValueError(
                f"PlanOptions.host_kernel is {self.host_kernel!r}; use one of "
                f"{', '.join(repr(k) for k in HOST_KERNELS)}"
            )
        if self.fp16_io and (self.host_kernel != "single_pass" or self.convert_on_device):
            raise ValueError(
                "PlanOptions.fp16_io steps fp16 gradients converted on the host by the "
                "single-pass kernels: set host_kernel='single_pass' and convert_on_device=False"
            )
        if self.speculative and self.host_step_after_backward:
            raise ValueError(
                "PlanOptions.speculative steps host regions under backward: it needs "
                "host_step_after_backward=False"
            )
        value = self.speculative_params
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ValueError(
                f"PlanOptions.speculative_params is {value!r}; must be None or an int >= 0"
            )
        cost = self.speculative_step_cost
        if isinstance(cost, bool) or not isinstance(cost, int | float) or not 1 <= cost < math.inf:
            raise ValueError(
                f"PlanOptions.speculative_step_cost is {cost!r}; must be a finite factor >= 1"
            )
        mb = self.micro_batches
        if isinstance(mb, bool) or not isinstance(mb, int) or mb < 1:
            raise ValueError(f"PlanOptions.micro_batches is {mb!r}; must be an int >= 1")


__all__ = ["PlanOptions"]
