"""The rate of a host optimizer step, measured one way for every kernel.

[Note: one host step timer]
Every plan charges its host Adam steps at a measured rate: the hardware profile's
``host_adam_params_per_s`` (torch's fused fp32 Adam, :func:`measure_host_adam_params_per_s`)
and its ``host_step_rates``, one per configuration of the kernels the optimizer can run
(torch's or the single-pass ones of ``offload_runtime.host_kernels``; fp32 or bf16 moments;
fp16 I/O; plain or speculative: :func:`measure_host_step_rates` over :func:`kernel_steps`).
All of them are timed by :func:`measure_host_step`, so two rates differ only by the kernel
and the buffers the caller hands in, never by how they were timed; torch's fused fp32 rate
is read once and recorded in both places. This module owns the method:

- one untimed step first: it touches every page the step writes and lets the kernel
  allocate what it allocates lazily (a torch optimizer's moments), so no timed step pays a
  page fault or an allocation;
- then an optional sleep (``settle_s``): another thread pool that has just run (numba's
  OpenMP threads, torch's) may keep spinning on the cores the step needs;
- then the median wall time of ``steps`` timed steps, with the number of CPU threads torch
  runs with (the single-pass kernels use as many, see ``host_kernels/single_pass.py``)
  recorded beside it.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from offload_runtime.host_kernels import (
    HOST_KERNELS,
    AdamHyper,
    fused_adam_,
    low_precision,
    single_pass,
    speculative_adam_,
)
from offload_solver import HostStepRate
from offload_solver.host_rates import BF16_MASTER_STATES

__all__ = [
    "HOST_ADAM_READS_SPREAD",
    "HostStep",
    "HostStepTiming",
    "KernelSteps",
    "bf16_master_step",
    "host_adam_median",
    "kernel_steps",
    "measure_host_adam_params_per_s",
    "measure_host_step",
    "torch_fused_adam_step",
]

HOST_ADAM_NUMEL = 32 * 2**20
"""Parameters of the profile's host Adam read (and of the copy-contention probe)."""
_ADAM_CHUNK_NUMEL = 8 * 2**20
"""Adam is timed over several tensors, as a model's parameter list is, not one."""

HostStep = Callable[[int], object]
"""One step of a host optimizer over buffers it owns, called with the step's count (1 for
the first call), which a kernel that takes Adam's step count for bias correction uses."""


@dataclass(frozen=True)
class HostStepTiming:
    """What :func:`measure_host_step` read."""

    numel: int
    """Parameters one step updates."""
    samples_s: tuple[float, ...]
    """Wall time of each timed step, in order (the untimed first step is not among them)."""
    threads: int
    """``torch.get_num_threads()`` while the steps ran."""

    @property
    def median_s(self) -> float:
        """The median of :attr:`samples_s`."""
        return statistics.median(self.samples_s)

    @property
    def params_per_s(self) -> float:
        """Parameters per second at the median step time."""
        return self.numel / max(self.median_s, 1e-9)


def measure_host_step(
    step: HostStep, numel: int, *, steps: int = 3, settle_s: float = 0.0
) -> HostStepTiming:
    """Time ``step``, a host optimizer step over ``numel`` parameters (see [Note: one host
    step timer]): ``step(1)`` untimed, then ``settle_s`` seconds of sleep, then ``steps``
    timed calls ``step(2)``, ..., ``step(steps + 1)``; the wall time of each with
    ``time.perf_counter``.

    The caller allocates the step's buffers (once, and may time the same step again);
    what the step writes is touched by the untimed call. Rates taken one after another on
    the same buffers (a ratio of two kinds of step) each get their own untimed call.
    """
    if numel < 1 or steps < 1:
        raise ValueError(f"numel ({numel}) and steps ({steps}) must be >= 1")
    if settle_s < 0:
        raise ValueError(f"settle_s ({settle_s}) must be >= 0")
    step(1)
    if settle_s:
        time.sleep(settle_s)
    samples = []
    for count in range(2, steps + 2):
        started = time.perf_counter()
        step(count)
        samples.append(time.perf_counter() - started)
    return HostStepTiming(numel=numel, samples_s=tuple(samples), threads=torch.get_num_threads())


def adam_params(numel: int, device: torch.device) -> list[torch.Tensor]:
    """``numel`` fp32 parameters with gradients on ``device``, in tensors of at most
    8 Mi elements (Adam's cost does not depend on the values)."""
    params = []
    remaining = numel
    while remaining > 0:
        size = min(remaining, _ADAM_CHUNK_NUMEL)
        p = torch.zeros(size, dtype=torch.float32, device=device, requires_grad=True)
        p.grad = torch.full_like(p, 1e-3)  # only its presence matters
        params.append(p)
        remaining -= size
    return params


def fit_adam_numel(numel: int, room_bytes: int, bytes_per_param: int = 16) -> int:
    """Shrink an Adam measurement (``bytes_per_param`` bytes per element: 16 for torch's
    fused fp32 step, 28 for the most a :func:`kernel_steps` step holds) to a quarter of
    ``room_bytes``."""
    if room_bytes <= 0:
        return numel
    return max(2**16, min(numel, room_bytes // 4 // bytes_per_param))


def torch_fused_adam_step(numel: int) -> HostStep:
    """A fused ``torch.optim.Adam`` over ``numel`` fp32 host parameters (in 8 Mi-element
    tensors); the step it returns allocates the moments on its first call. Needs about
    ``16 * numel`` bytes."""
    optimizer = torch.optim.Adam(adam_params(numel, torch.device("cpu")), lr=1e-3, fused=True)

    def step(count: int) -> object:
        return optimizer.step()

    return step


def measure_host_adam_params_per_s(
    numel: int = HOST_ADAM_NUMEL, *, steps: int = 5, settle_s: float = 0.25
) -> float:
    """Fused ``torch.optim.Adam`` steps over ``numel`` fp32 host parameters: elements/s.

    :func:`measure_host_step` of :func:`torch_fused_adam_step`: the median of ``steps``
    timed steps after one untimed step and ``settle_s`` seconds of sleep, with torch's
    current number of CPU threads. Needs about ``16 * numel`` bytes. The sleep lets
    another thread pool that has just run (numba's, whose OpenMP threads may spin for a
    while after a kernel) go idle: torch's fused step runs slower right after such a
    kernel than alone, and this rate is what every plan's host steps are charged against.
    """
    if numel < 1 or steps < 1:
        raise ValueError(f"numel ({numel}) and steps ({steps}) must be >= 1")
    if settle_s < 0:
        raise ValueError(f"settle_s ({settle_s}) must be >= 0")
    timing = measure_host_step(torch_fused_adam_step(numel), numel, steps=steps, settle_s=settle_s)
    return timing.params_per_s


HOST_ADAM_READS_SPREAD = 1.5
"""Ratio of the fastest to the slowest of a profile's host Adam reads above which
:func:`host_adam_median` warns: wider than the spread of reads on a quiet host, so a
warning means that something else used the host while it was profiled."""


def host_adam_median(reads: Sequence[float]) -> float:
    """The median of a profile's host Adam reads (parameters/s), warning when they
    disagree by more than :data:`HOST_ADAM_READS_SPREAD`.

    One read is a few fused steps over tens of milliseconds, and every plan charges its
    host steps at this rate: a read taken while the host is busy with something else
    (a fraction of the quiet rate) is cached with the profile and misleads every plan
    after it, which then streams too many regions and predicts too long a step. The median
    of reads taken first, midway and last through the profile drops one such read. A
    larger spread is told, with how to measure again.
    """
    if not reads or any(not (r > 0 and math.isfinite(r)) for r in reads):
        raise ValueError(f"host Adam reads must be positive and finite, got {list(reads)}")
    median = statistics.median(reads)
    if max(reads) > HOST_ADAM_READS_SPREAD * min(reads):
        warnings.warn(
            "the hardware profile's host Adam reads disagree ("
            + ", ".join(f"{r / 1e9:.2f}" for r in reads)
            + f" Gparam/s); keeping the median, {median / 1e9:.2f}. Something else was "
            "using the host while it was profiled: measure again on a quiet host "
            "(offload_runtime.profile_hardware(device, dtype=..., force=True)), or tell "
            "memory_optimize the rate (host_step_params_per_s=).",
            RuntimeWarning,
            stacklevel=2,
        )
    return median


class KernelSteps(NamedTuple):
    """A plain and a speculative host step of one kernel configuration over the same
    buffers (:func:`kernel_steps`)."""

    plain: HostStep
    speculative: HostStep


def kernel_steps(
    moments_dtype: torch.dtype, numel: int, host_kernel: str, fp16_io: bool = False
) -> KernelSteps:
    """The steps of one host Adam(W) kernel configuration over ``numel`` fp32 parameters,
    for :func:`measure_host_step` to time: ``host_kernel`` (``"torch"``: torch's fused
    Adam, bf16 moments by its chunked route; ``"single_pass"``: the numba kernels), the
    moments' dtype, and ``fp16_io`` (the single-pass kernels that read an fp16 gradient and
    write an fp16 copy of the master). Buffers are allocated once (the speculative step's
    spare buffers at its first call, which the timer does not time); each step is called
    with its count (bias correction). Needs about ``(8 + 2 * moment bytes) * numel`` bytes
    of host memory, ``4 + 2 * moment bytes`` more once the speculative step has run."""
    if numel < 1:
        raise ValueError(f"numel ({numel}) must be >= 1")
    if moments_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"moments_dtype must be float32 or bfloat16, not {moments_dtype}")
    if host_kernel not in HOST_KERNELS:
        raise ValueError(f"host_kernel must be one of {HOST_KERNELS}, not {host_kernel!r}")
    if fp16_io and host_kernel != "single_pass":
        raise ValueError("fp16_io times the single-pass kernels (host_kernel='single_pass')")
    kernels: tuple[Callable[..., Any], Callable[..., Any]] = (_fused_one, speculative_adam_)
    if host_kernel == "single_pass":
        single_pass.require()
        kernels = (single_pass.adam_, single_pass.speculative_adam_)
    plain, undo = kernels
    param = torch.zeros(numel)
    grad = torch.full((numel,), 1e-3, dtype=torch.float16 if fp16_io else torch.float32)
    if fp16_io:
        single_pass.require_fp16_io()
        upload = torch.empty(numel, dtype=torch.float16)  # the fp16 copy the kernels write

        def plain_io(p: Any, g: Any, m: Any, v: Any, step: Any, hyper: Any) -> None:
            single_pass.adam_fp16_io_(p, g, m, v, upload, step, hyper)

        def undo_io(p: Any, g: Any, m: Any, v: Any, nm: Any, nv: Any, b: Any, *rest: Any) -> Any:
            return single_pass.speculative_adam_fp16_io_(p, g, m, v, nm, nv, b, upload, *rest)

        plain, undo = plain_io, undo_io
    exp_avg = torch.zeros(numel, dtype=moments_dtype)
    exp_avg_sq = torch.zeros(numel, dtype=moments_dtype)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    spare: list[torch.Tensor] = []

    def plain_step(count: int) -> object:
        return plain(param, grad, exp_avg, exp_avg_sq, torch.tensor(float(count)), hyper)

    def speculative_step(count: int) -> object:
        if not spare:
            spare.extend((torch.zeros_like(exp_avg), torch.zeros_like(exp_avg_sq)))
            spare.append(torch.zeros_like(param))
        step = torch.tensor(float(count))
        return undo(param, grad, exp_avg, exp_avg_sq, *spare, step, hyper)

    return KernelSteps(plain=plain_step, speculative=speculative_step)


def _fused_one(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
) -> None:
    """:func:`fused_adam_` of one tensor, with the signature of ``single_pass.adam_``."""
    fused_adam_([param], [grad], [exp_avg], [exp_avg_sq], [step], hyper)


MOMENTS_DTYPES = {"fp32": torch.float32, "bf16_moments": torch.bfloat16}
"""The moments' dtype of each fp32-master rung (``HostStepRate.state``)."""


def bf16_master_step(state: str, numel: int, host_kernel: str) -> HostStep:
    """The plain host step of a bf16-master rung (``"bf16_stochastic"``, ``"bf16_8bit"``,
    ``"bf16_nearest"``) over ``numel`` bf16 parameters, reading a bf16 gradient, as the
    optimizer runs it (``offload_optim``'s [Note: bf16 masters]): the single-pass kernels,
    or their torch reference (``host_kernel="torch"``). Needs about ``10 * numel`` bytes of
    host memory."""
    if state not in BF16_MASTER_STATES:
        raise ValueError(f"state must be one of {BF16_MASTER_STATES}, not {state!r}")
    numba = host_kernel == "single_pass"
    if numba:
        single_pass.require()
    param = torch.zeros(numel, dtype=torch.bfloat16)
    grad = torch.full((numel,), 1e-3, dtype=torch.bfloat16)
    hyper = AdamHyper(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, adamw=True)
    scales: tuple[torch.Tensor, torch.Tensor] | None = None
    if state == "bf16_8bit":
        codes = low_precision.QUANT_DTYPES
        m, v = torch.zeros(numel, dtype=codes[0]), torch.zeros(numel, dtype=codes[1])
        blocks = low_precision.quantized_numel(numel)
        scales = (torch.zeros(blocks), torch.zeros(blocks))
    else:
        m, v = torch.zeros_like(param), torch.zeros_like(param)

    def step(count: int) -> object:
        low_precision.step_bf16_master_(
            state, param, grad, m, v, torch.tensor(float(count)), hyper,
            seed=count, scales=scales, numba=numba,
        )  # fmt: skip
        return None

    return step


def host_step_configurations() -> list[tuple[str, str, bool, bool]]:
    """(kernel, state, fp16_io, speculative) of every host step the optimizer can run
    here: torch's kernels always; the single-pass ones where numba loads, with fp16 I/O
    where its half-precision conversions compile and match torch's
    (``single_pass.fp16_io_available``). The bf16-master rungs are timed with the one
    kernel family the planner runs them with (the single-pass kernels where numba loads,
    their torch reference otherwise), plain only: they never speculate."""
    numba = single_pass.available()
    kernels = [("torch", False)]
    if numba:
        kernels.append(("single_pass", False))
        if single_pass.fp16_io_available():
            kernels.append(("single_pass", True))
    found = [
        (kernel, state, io, speculative)
        for kernel, io in kernels
        for state in MOMENTS_DTYPES
        for speculative in (False, True)
    ]
    family = "single_pass" if numba else "torch"
    return found + [(family, state, False, False) for state in BF16_MASTER_STATES]


def measure_host_step_rates(
    numel: int,
    fused_params_per_s: float,
    *,
    steps: int = 3,
    settle_s: float = 0.05,
    configurations: Sequence[tuple[str, str, bool, bool]] | None = None,
) -> tuple[HostStepRate, ...]:
    """The rate of every host step the optimizer can run here
    (:func:`host_step_configurations`, or ``configurations``), each timed by
    :func:`measure_host_step` over its own kernel and buffers (:func:`kernel_steps`,
    ``numel`` parameters; the median of ``steps`` timed steps after ``settle_s`` of sleep,
    which lets the other kernel family's thread pool go idle). torch's fused fp32 plain
    step is not timed again: its rate is ``fused_params_per_s``, the profile's
    ``host_adam_params_per_s``, so that the two never disagree. Needs about ``28 * numel``
    bytes of host memory at a time."""
    if not fused_params_per_s > 0:
        raise ValueError(f"fused_params_per_s must be > 0, got {fused_params_per_s}")
    rates = []
    threads = torch.get_num_threads()
    for kernel, state, io, speculative in configurations or host_step_configurations():
        if (kernel, state, io, speculative) == ("torch", "fp32", False, False):
            rates.append(HostStepRate(kernel, state, io, speculative, fused_params_per_s, threads))
            continue
        if state in BF16_MASTER_STATES:
            step = bf16_master_step(state, numel, kernel)
        else:
            built = kernel_steps(MOMENTS_DTYPES[state], numel, kernel, io)
            step = built.speculative if speculative else built.plain
            del built
        timing = measure_host_step(step, numel, steps=steps, settle_s=settle_s)
        rates.append(
            HostStepRate(kernel, state, io, speculative, timing.params_per_s, timing.threads)
        )
        del step
    return tuple(rates)
