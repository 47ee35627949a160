"""``memory_optimize``: plan and build the OffloadModule in one call; ``plan``: the plan alone.

Both go through one planning function (``offload_runtime.planning.plan_model``), so a plan
made without building is the plan a module trains with. The planner decides every choice
that only changes speed (see [Note: the planner's candidates] in
``planning/candidates.py``); the user's choices are an :class:`OffloadConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from offload_runtime.config import OffloadConfig
from offload_runtime.module import OffloadModule
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import HardwareProfile, ModelProfile, ParamPlacement, Plan, StatePlacement

MiB = 2**20


def plan_summary(profile: ModelProfile, plan: Plan) -> dict[str, float]:
    """The reference's summary numbers (MB = 2**20 bytes) for a plan."""
    resident = sum(
        rp.region.size_bytes for rp in plan.regions if rp.placement is ParamPlacement.RESIDENT
    )
    state = sum(
        rp.region.numel * profile.device_state_bytes_per_param
        for rp in plan.regions
        if rp.state is StatePlacement.DEVICE
    )
    max_param = resident + plan.pool_size_bytes
    act = max(0, plan.predicted_peak_bytes - max_param - state)
    return {
        "act_peak_mem_mb": act / MiB,
        "max_param_mem_mb": max_param / MiB,
        "total_param_mem_mb": profile.total_param_bytes / MiB,
        "device_state_mem_mb": state / MiB,
    }


def print_summary(profile: ModelProfile, plan: Plan) -> None:
    """The reference's summary line of a plan, on stdout."""
    s = plan_summary(profile, plan)
    print(
        f"act_peak_mem={s['act_peak_mem_mb']:.3f} MB | "
        f"max_param_mem={s['max_param_mem_mb']:.3f} MB | "
        f"total_param_mem={s['total_param_mem_mb']:.3f} MB",
        flush=True,
    )


def plan(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | tuple[Any, ...],
    memory_budget: int,
    solver_name: str = "asyn",
    *,
    config: OffloadConfig | None = None,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> Plan:
    """The plan :func:`memory_optimize` would train ``model`` with, without building it:
    traced, measured (the cached hardware profile) and solved. ``model`` may be on the
    meta device (no weights allocated). The arguments are :func:`memory_optimize`'s; a
    CUDA ``device`` on a machine without CUDA is planned for with ``hardware`` (e.g.
    ``offload_solver.default_hardware()``), nothing measured. The plan records the options
    chosen (``Plan.options``)."""
    return plan_model(
        model,
        inputs,
        memory_budget,
        solver_name,
        config=config,
        hardware=hardware,
        device=device,
        progress=progress,
    ).plan


def memory_optimize(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | tuple[Any, ...],
    memory_budget: int,
    solver_name: str = "asyn",
    *,
    config: OffloadConfig | None = None,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> OffloadModule:
    """Plan and apply parameter offload so that training ``model`` fits ``memory_budget``.

    The planner decides every choice that only changes speed, per plan (where each
    region's parameters and optimizer state live, whether state is streamed through the
    device, the host kernel and its I/O precision, speculative host steps, where dtype
    conversions run, prefetch points) and records them in ``module.plan.options``; the
    optimizer reads them from the module. Planning takes the hardware profile of the
    device (measured once and cached) and, on a GPU, fused attention's rates at the
    model's shapes.

    Args:
        model: the model with real weights (CPU or GPU); it is traced, not modified.
        inputs: example inputs, a dict of keyword tensors or a tuple of positional ones;
            shapes are fixed at trace time.
        memory_budget: device memory budget in bytes (the solver plans against 0.95 of it).
        solver_name: ``"asyn"`` (prefetch on the h2d stream) or ``"syn"``.
        config: the user's choices (:class:`OffloadConfig`: training dtype, host moments,
            host memory and threads, accumulation steps, GELU fusion); None: its defaults
            (fp16 training, fp32 moments).
        hardware: a profile to plan with; default: measured on this device (cached), or
            the documented CPU default when there is no CUDA.
        device: where to train; default CUDA when available, else the CPU.
        progress: print the phases and the summary line.

    The expert path, which fixes the planner's choices, is
    ``offload_runtime.planning.build_offload_module(model, plan_model(..., force=PlanForce(
    ...)))``.

    Raises:
        ValueError: bad arguments, or (``InfeasibleBudgetError``) a budget below the least
            feasible one, which the message names.
        RuntimeError: host memory too small for the plan's host-resident state.
    """
    planned = plan_model(
        model,
        inputs,
        memory_budget,
        solver_name,
        config=config,
        hardware=hardware,
        device=device,
        progress=progress,
    )
    module = build_offload_module(model, planned)
    if progress:  # the reference's summary line, on stdout
        print_summary(planned.profile, planned.plan)
    return module


__all__ = ["memory_optimize", "plan", "plan_summary", "print_summary"]
