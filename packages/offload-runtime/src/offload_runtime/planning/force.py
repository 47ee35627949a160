"""Choices forced on the planner (``PlanForce``): for tests of every path, the benchmark's
named configurations, and experts; a user who passes nothing gets the planner's choices.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload_solver import CostModel
from offload_solver.host_rates import HOST_KERNELS


@dataclass(frozen=True)
class PlanForce:
    """Fixes some of the planner's decisions; each field left at None is the planner's to
    make. The planner's candidates all take the forced values (duplicates solved once),
    and a forced value that cannot run here (the single-pass kernel without numba, fp16
    I/O or speculation without fp16 training) is a ``ValueError`` or ``ImportError``."""

    host_kernel: str | None = None
    """``"torch"`` or ``"single_pass"``: the kernels that step host-resident state."""
    fp16_io: bool | None = None
    """fp16 training: host steps read fp16 gradients and write the fp16 upload copy in one
    pass (implies the single-pass kernel and conversions on the host)."""
    convert_on_device: bool | None = None
    """Host-state regions change dtype on the device (True) or the host (False)."""
    speculative: bool | None = None
    """fp16 training: host steps start under backward, undone exactly on overflow."""
    speculative_params: int | None = None
    """With speculation: host-state parameters given undo buffers, instead of the count
    that the host memory left over holds."""
    speculation_thread: bool | None = None
    """Speculative steps run on a thread of their own (the planner: on)."""
    overlap: bool | None = None
    """False: every host step runs after backward and the step waits for it (the
    reference's behaviour; the planner: overlap)."""
    state_on_device: bool | None = None
    """False: every region's optimizer state on the host (the reference's behaviour)."""
    streamed: bool | None = None
    """False: no region's host state is streamed through the device (the planner offers
    streaming to the solver, which streams where that shortens the step)."""
    stage_in_backward: bool | None = None
    """False: streamed state goes up at the step, not in the backward (the planner:
    staged)."""
    late_host_work: bool | None = None
    """False: the greedy phases' placements, host work not moved late."""
    activations: bool | None = None
    """False: every region keeps its activations on the device from forward to backward
    (the planner: where no plan fits so, some regions recompute their activations in
    backward or send them to the host and back; ``RegionPlan.activations``)."""
    measure_attention: bool | None = None
    """Measure fused attention at the model's shapes on the training GPU (the planner: on
    a CUDA device unless the profile has its rates; True elsewhere is an error)."""
    block_search_range_bytes: int | None = None
    """How far above the largest region the pool block-size search looks (0: the finest
    regions, for tiny models in tests); the planner: the reference's 128 MiB, at most a
    quarter of the model's parameter bytes."""
    host_worker: bool | None = None
    """Host-side gradient work on the runtime's worker thread (the planner: on CUDA)."""
    device_bytes_in_use: int | None = None
    """Device bytes allocated beside the plan for the whole step, instead of the ones
    measured on the device (the CPU: 0)."""
    host_step_params_per_s: float | None = None
    """The host step's rate to plan with, parameters/s, instead of the hardware profile's
    rate of the kernel the plan chooses (e.g. what ``offload_optim.check_host_rate`` read
    from a training loop)."""
    cost_model: CostModel | None = None
    """The simulator's fitted factors, instead of ``CostModel()`` (e.g. the backward's
    issue factor ``offload_optim.check_backward_issue`` read from a training loop)."""

    def __post_init__(self) -> None:
        if self.host_kernel is not None and self.host_kernel not in HOST_KERNELS:
            raise ValueError(
                f"PlanForce.host_kernel is {self.host_kernel!r}; use one of "
                f"{', '.join(repr(k) for k in HOST_KERNELS)} or None"
            )
        if self.fp16_io and self.host_kernel == "torch":
            raise ValueError("PlanForce.fp16_io steps with the single-pass kernel, not 'torch'")
        if self.fp16_io and self.convert_on_device:
            raise ValueError("PlanForce.fp16_io converts on the host: not convert_on_device")
        if self.speculative and self.overlap is False:
            raise ValueError("PlanForce.speculative steps under backward: it needs overlap")
        for name in ("speculative_params", "block_search_range_bytes", "device_bytes_in_use"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 0
            ):
                raise ValueError(f"PlanForce.{name} is {value!r}; give an int >= 0 or None")
        rate = self.host_step_params_per_s
        if rate is not None and not (
            not isinstance(rate, bool) and isinstance(rate, int | float) and 0 < rate < math.inf
        ):
            raise ValueError(
                f"PlanForce.host_step_params_per_s is {rate!r}; give a rate > 0 parameters/s"
            )
        if self.cost_model is not None and not isinstance(self.cost_model, CostModel):
            raise ValueError(
                f"PlanForce.cost_model is {self.cost_model!r}; give an offload_solver.CostModel"
            )


__all__ = ["PlanForce"]
