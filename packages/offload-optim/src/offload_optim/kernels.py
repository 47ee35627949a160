"""The host Adam kernels' rates and cost ratios, timed by the runtime's one host step
timer (``offload_runtime.hardware.measure_host_step``) over the runtime's kernels
(``offload_runtime.host_kernels``)."""

from __future__ import annotations

import statistics

import torch

from offload_runtime.hardware import HostStep, kernel_steps, measure_host_step


def measure_host_step_params_per_s(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    steps: int = 3,
    host_kernel: str = "torch",
    speculative: bool = False,
    fp16_io: bool = False,
) -> float:
    """Host Adam(W) throughput of ``offload_runtime.host_kernels.fused_adam_`` with
    ``moments_dtype`` moments: parameters per second over ``numel`` fp32 parameters, timed by
    ``offload_runtime.hardware.measure_host_step`` (one untimed step that touches every
    page, then the median of ``steps`` timed steps, with torch's current thread count), as
    the hardware profile's fused Adam rate is.

    What the planner should charge per host-state parameter when the optimizer is not
    torch's fused fp32-moment Adam, e.g. ``memory_optimize(...,
    host_step_params_per_s=measure_host_step_params_per_s(torch.bfloat16))``. A single
    reading taken while the host is slower for a while misleads the plan: the example
    and the benchmark plan with the median of a few readings of the kernel the optimizer
    runs, and nothing else (BENCHMARKS.md, Decisions, "Planning from the kernel's own
    rate samples"). Given :func:`measure_host_step_cost` too
    (``memory_optimize(host_step_cost=)``), the planner takes the geometric mean of this
    rate and the profile's fused rate over the cost. Needs about ``(8 + 2 * moment
    bytes) * numel`` bytes of host memory. ``host_kernel="single_pass"`` times
    ``offload_runtime.host_kernels.single_pass.adam_`` instead (what ``HybridAdam(host_kernel=...)``
    steps with; needs numba). ``speculative=True`` times the step that keeps undo data
    (that kernel's ``speculative_adam_``: what ``AMPOptimizer(speculate_fp16=True)`` runs
    under backward; ``4 + 2 * moment bytes`` more per parameter); see
    :func:`measure_speculative_step_cost` for the ratio the planner takes.
    ``fp16_io=True`` (single-pass, fp32 or bf16 moments) times the kernels of
    ``HybridAdam(fp16_io=True)``, which read an fp16 gradient and write an fp16 copy of
    the master in the same pass (2 more bytes per parameter of host memory, 2 fewer).
    """
    if steps < 1:
        raise ValueError(f"steps ({steps}) must be >= 1")
    kind = kernel_steps(moments_dtype, numel, host_kernel, fp16_io)
    step = kind.speculative if speculative else kind.plain
    return measure_host_step(step, numel, steps=steps).params_per_s


def measure_host_step_cost(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    host_kernel: str = "torch",
    fp16_io: bool = False,
    pairs: int = 5,
    gap_s: float = 0.05,
) -> float:
    """How many times the time of torch's fused fp32-moment Adam step a host step of this
    kind takes: what ``memory_optimize(..., host_step_cost=)`` should be given for an
    optimizer that is not torch's fused fp32 Adam (the hardware profile measures that one).

    The median, over ``pairs`` back-to-back pairs, of this kind's step time over the fused
    fp32 step's (each the median of 3 steps by ``offload_runtime.hardware.measure_host_step``,
    as in :func:`measure_host_step_params_per_s`), both over ``numel`` parameters with
    torch's current thread count. A ratio taken back to back holds when the host is slower
    for a while, where an absolute rate does not. Below 1 when the kind moves fewer bytes
    (bf16 moments with ``host_kernel="single_pass"``). Needs about
    ``(16 + 8 + 2 * moment bytes) * numel`` bytes of host memory.

    The two halves of a pair take turns going first, and each sleeps ``gap_s`` seconds
    after its untimed step (``measure_host_step``'s ``settle_s``): torch's and numba's
    thread pools are separate, and a pool that has just finished may keep its threads
    spinning on the cores the other one needs, which slows whichever runs second. About
    ``2 * pairs * (gap_s + 4 steps)`` seconds in all.
    """
    if pairs < 1:
        raise ValueError(f"pairs ({pairs}) must be >= 1")
    if gap_s < 0:
        raise ValueError(f"gap_s ({gap_s}) must be >= 0")
    fused = kernel_steps(torch.float32, numel, "torch").plain
    kind = kernel_steps(moments_dtype, numel, host_kernel, fp16_io).plain

    def settled(step: HostStep) -> float:
        return measure_host_step(step, numel, steps=3, settle_s=gap_s).median_s

    ratios = []
    for i in range(pairs):
        if i % 2:
            fused_s = settled(fused)
            kind_s = settled(kind)
        else:
            kind_s = settled(kind)
            fused_s = settled(fused)
        ratios.append(kind_s / max(fused_s, 1e-9))
    return statistics.median(ratios)


def measure_speculative_step_cost(
    moments_dtype: torch.dtype = torch.float32,
    numel: int = 64 << 20,
    *,
    host_kernel: str = "torch",
    pairs: int = 3,
    fp16_io: bool = False,
) -> float:
    """How many times a plain host step a speculative one takes (>= 1): what
    ``memory_optimize(..., speculative_step_cost=)`` should charge the fp16 host steps
    that ``AMPOptimizer(speculate_fp16=True)`` takes under backward.

    The median, over ``pairs`` back-to-back pairs on one set of buffers, of the time of
    a speculative step over that of a plain one (each the median of 3 steps by
    ``offload_runtime.hardware.measure_host_step``, as in
    :func:`measure_host_step_params_per_s`; one pair varies a lot on a shared host).
    Lower with ``host_kernel="single_pass"``, which writes the undo data in the step's
    own pass, than with torch's kernel. Needs about ``(12 + 4 * moment bytes) * numel``
    bytes of host memory. ``fp16_io``: the fp16-I/O kernels' ratio, as in
    :func:`measure_host_step_params_per_s`.
    """
    if pairs < 1:
        raise ValueError(f"pairs ({pairs}) must be >= 1")
    kind = kernel_steps(moments_dtype, numel, host_kernel, fp16_io)

    def median_s(step: HostStep) -> float:
        return measure_host_step(step, numel, steps=3).median_s

    ratios = [median_s(kind.speculative) / max(median_s(kind.plain), 1e-9) for _ in range(pairs)]
    return max(1.0, statistics.median(ratios))
