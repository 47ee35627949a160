"""The planner: trace, measure, solve the candidates, keep the fastest (``plan_model``), and
build the module that runs the plan (``build_offload_module``).

``offload_runtime.memory_optimize`` is ``build_offload_module(model, plan_model(...))``
and ``offload_runtime.plan`` is ``plan_model(...).plan``: one planning function, so that
a plan made without building and the plan a module trains with cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from offload_runtime.config import OffloadConfig
from offload_runtime.distributed import host_threads_per_rank, ranks_on_this_host
from offload_runtime.hardware import (
    available_host_memory_bytes,
    measure_attention_at,
    profile_hardware,
    with_attention_rates,
)
from offload_runtime.hardware.identity import resolve_device
from offload_runtime.inputs import InputSpec, input_spec
from offload_runtime.module import OffloadModule
from offload_runtime.planning.attention import attention_shapes, measures_attention
from offload_runtime.planning.candidates import Candidate, candidates, planning_hardware
from offload_runtime.planning.device import (
    matmul_shapes,
    measure_device_bytes_in_use,
    model_bytes_on,
)
from offload_runtime.planning.force import PlanForce
from offload_runtime.planning.speculation import speculative_params_that_fit
from offload_runtime.planning.streamed_costs import streamed_step_costs
from offload_solver import (
    HardwareProfile,
    InfeasibleBudgetError,
    ModelProfile,
    ParamPlacement,
    Plan,
    PlanOptions,
    as_bytes,
    solve,
)
from offload_solver.regions import BLOCK_SEARCH_RANGE_BYTES
from offload_trace import TracedModel, trace

log = logging.getLogger(__name__)

MiB = 2**20

BLOCK_SEARCH_MODEL_SHARE = 4
"""The pool block-size search looks at most the model's parameter bytes over this far
above the largest region (and at most the reference's 128 MiB), so that a model smaller
than the reference's range still has regions to offload; from gpt2_medium up the range
stays the reference's."""


@dataclasses.dataclass(frozen=True)
class PlannedModel:
    """What :func:`plan_model` found: the plan and what it was made from."""

    traced: TracedModel
    profile: ModelProfile
    """The traced model's profile as the plan was solved for it (with the chosen
    candidate's conversion place)."""
    plan: Plan
    """The plan, with the options it was made with (``Plan.options``)."""
    hardware: HardwareProfile
    """The hardware profile the plan was solved on: as measured (or given), with fused
    attention's rates where measured, and the host Adam rate of the kernel configuration
    the plan chose (``host_adam_params_per_s``; no conversion pass charged with fp16 I/O:
    ``candidates.planning_hardware``)."""
    config: OffloadConfig
    device: torch.device
    host_worker: bool | None = None
    """``PlanForce.host_worker``: None lets the runtime choose (a worker thread on CUDA)."""
    predictions_s: tuple[tuple[str, float], ...] = ()
    """Each candidate solved (:meth:`Candidate.describe`) and its predicted step in
    seconds (``inf`` where it did not fit the budget)."""
    inputs: InputSpec | None = None
    """The input tensors traced: the module refuses calls with others."""


def device_conversion_profile(profile: ModelProfile) -> ModelProfile:
    """``profile`` as a runtime converting on the device moves it: fp32 gradients to the
    host, fp32 masters to the device (4 bytes per element each way), no host casts."""
    return dataclasses.replace(profile, host_grad_bytes_per_param=4, host_upload_bytes_per_param=4)


def block_search_range(profile: ModelProfile, force: PlanForce) -> int:
    """The pool block-size search range: ``PlanForce.block_search_range_bytes``, else the
    reference's 128 MiB, at most the model's parameter bytes over
    :data:`BLOCK_SEARCH_MODEL_SHARE`."""
    if force.block_search_range_bytes is not None:
        return force.block_search_range_bytes
    return min(BLOCK_SEARCH_RANGE_BYTES, profile.total_param_bytes // BLOCK_SEARCH_MODEL_SHARE)


def _planning_device(
    device: torch.device | str | None, hardware: HardwareProfile | None
) -> tuple[torch.device, bool]:
    """(the device to plan for, whether it is here to measure): a CUDA device named where
    CUDA is absent is planned for, unmeasured, when ``hardware`` describes it."""
    if hardware is not None and device is not None and not torch.cuda.is_available():
        dev = torch.device(device)
        if dev.type == "cuda":
            return dev, False
    return resolve_device(device), True


def plan_model(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | tuple[Any, ...],
    memory_budget: float,
    solver_name: str = "asyn",
    *,
    config: OffloadConfig | None = None,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    force: PlanForce | None = None,
) -> PlannedModel:
    """Trace ``model``, measure the machine (the cached hardware profile; fused attention at
    the model's shapes on a GPU), solve the planner's candidates (see [Note: the planner's
    candidates] in ``candidates.py``) and keep the one with the shortest predicted step.
    Builds nothing: :func:`build_offload_module` does. ``force`` fixes any of the
    planner's choices (:class:`PlanForce`); the other arguments are
    :func:`offload_runtime.memory_optimize`'s. A CUDA ``device`` where CUDA is absent is
    planned for with ``hardware`` (e.g. ``offload_solver.default_hardware()``), nothing
    measured.

    Raises:
        ValueError: bad arguments, or (``InfeasibleBudgetError``) a budget below the least
            feasible one, which the message names.
    """
    memory_budget = as_bytes(memory_budget, "memory_budget")
    config = OffloadConfig() if config is None else config
    force = PlanForce() if force is None else force
    if not isinstance(config, OffloadConfig):
        raise ValueError(f"config must be an OffloadConfig or None, got {config!r}")
    if not isinstance(force, PlanForce):
        raise ValueError(f"force must be a PlanForce or None, got {force!r}")
    if not isinstance(inputs, Mapping | tuple):
        raise ValueError(
            f"inputs must be a dict of keyword tensors or a tuple of positional ones, got "
            f"{type(inputs).__name__}"
        )
    spec = input_spec(inputs)
    spec.check_dtype(config.dtype)
    dev, here = _planning_device(device, hardware)
    measure_attention = here and measures_attention(force.measure_attention, dev, hardware)
    chosen = candidates(config, force)
    say = _say if progress else log.info
    ranks = ranks_on_this_host()
    threads = config.host_threads
    if threads is None and ranks > 1:
        threads = host_threads_per_rank(ranks)  # data parallel: this rank's share of cores
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)  # process-wide: see OffloadConfig
        say(f"host threads: {threads} (torch.set_num_threads)")
    # What the caller holds on the device, read before tracing and measuring allocate
    # anything: the same whatever the planner's own work leaves in the allocator, so a plan
    # of a model on meta (``plan``) and of the model itself (``memory_optimize``) agree.
    in_use = force.device_bytes_in_use
    if in_use is None:
        in_use = measure_device_bytes_in_use(dev, model, config.dtype) if here else 0
    t0 = time.perf_counter()
    traced = trace(
        model, inputs, dtype=config.dtype, target_device=dev.type, fuse_gelu=config.fuse_gelu
    )
    base = traced.to_profile(name=type(model).__name__)
    say(f"traced {len(base.operations)} operations in {time.perf_counter() - t0:.1f} s")
    if traced.fused_gelu:
        say(f"fused {len(traced.fused_gelu)} written-out tanh GELU(s) into one operation each")
    if traced.opaque_modules:
        say(
            f"{len(traced.opaque_modules)} module(s) torch.export cannot capture run as "
            f"opaque operations, recomputed in backward: {', '.join(traced.opaque_modules)}"
        )
    attention = attention_shapes(traced.graph_module) if measure_attention else []
    if hardware is None:
        # Attention's rates with the matrix products' efficiency, cached per model shape.
        hardware = profile_hardware(
            dev,
            dtype=config.dtype,
            matmul_shapes=matmul_shapes(traced.graph_module),
            attention_shapes=attention,
            progress=progress,
        )
    elif attention:
        hardware = with_attention_rates(
            hardware, attention, lambda shape: measure_attention_at(dev, shape, dtype=config.dtype)
        )
    if ranks > 1:
        # Data parallel: the ranks of this machine share its cores and DRAM.
        hardware = hardware.shared_host(ranks)
        say(
            f"host shared by {ranks} ranks: each plans with 1/{ranks} of its host memory "
            f"and conversion rates (and steps 1/{ranks} of the host state)"
        )
    if attention:
        say(
            f"fused attention at {len(attention)} shape(s) of the model: forward "
            f"{hardware.attention_fwd_flop_per_s / 1e12:.0f} TFLOP/s, backward "
            f"{hardware.attention_bwd_flop_per_s / 1e12:.0f} TFLOP/s (matrix products "
            f"{hardware.compute_flop_per_s / 1e12:.0f})"
        )
    if force.device_bytes_in_use is None and in_use:
        say(
            f"{in_use / MiB:.1f} MiB of device memory are in use beside the plan "
            "(library workspaces, the inputs, other tensors): planning for the rest"
        )
    t1 = time.perf_counter()
    host_bytes = config.host_memory_bytes or host_bytes_available(model)
    solved = _solve_candidates(
        chosen,
        base,
        hardware,
        memory_budget,
        solver_name,
        config,
        force,
        (in_use, host_bytes),
        say,
    )
    kept = min(range(len(solved)), key=lambda i: (solved[i][1].predicted_step_time_s, i))
    winner, plan, profile, planned_on = solved[kept]
    predictions = tuple((c.describe(), p.predicted_step_time_s) for c, p, _, _ in solved)
    if len(predictions) > 1:
        say(
            f"chose {winner.describe()}: predicted step "
            + ", ".join(f"{t * 1e3:.1f} ms with {d}" for d, t in predictions)
        )
    say(
        f"solver {solver_name}: {len(plan.regions)} regions, "
        f"{sum(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)} offloaded, "
        f"predicted peak {plan.predicted_peak_bytes / MiB:.1f} MB, step "
        f"{plan.predicted_step_time_s * 1e3:.1f} ms ({time.perf_counter() - t1:.2f} s)"
    )
    return PlannedModel(
        traced=traced,
        profile=profile,
        plan=plan,
        hardware=planned_on,
        config=config,
        device=dev,
        host_worker=force.host_worker,
        predictions_s=predictions,
        inputs=spec,
    )


def host_bytes_available(model: torch.nn.Module) -> int | None:
    """Host memory, in bytes, that the plan's host state and undo buffers may take when
    ``OffloadConfig.host_memory_bytes`` is None: what the host has available now, plus
    ``model``'s own parameters and buffers in host memory, which the module's storage
    replaces once the caller lets the model go (as ``measure_device_bytes_in_use`` counts
    its device copies): a model planned on the meta device and the same model with host
    weights get the same plan. None where the host memory is unknown."""
    available = available_host_memory_bytes()
    if not available:
        return None
    return available + model_bytes_on(model, torch.device("cpu"))


def _solve_candidates(
    chosen: list[Candidate],
    base: ModelProfile,
    hardware: HardwareProfile,
    memory_budget: int,
    solver_name: str,
    config: OffloadConfig,
    force: PlanForce,
    room: tuple[int, int | None],
    say: Callable[[str], None],
) -> list[tuple[Candidate, Plan, ModelProfile, HardwareProfile]]:
    """Each candidate that fits: solved (its options recorded in its plan), with the
    profile and hardware it was solved for; the ``InfeasibleBudgetError`` with the
    smallest least budget when none fits. ``room``: the device bytes in use beside the
    plan, and the host bytes its host state may take (None: unknown). ``say`` reports the
    solver's phases as they end (``solve``'s ``progress``)."""
    solved: list[tuple[Candidate, Plan, ModelProfile, HardwareProfile]] = []
    errors: list[InfeasibleBudgetError] = []
    search_range = block_search_range(base, force)
    for c in chosen:
        profile = device_conversion_profile(base) if c.convert_on_device else base
        planned, spec_cost = planning_hardware(c, config, hardware, force)
        try:
            plan = _solve_one(
                c,
                profile,
                planned,
                spec_cost,
                memory_budget,
                solver_name,
                config,
                force,
                room,
                search_range,
                say,
            )
        except InfeasibleBudgetError as exc:
            errors.append(exc)
            continue
        solved.append((c, plan, profile, planned))
    if not solved:
        raise min(errors, key=lambda e: e.least_budget_bytes)
    return solved


def _solve_one(
    c: Candidate,
    profile: ModelProfile,
    planned: HardwareProfile,
    spec_cost: float,
    memory_budget: int,
    solver_name: str,
    config: OffloadConfig,
    force: PlanForce,
    room: tuple[int, int | None],
    search_range: int,
    say: Callable[[str], None],
) -> Plan:
    """Candidate ``c`` solved on ``planned`` (its own host rate; ``spec_cost``: its
    speculative step's time over its plain one's), its options recorded
    (``Plan.options``). A speculative one whose undo buffers do not all fit in host memory
    is solved again with the regions whose buffers fit speculating
    (:func:`speculative_params_that_fit`) in ``room``'s host bytes; ``room``'s device
    bytes are in use beside the plan."""
    in_use, host_bytes = room
    fp16 = config.dtype == torch.float16
    overlap = force.overlap is not False
    stage = force.stage_in_backward is not False
    options = PlanOptions(
        host_kernel=c.host_kernel,
        fp16_io=c.fp16_io,
        convert_on_device=c.convert_on_device,
        overlap=overlap,
        host_step_after_backward=(fp16 and not c.speculative) or not overlap,
        speculative=c.speculative,
        speculative_params=force.speculative_params if c.speculative else None,
        speculative_step_cost=spec_cost,
        speculation_thread=c.speculative and force.speculation_thread is not False,
        stage_in_backward=stage,
        state_on_device=force.state_on_device is not False,
        late_host_work=force.late_host_work is not False,
        micro_batches=config.accumulation_steps,
    )
    streamed = None
    if force.streamed is not False and not config.bf16_master:
        streamed = streamed_step_costs(
            config.host_moments, c.fp16_io, budget_bytes=memory_budget, stage_in_backward=stage
        )

    def solved(speculative_params: int | None) -> Plan:
        plan = solve(
            profile,
            planned,
            memory_budget,
            solver=solver_name,
            block_search_range_bytes=search_range,
            host_step_after_backward=options.host_step_after_backward,
            state_on_device=options.state_on_device,
            speculative_step_cost=options.speculative_step_cost,
            speculative_params=speculative_params,
            speculation_thread=options.speculation_thread,
            device_bytes_in_use=in_use,
            micro_batches=options.micro_batches,
            streamed=streamed,
            late_host_work=options.late_host_work,
            activations=force.activations is not False,
            cost_model=force.cost_model,
            progress=lambda line: say(f"{c.describe()}: {line}"),
        )
        recorded = dataclasses.replace(options, speculative_params=speculative_params)
        return dataclasses.replace(plan, options=recorded)

    plan = solved(options.speculative_params)
    if c.speculative and force.speculative_params is None:
        fit = speculative_params_that_fit(plan, config.host_moments, config.dtype, host_bytes)
        if fit is not None:
            plan = solved(fit)
    return plan


def build_offload_module(model: torch.nn.Module, planned: PlannedModel) -> OffloadModule:
    """The module that trains ``model`` under ``planned``'s plan: region storage filled
    from the model's real weights (the model itself is not modified), the plan's passes
    applied to the traced graph in training and evaluation modes."""
    named = dict(model.named_parameters(remove_duplicate=False))
    meta = [name for name, p in named.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"model parameters are on the meta device (e.g. {meta[0]!r}): building a module "
            "needs real weights; build the model on the CPU or load a state dict first "
            "(a meta model can still be planned: offload_runtime.plan)"
        )
    device = resolve_device(planned.device)  # a device planned for elsewhere is an error here
    traced = planned.traced
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = set(traced.buffer_names)
    module = OffloadModule(
        plan=planned.plan,
        graph_train=traced.module_for(device, training=True),
        graph_eval=traced.module_for(device, training=False),
        param_targets=dict(traced.param_names),
        canonical=planned.profile.canonical_names(),
        buffers={name: b for name, b in buffers.items() if name in wanted},
        state=named,
        device=device,
        dtype=traced.dtype,
        op_names=tuple(traced.operation_names),
        tied_groups=planned.profile.tied_groups,
        host_worker=planned.host_worker,
        config=planned.config,
    )
    module.profile = planned.profile
    module.hardware = planned.hardware
    module.inputs = planned.inputs
    module.opaque_modules = traced.opaque_modules
    return module


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


__all__ = [
    "BLOCK_SEARCH_MODEL_SHARE",
    "PlannedModel",
    "block_search_range",
    "build_offload_module",
    "device_conversion_profile",
    "host_bytes_available",
    "plan_model",
]
