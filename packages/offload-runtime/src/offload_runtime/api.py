"""``memory_optimize``: plan and build the OffloadModule in one call; ``plan``: the plan alone.

Both go through one planning function (``offload_runtime.planning.plan_model``), so a plan
made without building is the plan a module trains with. The planner decides every choice
that only changes speed (see [Note: the planner's candidates] in
``planning/candidates.py``); the user's choices are an :class:`OffloadConfig`.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import torch

from offload_runtime.config import OffloadConfig
from offload_runtime.distributed import check_same_weights, plan_together, shard_host_state
from offload_runtime.module import OffloadModule
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import (
    ActivationPlacement,
    HardwareProfile,
    ModelProfile,
    ParamPlacement,
    Plan,
    StatePlacement,
)
from offload_trace import device_state_bytes_per_param

MiB = 2**20


def plan_summary(profile: ModelProfile, plan: Plan) -> dict[str, float]:
    """The reference's summary numbers (MB = 2**20 bytes) for a plan."""
    return _summary(plan, profile.device_state_bytes_per_param, profile.total_param_bytes)


def _summary(plan: Plan, state_bytes_per_param: int, param_bytes: int) -> dict[str, float]:
    resident = sum(
        rp.region.size_bytes for rp in plan.regions if rp.placement is ParamPlacement.RESIDENT
    )
    state = sum(
        rp.region.stepped_numel * state_bytes_per_param  # frozen parameters hold none
        for rp in plan.regions
        if rp.state is StatePlacement.DEVICE
    )
    max_param = resident + plan.pool_size_bytes
    act = max(0, plan.predicted_peak_bytes - max_param - state)
    return {
        "act_peak_mem_mb": act / MiB,
        "max_param_mem_mb": max_param / MiB,
        "total_param_mem_mb": param_bytes / MiB,
        "device_state_mem_mb": state / MiB,
    }


def _summary_line(s: dict[str, float]) -> str:
    return (
        f"act_peak_mem={s['act_peak_mem_mb']:.3f} MB | "
        f"max_param_mem={s['max_param_mem_mb']:.3f} MB | "
        f"total_param_mem={s['total_param_mem_mb']:.3f} MB"
    )


def print_summary(profile: ModelProfile, plan: Plan) -> None:
    """The reference's summary line of a plan, on stdout."""
    print(_summary_line(plan_summary(profile, plan)), flush=True)


def summary_line(plan: Plan, dtype: torch.dtype) -> str:
    """The reference's summary line of a plan made for training in ``dtype``, from the
    plan alone (as :func:`plan` returns it): the line :func:`print_summary` prints."""
    param_bytes = sum(rp.region.size_bytes for rp in plan.regions)
    return _summary_line(_summary(plan, device_state_bytes_per_param(dtype), param_bytes))


def speculating_regions(plan: Plan) -> frozenset[int]:
    """Indices of the regions whose host steps ``plan`` takes speculatively under backward:
    with ``plan.options.speculative``, the regions whose optimizer state is stepped on the
    host, from the last in forward order (whose gradients land first) down, as long as
    their parameters stay within ``plan.options.speculative_params`` (None: all). The
    solver prices the same regions, and the optimizer gives them undo buffers."""
    options = plan.options
    if not options.speculative:
        return frozenset()
    left = options.speculative_params
    found: set[int] = set()
    for rp in reversed(plan.regions):
        if rp.state is not StatePlacement.HOST or rp.region.numel == 0:
            continue
        if left is not None:
            if rp.region.numel > left:
                break
            left -= rp.region.numel
        found.add(rp.region.index)
    return frozenset(found)


def describe_options(plan: Plan) -> str:
    """``plan``'s options (``plan.options``, and which regions stream their state) in a
    line of words, e.g. ``single_pass host kernel, fp16 I/O, conversions on the host,
    speculative host steps (undo buffers for all host-state parameters, 1.18x a plain
    step, own thread), no streamed state, late host work``."""
    o = plan.options
    parts = [f"{o.host_kernel} host kernel"]
    if o.fp16_io:
        parts.append("fp16 I/O")
    parts.append(f"conversions on the {'device' if o.convert_on_device else 'host'}")
    if not o.overlap:
        parts.append("host steps after backward, waited for")
    elif o.speculative:
        limit = (
            "all host-state parameters"
            if o.speculative_params is None
            else f"{o.speculative_params} parameters"
        )
        thread = ", own thread" if o.speculation_thread else ""
        parts.append(
            f"speculative host steps (undo buffers for {limit}, "
            f"{o.speculative_step_cost:.2f}x a plain step{thread})"
        )
    elif o.host_step_after_backward:
        parts.append("host steps after backward")
    else:
        parts.append("host steps under backward")
    streamed = sum(rp.state is StatePlacement.STREAMED for rp in plan.regions)
    if streamed:
        staged = "staged in backward" if o.stage_in_backward else "staged at the step"
        parts.append(f"streamed state in {streamed} regions ({staged})")
    else:
        parts.append("no streamed state")
    if not o.state_on_device:
        parts.append("all optimizer state on the host")
    parts.append("late host work" if o.late_host_work else "no late host work")
    runs = sum(rp.activations is ActivationPlacement.RECOMPUTE for rp in plan.regions)
    chained = sum(
        rp.activations is ActivationPlacement.RECOMPUTE_WITH_PREVIOUS for rp in plan.regions
    )
    hosted = sum(rp.activations is ActivationPlacement.HOST for rp in plan.regions)
    if runs or hosted:
        parts.append(
            f"activations recomputed in {runs + chained} regions ({runs} runs), sent to the "
            f"host in {hosted}"
        )
    if o.micro_batches > 1:
        parts.append(f"{o.micro_batches} micro-batches per step")
    return ", ".join(parts)


def describe_plan(plan: Plan) -> str:
    """What ``plan`` chose, for a log: a line ``plan: <options>`` (:func:`describe_options`)
    and a table of its regions, consecutive regions that agree sharing a row: their
    indices, parameter MB (2**20 bytes, training dtype), where the parameters live
    (``resident``, or offloaded ``async``: prefetched, or ``sync``: uploaded when needed),
    where the optimizer state lives and steps (``device``, ``host`` or ``streamed``), and
    whether the host steps speculatively under backward (``yes``, ``no``; ``-`` where the
    host takes no step), and what happens to the activations its forward saves for
    backward (``keep``, ``recompute`` or ``host``: ``RegionPlan.activations``)."""
    speculating = speculating_regions(plan)
    rows: list[tuple[int, int, int, str, str, str, str]] = []  # first, last, bytes, ...
    for rp in plan.regions:
        where = rp.placement.value
        where = where if rp.placement is ParamPlacement.RESIDENT else f"offloaded ({where})"
        if rp.state is not StatePlacement.HOST:
            spec = "-"
        else:
            spec = "yes" if rp.region.index in speculating else "no"
        key = (where, rp.state.value, spec, rp.activations.value)
        if rows and rows[-1][3:] == key and rows[-1][1] == rp.region.index - 1:
            first, _, size, *_ = rows[-1]
            rows[-1] = (first, rp.region.index, size + rp.region.size_bytes, *key)
        else:
            rows.append((rp.region.index, rp.region.index, rp.region.size_bytes, *key))
    lines = [
        f"plan: {describe_options(plan)}",
        f"{'regions':>9}  {'param MB':>10}  {'parameters':<17}  {'optimizer state':<15}  "
        "speculative  activations",
    ]
    for first, last, size, where, state, spec, acts in rows:
        span = str(first) if first == last else f"{first}-{last}"
        lines.append(
            f"{span:>9}  {size / MiB:>10.3f}  {where:<17}  {state:<15}  {spec:<11}  {acts}"
        )
    return "\n".join(lines)


def plan(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | tuple[Any, ...],
    memory_budget: float,
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
    memory_budget: float,
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
        memory_budget: device memory budget in bytes (the solver plans against 0.95 of it):
            an int or any integer-like or finite real number, rounded down.
        solver_name: ``"asyn"`` (prefetch on the h2d stream) or ``"syn"``.
        config: the user's choices (:class:`OffloadConfig`: training dtype, host moments,
            host memory and threads, accumulation steps, GELU fusion); None: its defaults
            (fp16 training, fp32 moments).
        hardware: a profile to plan with; default: measured on this device (cached), or
            the documented CPU default when there is no CUDA.
        device: where to train; default CUDA when available, else the CPU.
        progress: print the phases and the summary line.

    Under an initialised ``torch.distributed`` process group of several ranks (e.g. from
    ``torchrun``), every rank must pass the same weights and inputs of the same shapes; the
    module then trains data-parallel: rank 0's plan on every rank, each region's
    gradients averaged over the ranks, host optimizer state sharded by region
    (``module.sharding``; see [Note: data parallel] in ``offload_runtime.distributed``).

    The expert path, which fixes the planner's choices, is
    ``offload_runtime.planning.build_offload_module(model, plan_model(..., force=PlanForce(
    ...)))``.

    Raises:
        ValueError: bad arguments, ranks with different weights, or
            (``InfeasibleBudgetError``) a budget below the least feasible one, which the
            message names.
        RuntimeError: host memory too small for the plan's host-resident state.
    """
    check_same_weights(model)
    planned = plan_together(
        functools.partial(
            plan_model,
            model,
            inputs,
            memory_budget,
            solver_name,
            config=config,
            hardware=hardware,
            device=device,
            progress=progress,
        )
    )
    module = build_offload_module(model, planned)
    shard_host_state(module)
    if progress:  # the reference's summary line, on stdout
        print_summary(planned.profile, planned.plan)
    return module


__all__ = [
    "describe_options",
    "describe_plan",
    "memory_optimize",
    "plan",
    "plan_summary",
    "print_summary",
    "speculating_regions",
    "summary_line",
]
