"""``memory_optimize``: trace, profile, solve and build the OffloadModule in one call."""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import fx

from offload_runtime.hardware import (
    MatmulShape,
    measure_attention_flop_per_s,
    profile_hardware,
)
from offload_runtime.module import OffloadModule
from offload_solver import (
    CostModel,
    HardwareProfile,
    InfeasibleBudgetError,
    ModelProfile,
    ParamPlacement,
    Plan,
    StatePlacement,
    StreamedStepCosts,
)
from offload_solver import solve as solve_plan
from offload_solver.regions import BLOCK_SEARCH_RANGE_BYTES
from offload_trace import TracedModel, trace
from offload_trace.traced import ATTENTION_OPS

log = logging.getLogger(__name__)

MiB = 2**20

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``None`` means the current CUDA device when CUDA is available, else the CPU."""
    if device is None:
        return (
            torch.device("cuda", torch.cuda.current_device())
            if torch.cuda.is_available()
            else torch.device("cpu")
        )
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device 'cuda' was requested but CUDA is not available here")
    index: int | None = dev.index  # None for a bare "cuda"
    if dev.type == "cuda" and index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type not in ("cuda", "cpu"):
        raise ValueError(f"device {dev} is not supported; use 'cuda' or 'cpu'")
    return dev


def measure_device_bytes_in_use(
    device: torch.device, model: torch.nn.Module | None = None, dtype: torch.dtype = torch.float16
) -> int:
    """Device bytes allocated now that stay allocated while ``model`` trains, beside what a
    plan places: what ``solve(device_bytes_in_use=)`` takes off the budget.

    That is everything the caching allocator holds on ``device`` (the inputs, the
    caller's other tensors, and the BLAS libraries' workspaces, allocated here by one small
    ``dtype`` matrix product forward and backward if training has not run yet), less
    ``model``'s own parameters and buffers on ``device``, which the offloaded module
    copies into its own storage. On the CPU: 0 (no device allocator to ask).
    """
    if device.type != "cuda":
        return 0
    with torch.cuda.device(device):
        # cuBLAS keeps a workspace per handle and stream, taken from the caching allocator
        # at the first product and held from then on: one for the thread that runs forward,
        # one for autograd's device thread that runs backward. A first training step would
        # allocate them; do it now so that they are counted. Both kinds of product a
        # model runs: a plain one, and one with a vector bias (cuBLASLt's path).
        x = torch.ones(16, 16, device=device, dtype=dtype, requires_grad=True)
        bias = torch.ones(16, device=device, dtype=dtype, requires_grad=True)
        out = torch.addmm(x, x, x).sum() + torch.nn.functional.linear(x, x, bias).sum()
        torch.autograd.backward(out)
        del x, bias, out
        torch.cuda.synchronize(device)  # sync point: backward's frees are done
        used = torch.cuda.memory_allocated(device)
    own = 0
    if model is not None:
        seen: set[int] = set()
        for t in (*model.parameters(), *model.buffers()):
            storage = t.untyped_storage()
            if t.device == device and storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                own += storage.nbytes()
    return max(0, used - own)


def matmul_shapes(gm: fx.GraphModule) -> list[MatmulShape]:
    """The (m, k, n) of every matrix product in a traced graph, for compute profiling."""
    out: list[MatmulShape] = []
    aten = torch.ops.aten
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        vals = [a.meta.get("val") for a in node.all_input_nodes]
        if node.target in (aten.mm.default, aten.addmm.default, aten.linear.default):
            tensors = [v for v in vals if isinstance(v, torch.Tensor) and v.dim() >= 2]
            if node.target is aten.addmm.default:
                tensors = tensors[-2:]
            if len(tensors) < 2:
                continue
            x, w = tensors[0], tensors[1]
            m = x.numel() // x.shape[-1]
            k = x.shape[-1]
            n = w.shape[0] if node.target is aten.linear.default else w.shape[-1]
            out.append((int(m), int(k), int(n)))
    return out


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One fused attention call of a traced graph: its query's ``[batch, heads, seq,
    head_dim]`` and its dropout probability, and how many calls have them."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dropout_p: float
    calls: int = 1


AttentionMeasure = Callable[[AttentionShape], tuple[float, float]]
"""Measures causal fused attention at one shape: (forward, backward) FLOP/s."""


def measures_attention(
    measure_attention: bool | None, device: torch.device, hardware: HardwareProfile | None
) -> bool:
    """Whether :func:`memory_optimize` measures fused attention on ``device`` for its plan:
    as ``measure_attention`` says, or, where it is None, on a CUDA device unless
    ``hardware`` (the profile given, if any) already has both attention rates. True on a
    device other than CUDA is a ValueError: the rates are the training GPU's."""
    if measure_attention is None:
        return device.type == "cuda" and not (
            hardware is not None
            and hardware.attention_fwd_flop_per_s > 0
            and hardware.attention_bwd_flop_per_s > 0
        )
    if measure_attention and device.type != "cuda":
        raise ValueError(
            f"measure_attention=True measures fused attention on the GPU that trains the "
            f"model, and the device is {device}: leave it False on the CPU"
        )
    return measure_attention


def measure_attention_at(
    device: torch.device | str,
    shape: AttentionShape,
    *,
    dtype: torch.dtype | None = None,
    reps: int = 5,
) -> tuple[float, float]:
    """:func:`offload_runtime.hardware.measure_attention_flop_per_s` at ``shape``:
    (forward, backward) FLOP/s on ``device``."""
    return measure_attention_flop_per_s(
        device,
        batch=shape.batch,
        heads=shape.heads,
        seq=shape.seq,
        head_dim=shape.head_dim,
        dtype=dtype,
        dropout_p=shape.dropout_p,
        reps=reps,
    )


def _dropout_of(node: fx.Node) -> float:
    """A fused attention node's dropout probability: ``dropout_p`` by keyword, else the
    position each op's schema gives it (``aten.scaled_dot_product_attention``: 4th
    argument after the mask; the flash / efficient / cudnn variants: right after the
    value, or after their bias)."""
    given = node.kwargs.get("dropout_p")
    if isinstance(given, float | int) and not isinstance(given, bool):
        return float(given)
    aten = torch.ops.aten
    index = 4 if node.target is aten.scaled_dot_product_attention.default else 3
    for arg in node.args[index:]:  # the first number after the tensors
        if isinstance(arg, float | int) and not isinstance(arg, bool):
            return float(arg)
    return 0.0


def attention_shapes(gm: fx.GraphModule) -> list[AttentionShape]:
    """The distinct shapes of the fused attention calls in a traced graph, in graph order,
    each with its number of calls (the example zoo's GPT-2 XL: one shape, 48 calls)."""
    counts: dict[tuple[int, int, int, int, float], int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ATTENTION_OPS or not node.args:
            continue
        query = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            continue
        b, h, sq, d = (int(x) for x in query.shape)
        key = (b, h, sq, d, _dropout_of(node))
        counts[key] = counts.get(key, 0) + 1
    return [AttentionShape(*key, calls=n) for key, n in counts.items()]


def with_attention_rates(
    hardware: HardwareProfile, shapes: list[AttentionShape], measure: AttentionMeasure
) -> HardwareProfile:
    """``hardware`` with fused attention's rates (``attention_fwd_flop_per_s`` /
    ``attention_bwd_flop_per_s``) measured by ``measure`` at ``shapes``: the whole
    model's attention FLOPs over the time they take, each shape weighted by its calls and
    FLOPs (``torch.utils.flop_counter``'s count, which is the trace's for these operations
    and which ``measure_attention_flop_per_s`` divides by the time). Unchanged when there
    is no attention call."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if not shapes:
        return hardware
    fwd_flop = bwd_flop = fwd_s = bwd_s = 0.0
    for shape in shapes:
        dims = (shape.batch, shape.heads, shape.seq, shape.head_dim)
        f = shape.calls * float(sdpa_flop_count(dims, dims, dims))  # type: ignore[no-untyped-call]
        b = shape.calls * float(sdpa_backward_flop_count(dims, dims, dims, dims))  # type: ignore[no-untyped-call]
        fwd_rate, bwd_rate = measure(shape)
        if fwd_rate <= 0 or bwd_rate <= 0:
            raise ValueError(
                f"attention rates must be > 0 FLOP/s, measured {fwd_rate} and {bwd_rate} at {shape}"
            )
        fwd_flop, bwd_flop = fwd_flop + f, bwd_flop + b
        fwd_s, bwd_s = fwd_s + f / fwd_rate, bwd_s + b / bwd_rate
    return dataclasses.replace(
        hardware,
        attention_fwd_flop_per_s=fwd_flop / fwd_s,
        attention_bwd_flop_per_s=bwd_flop / bwd_s,
    )


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


def build_offload_module(
    model: torch.nn.Module,
    traced: TracedModel,
    profile: ModelProfile,
    plan: Plan,
    device: torch.device,
    *,
    host_worker: bool | None = None,
) -> OffloadModule:
    """Region storage from the model's real weights, passes applied to both graph modes."""
    named = dict(model.named_parameters(remove_duplicate=False))
    meta = [name for name, p in named.items() if p.is_meta]
    if meta:
        raise ValueError(
            f"model parameters are on the meta device (e.g. {meta[0]!r}): memory_optimize "
            "needs real weights; build the model on the CPU or load a state dict first "
            "(meta models can still be planned with offload_trace + offload_solver)"
        )
    buffers = dict(model.named_buffers(remove_duplicate=False))
    wanted = set(traced.buffer_names)
    return OffloadModule(
        plan=plan,
        graph_train=traced.module_for(device, training=True),
        graph_eval=traced.module_for(device, training=False),
        param_targets=dict(traced.param_names),
        canonical=profile.canonical_names(),
        buffers={name: b for name, b in buffers.items() if name in wanted},
        state=named,
        device=device,
        dtype=traced.dtype,
        op_names=tuple(traced.operation_names),
        tied_groups=profile.tied_groups,
        host_worker=host_worker,
    )


def device_conversion_profile(profile: ModelProfile) -> ModelProfile:
    """``profile`` as a runtime with ``convert_on_device`` moves it: fp32 gradients to the
    host, fp32 masters to the device (4 bytes per element each way), no host casts."""
    return dataclasses.replace(profile, host_grad_bytes_per_param=4, host_upload_bytes_per_param=4)


def choose_plan(
    profile: ModelProfile,
    hardware: HardwareProfile,
    memory_budget: int,
    solver_name: str = "asyn",
    *,
    convert_on_device: bool | None = None,
    block_search_range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
    host_step_after_backward: bool = False,
    state_on_device: bool = True,
    speculative_step_cost: float = 1.0,
    speculative_params: int | None = None,
    speculation_thread: bool = False,
    device_bytes_in_use: int = 0,
    micro_batches: int = 1,
    streamed: StreamedStepCosts | None = None,
    late_host_work: bool = True,
    cost_model: CostModel | None = None,
) -> tuple[bool, ModelProfile, Plan, dict[bool, float]]:
    """Solve ``profile`` (a traced model's, host conversion) as :func:`memory_optimize`
    does: for each place the dtype conversions may run (``convert_on_device``; None: both,
    see :func:`device_conversion_profile`), keeping the plan with the shortest predicted
    step (a tie keeps host conversion: half the PCIe bytes).

    The other arguments are ``offload_solver.solve``'s. Returns (whether the chosen plan
    converts on the device, the profile it was solved for, the plan, the predicted step
    in seconds of each variant that fits). Raises ``InfeasibleBudgetError`` (the smallest
    least budget) when no variant fits.
    """
    choices = [False, True] if convert_on_device is None else [convert_on_device]
    candidates: list[tuple[float, bool, ModelProfile, Plan]] = []
    errors: list[InfeasibleBudgetError] = []
    for on_device in choices:
        variant = device_conversion_profile(profile) if on_device else profile
        try:
            variant_plan = solve_plan(
                variant,
                hardware,
                memory_budget,
                solver=solver_name,
                block_search_range_bytes=block_search_range_bytes,
                host_step_after_backward=host_step_after_backward,
                state_on_device=state_on_device,
                speculative_step_cost=speculative_step_cost,
                speculative_params=speculative_params,
                speculation_thread=speculation_thread,
                device_bytes_in_use=device_bytes_in_use,
                micro_batches=micro_batches,
                streamed=streamed,
                late_host_work=late_host_work,
                cost_model=cost_model,
            )
        except InfeasibleBudgetError as exc:
            errors.append(exc)
            continue
        candidates.append((variant_plan.predicted_step_time_s, on_device, variant, variant_plan))
    if not candidates:
        raise min(errors, key=lambda e: e.least_budget_bytes)
    _, on_device, chosen, plan = min(candidates, key=lambda c: (c[0], c[1]))
    return on_device, chosen, plan, {c[1]: c[0] for c in candidates}


def _check_host_step(params_per_s: float | None, cost: float | None) -> None:
    """ValueError unless each way the host step is told is a positive number."""
    if cost is not None and not cost > 0:
        raise ValueError(f"host_step_cost must be > 0, got {cost}")
    if params_per_s is not None and not params_per_s > 0:
        raise ValueError(f"host_step_params_per_s must be > 0 parameters/s, got {params_per_s}")


HOST_RATES_DISAGREE: float = 2.0
"""Factor between the two host rates :func:`planning_hardware` is told (the profile's over
``host_step_cost``, and ``host_step_params_per_s``) above which it warns. Readings of one
host spread by up to about this much while other work runs on it; further apart, the
profile was most likely measured while the host was busy, and plans made from it mislead
(BENCHMARKS.md, Decisions, "Planning from the kernel's own rate samples")."""


def _profile_is_measured(device: torch.device) -> bool:
    """Whether :func:`profile_hardware` measures ``device`` (a GPU) rather than returning
    the CPU's default profile, whose host rate is no measurement to check."""
    return device.type == "cuda"


def _host_rates_disagree(
    hardware: HardwareProfile, params_per_s: float | None, cost: float | None
) -> bool:
    """Whether the profile's host rate over ``cost`` and ``params_per_s`` (both given) are
    more than :data:`HOST_RATES_DISAGREE` apart."""
    if params_per_s is None or cost is None:
        return False
    return _apart(hardware.host_adam_params_per_s / cost, params_per_s) > HOST_RATES_DISAGREE


def _apart(a: float, b: float) -> float:
    """How many times the larger of two positive rates is the smaller."""
    return max(a, b) / min(a, b)


def _warn_host_rates_disagree(by_cost: float, absolute: float) -> None:
    """RuntimeWarning when the host rate by cost and the absolute one are more than
    :data:`HOST_RATES_DISAGREE` apart (both parameters/s)."""
    ratio = _apart(by_cost, absolute)
    if ratio > HOST_RATES_DISAGREE:
        warnings.warn(
            f"the host step rate by the profile's fused Adam rate over host_step_cost "
            f"({by_cost / 1e9:.2f} Gparam/s) and host_step_params_per_s "
            f"({absolute / 1e9:.2f} Gparam/s) are {ratio:.1f}x apart; planning with their "
            f"geometric mean ({math.sqrt(by_cost * absolute) / 1e9:.2f}). A profile "
            "measured while the host was busy stays cached: measure it again on a quiet "
            "host (offload_runtime.profile_hardware(device, dtype=..., force=True)).",
            RuntimeWarning,
            stacklevel=3,
        )


def planning_hardware(
    hardware: HardwareProfile,
    *,
    host_step_params_per_s: float | None = None,
    host_step_cost: float | None = None,
    fp16_io: bool = False,
    warn_host_rates: bool = True,
) -> HardwareProfile:
    """``hardware`` as :func:`memory_optimize` plans with it, given the same arguments: the
    host Adam rate replaced by the optimizer's own (``host_step_params_per_s`` in
    parameters/s, or ``host_step_cost``, its time over the profile's fused fp32 step; given
    both, the geometric mean of that rate and the profile's over the cost), and no
    conversion passes charged with ``fp16_io`` (they happen inside the host step). The cost
    model's fitted factors are no part of it: they go to the solver apart
    (``choose_plan(cost_model=)``).
    For planning without building, e.g. the example's ``--plan_only``. With
    ``warn_host_rates`` (memory_optimize: on a GPU, whose profile is measured; the CPU's
    default profile holds no measured rate), warns when the two host rates are more than
    :data:`HOST_RATES_DISAGREE` apart."""
    _check_host_step(host_step_params_per_s, host_step_cost)
    if host_step_cost is not None:
        by_cost = hardware.host_adam_params_per_s / host_step_cost
        if host_step_params_per_s is not None and warn_host_rates:
            _warn_host_rates_disagree(by_cost, host_step_params_per_s)
        host_step_params_per_s = (
            by_cost
            if host_step_params_per_s is None
            else math.sqrt(by_cost * host_step_params_per_s)
        )
    if host_step_params_per_s is not None:
        hardware = dataclasses.replace(hardware, host_adam_params_per_s=host_step_params_per_s)
    if fp16_io:
        hardware = dataclasses.replace(hardware, host_convert_elems_per_s=0.0)
    return hardware


def memory_optimize(
    model: torch.nn.Module,
    inputs: Mapping[str, torch.Tensor] | tuple[Any, ...],
    memory_budget: int,
    solver_name: str = "asyn",
    *,
    dtype: torch.dtype = torch.float16,
    hardware: HardwareProfile | None = None,
    device: torch.device | str | None = None,
    progress: bool = True,
    block_search_range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
    host_step_after_backward: bool | None = None,
    state_on_device: bool = True,
    host_worker: bool | None = None,
    convert_on_device: bool | None = None,
    host_step_params_per_s: float | None = None,
    host_step_cost: float | None = None,
    speculative_step_cost: float = 1.0,
    speculative_params: int | None = None,
    speculation_thread: bool | None = None,
    fp16_io: bool = False,
    device_bytes_in_use: int | None = None,
    micro_batches: int = 1,
    streamed: StreamedStepCosts | None = None,
    late_host_work: bool = True,
    measure_attention: bool | None = None,
    fuse_gelu: bool = True,
    cost_model: CostModel | None = None,
) -> OffloadModule:
    """Plan and apply parameter offload so that training ``model`` fits ``memory_budget``.

    Args:
        model: the model with real weights (CPU or GPU); it is traced, not modified.
        inputs: example inputs, a dict of keyword tensors or a tuple of positional ones;
            shapes are fixed at trace time.
        memory_budget: device memory budget in bytes (the solver plans against 0.95 of it).
        solver_name: ``"asyn"`` (prefetch on the h2d stream) or ``"syn"``.
        dtype: training dtype: float16, bfloat16, or float32 (for exact tests).
        hardware: a profile to plan with; default: measured on this device (cached), or
            the documented CPU default when there is no CUDA.
        device: where to train; default CUDA when available, else the CPU.
        progress: print the phases and the summary line.
        block_search_range_bytes: how far above the largest region the region builder
            searches for the pool block size (the reference's 128 MiB); small regions packed
            into one block are merged, so 0 keeps the finest regions (useful for tiny models).
        host_step_after_backward: tell the planner that the optimizer steps host regions
            only after backward (fp16 overflow check or clipping need a global answer);
            default: True for float16, False otherwise (offload_optim speculates there).
        state_on_device: allow the plan to keep optimizer state on the device (False: all
            on the host, the reference's behaviour).
        host_worker: host-side gradient work on a worker thread (default: on CUDA only).
        convert_on_device: where host-state regions change dtype. True: on the device;
            gradients cross to the host as fp32 straight into the accumulators (when nothing
            is accumulated) and parameters are uploaded from the fp32 masters and narrowed
            on the device, so the host makes no conversion pass (it only runs Adam) and
            keeps no training-dtype copies, at twice the PCIe bytes and with longer-lived
            device gradients (the plan counts both). False: in the training dtype, cast on
            the host. None (default): plan both and keep the one the simulator predicts
            faster (a host-bound step gains; a PCIe-bound one does not; measured:
            BENCHMARKS.md, Decisions, "Dtype conversions on the device").
        host_step_params_per_s: the host optimizer's throughput in parameters per second,
            when it is not torch's fused fp32-moment Adam that the hardware profile
            measures (e.g. ``offload_optim.measure_host_step_params_per_s(torch.bfloat16)``
            for bf16 moments); it replaces the profile's host Adam rate in planning.
        host_step_cost: the same told as a ratio: how many times the time of torch's fused
            fp32 Adam step (the profile's rate) the optimizer's host step takes
            (``offload_optim.measure_host_step_cost(...)`` with the optimizer's moments,
            kernel and fp16 I/O). The planner charges the profile's rate divided by it. A
            ratio measured back to back holds when the host is slower for a while, where
            an absolute rate measured then does not. Given with
            ``host_step_params_per_s``, the planner takes the geometric mean of the two
            rates: they come from different timings on a shared host, and their mean
            predicts closer than either (measured: BENCHMARKS.md, Decisions, "Planning
            from the kernel's own rate samples"). Where the two are more than
            :data:`HOST_RATES_DISAGREE` apart and the profile came from the cache
            (``hardware=None``), the machine is measured again first (and the cache
            rewritten), since a profile read while the host was busy stays cached. A
            warning follows if they still are.
        speculative_step_cost: with ``host_step_after_backward=False`` in fp16 (the
            optimizer speculates and keeps undo data, ``AMPOptimizer(speculate_fp16=True)``),
            how many times longer a speculative host step takes than a plain one
            (``offload_optim.measure_speculative_step_cost(host_kernel=...)`` with the
            optimizer's kernel). 1 (default): such steps cost what plain ones do (bf16,
            fp32).
        speculative_params: with ``host_step_after_backward=False``, how many host-state
            parameters may step under backward (None: all); pass the optimizer's
            ``AMPOptimizer(speculative_params=)`` when host memory cannot hold undo
            buffers for all of them (see ``offload_solver.solve``).
        speculation_thread: with ``host_step_after_backward=False``, whether the optimizer
            runs the steps taken under backward on a thread of their own, so that its
            ``step()`` does not wait for them (``HybridAdam(speculation_thread=)``). None
            (default): as ``HybridAdam`` does by default, True in fp16 (its speculative
            steps) and False otherwise (bf16 and fp32 hooks step their regions in place).
        fp16_io: the optimizer steps host-state regions by fp16 I/O
            (``HybridAdam(fp16_io=True)``): fp16 training with host conversion, whose
            widening and narrowing happen inside the host step. The plan then converts on
            the host and charges no conversion passes; pass the kernel's cost as
            ``host_step_cost`` (``offload_optim.measure_host_step_cost(
            host_kernel="single_pass", fp16_io=True)``). Needs ``dtype=torch.float16`` and
            ``convert_on_device`` False or None.
        device_bytes_in_use: device bytes that stay allocated beside the plan's while the
            model trains; they come off the budget and count in the predicted peak.
            Default: measured by :func:`measure_device_bytes_in_use` once the hardware is
            profiled (on CUDA: the BLAS workspaces, the inputs, anything else allocated
            on the device; on the CPU: 0).
        micro_batches: forward and backward passes per optimizer step, when the training
            loop accumulates gradients (``AMPOptimizer``'s accumulation). The plan's
            predicted step time then covers them all, and uploads paid in every
            micro-batch are weighed against host steps paid once.
        streamed: let the planner step some host-state regions on the device instead
            (``StatePlacement.STREAMED``: state stays in pinned host memory, goes up and
            back down around a device step) where that shortens the step and fits the
            budget. Pass what the optimizer will move and hold:
            ``offload_optim.streamed_step_costs(moments_dtype, fp16_io,
            budget_bytes=memory_budget)``, with the moments and fp16 I/O the
            ``HybridAdam`` is built with. It pays where the host step bounds the step and
            PCIe has time to spare (measured: BENCHMARKS.md, Decisions, "Streamed host
            state"). Default None: no region is streamed.
        late_host_work: after the greedy phases, move host-state regions' placements to
            later resident regions with device state while the predicted step gets
            shorter: a region late in forward order has its gradients first and its
            parameters needed last, so its host step waits least
            (``offload_solver.solvers._late``; measured: BENCHMARKS.md, Decisions, "Late
            host work"). Default True; False keeps the greedy phases' placements.
        measure_attention: measure causal fused attention on the training GPU at the
            traced model's own attention shapes (:func:`attention_shapes`, a second or
            so) and plan with those rates (``HardwareProfile.attention_fwd_flop_per_s``
            / ``attention_bwd_flop_per_s``, :func:`with_attention_rates`) instead of the
            matrix-product rate, which fused attention runs well under, so that predicted
            steps come closer to measured ones (measured: BENCHMARKS.md, "Decisions").
            None (the default): measure on a CUDA device unless ``hardware`` already
            carries attention rates (a profile saved from such a plan, planned again the
            same way), and not elsewhere. True on a device other than CUDA is an error;
            False prices attention at the matrix products' rate.
        fuse_gelu: trace with each tanh GELU written out in element-wise operations
            (GPT-2's ``gelu_new``) replaced by one ``aten.gelu(approximate="tanh")``
            (``offload_trace.trace(fuse_gelu=True)``): the same formula in one kernel,
            seven fewer operations to issue per layer in forward and in backward, and
            three fewer activations of the MLP's width saved per layer, which the plan
            then has room for. Results differ from the model as written by rounding.
            Default True (measured: BENCHMARKS.md, Decisions, "Fused tanh GELU"). A model
            without that chain is traced unchanged; False traces every model as written.
        cost_model: the simulator's fitted factors (``offload_solver.CostModel``: how
            slowly the host issues the backward beside host-state regions, how fast the
            streamed regions' state copies go up and how much of their host-memory
            contention the host is charged); None (default): ``CostModel()``, the fitted
            defaults. ``offload_optim.check_backward_issue`` and ``check_stream_rate``
            read what a training loop shows, to plan again with. The plan records it
            (``Plan.cost_model``).

    Raises:
        ValueError: bad arguments, or (``InfeasibleBudgetError``) a budget below the least
            feasible one, which the message names.
        RuntimeError: host memory too small for the plan's host-resident state.
    """
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, int) or memory_budget <= 0:
        raise ValueError(f"memory_budget must be a positive number of bytes, got {memory_budget!r}")
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported; use float16, bfloat16 or float32")
    if fp16_io and (dtype != torch.float16 or convert_on_device):
        raise ValueError(
            "fp16_io=True plans fp16 training converted on the host: pass "
            "dtype=torch.float16 and convert_on_device=False (or None)"
        )
    _check_host_step(host_step_params_per_s, host_step_cost)
    if cost_model is not None and not isinstance(cost_model, CostModel):
        raise ValueError(
            f"cost_model must be None or an offload_solver.CostModel, got {cost_model!r}"
        )
    dev = resolve_device(device)
    measure_attention = measures_attention(measure_attention, dev, hardware)
    say = _say if progress else _quiet
    t0 = time.perf_counter()
    traced = trace(model, inputs, dtype=dtype, target_device=dev.type, fuse_gelu=fuse_gelu)
    base_profile = traced.to_profile(name=type(model).__name__)
    say(f"traced {len(base_profile.operations)} operations in {time.perf_counter() - t0:.1f} s")
    if traced.fused_gelu:
        say(f"fused {len(traced.fused_gelu)} written-out tanh GELU(s) into one operation each")
    if hardware is None:
        shapes_of_model = matmul_shapes(traced.graph_module)
        hardware = profile_hardware(
            dev, dtype=dtype, matmul_shapes=shapes_of_model, progress=progress
        )
        if _profile_is_measured(dev) and _host_rates_disagree(
            hardware, host_step_params_per_s, host_step_cost
        ):
            # The cached profile's host Adam rate is far from the rate measured just now
            # (a profile read while the host was busy stays cached): measure it again.
            say(
                f"the cached profile's host Adam rate "
                f"({hardware.host_adam_params_per_s / 1e9:.2f} Gparam/s) is over "
                f"{HOST_RATES_DISAGREE:g}x from host_step_params_per_s over host_step_cost: "
                "measuring the machine again"
            )
            hardware = profile_hardware(
                dev,
                dtype=dtype,
                matmul_shapes=shapes_of_model,
                progress=progress,
                force=True,
            )
    if measure_attention:
        shapes = attention_shapes(traced.graph_module)
        hardware = with_attention_rates(
            hardware, shapes, lambda shape: measure_attention_at(dev, shape, dtype=dtype)
        )
        if shapes:
            say(
                f"fused attention at {len(shapes)} shape(s) of the model: forward "
                f"{hardware.attention_fwd_flop_per_s / 1e12:.0f} TFLOP/s, backward "
                f"{hardware.attention_bwd_flop_per_s / 1e12:.0f} TFLOP/s (matrix products "
                f"{hardware.compute_flop_per_s / 1e12:.0f})"
            )
    hardware = planning_hardware(
        hardware,
        host_step_params_per_s=host_step_params_per_s,
        host_step_cost=host_step_cost,
        fp16_io=fp16_io,
        warn_host_rates=_profile_is_measured(dev),
    )
    if fp16_io:
        convert_on_device = False
    if device_bytes_in_use is None:
        device_bytes_in_use = measure_device_bytes_in_use(dev, model, dtype)
        if device_bytes_in_use:
            say(
                f"{device_bytes_in_use / MiB:.1f} MiB of device memory are in use beside "
                "the plan (library workspaces, the inputs, other tensors): planning for the "
                "rest of the budget"
            )
    t1 = time.perf_counter()
    after_backward = (
        dtype == torch.float16 if host_step_after_backward is None else host_step_after_backward
    )
    spec_thread = not after_backward and (
        dtype == torch.float16 if speculation_thread is None else speculation_thread
    )
    on_device, profile, plan, times = choose_plan(
        base_profile,
        hardware,
        memory_budget,
        solver_name,
        convert_on_device=convert_on_device,
        block_search_range_bytes=block_search_range_bytes,
        host_step_after_backward=after_backward,
        state_on_device=state_on_device,
        speculative_step_cost=speculative_step_cost,
        speculative_params=speculative_params,
        speculation_thread=spec_thread,
        device_bytes_in_use=device_bytes_in_use,
        micro_batches=micro_batches,
        streamed=streamed,
        late_host_work=late_host_work,
        cost_model=cost_model,
    )
    if len(times) == 2:
        say(
            f"dtype conversion on the {'device' if on_device else 'host'}: predicted step "
            f"{times[True] * 1e3:.1f} ms converting on the device, {times[False] * 1e3:.1f} ms "
            "on the host"
        )
    say(
        f"solver {solver_name}: {len(plan.regions)} regions, "
        f"{sum(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)} offloaded, "
        f"predicted peak {plan.predicted_peak_bytes / MiB:.1f} MB, step "
        f"{plan.predicted_step_time_s * 1e3:.1f} ms ({time.perf_counter() - t1:.2f} s)"
    )
    plan = dataclasses.replace(
        plan,
        options=dataclasses.replace(
            plan.options,
            host_kernel="single_pass" if fp16_io else "torch",
            fp16_io=fp16_io,
            convert_on_device=on_device,
            speculative=dtype == torch.float16 and not after_backward,
            stage_in_backward=streamed is None or streamed.staged_chunks > 0,
        ),
    )
    module = build_offload_module(model, traced, profile, plan, dev, host_worker=host_worker)
    module.profile = profile
    module.hardware = hardware
    s = plan_summary(profile, plan)
    if progress:  # the reference's summary line, on stdout
        print(
            f"act_peak_mem={s['act_peak_mem_mb']:.3f} MB | "
            f"max_param_mem={s['max_param_mem_mb']:.3f} MB | "
            f"total_param_mem={s['total_param_mem_mb']:.3f} MB",
            flush=True,
        )
    return module


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _quiet(message: str) -> None:
    log.info(message)
