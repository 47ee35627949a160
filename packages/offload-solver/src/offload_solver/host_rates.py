"""The host optimizer's step rates, one per kernel configuration (:class:`HostStepRate`).

A host-state region's Adam step runs on the host CPU, with one of the kernels a runtime
offers (``offload_runtime.host_kernels``): torch's fused CPU Adam (``"torch"``) or the
single-pass kernels (``"single_pass"``), with fp32 or bf16 moments, reading fp32
gradients or fp16 ones with the fp16 copy of the master written in the same pass
(``fp16_io``), plainly or keeping what an exact undo needs (``speculative``). Each
configuration moves a different number of bytes per parameter over host memory, so each
has its own rate; a ``HardwareProfile`` records the ones measured on its machine
(``offload_runtime``'s ``profile_hardware``), and :func:`default_host_step_rates` derives
documented ones from torch's fused fp32 rate for profiles made without measuring.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from offload_solver._json import check_numbers

HOST_KERNELS = ("torch", "single_pass")
"""Kernel families that step host-resident state: torch's fused CPU Adam, and the
single-pass kernels."""
HOST_MOMENTS = ("fp32", "bf16")
"""Dtypes of host-resident Adam moments, by name."""

HostStepKey = tuple[str, str, bool, bool]
"""(kernel, moments, fp16_io, speculative): one configuration of the host step."""

DEFAULT_HOST_STEP_TIMES: dict[HostStepKey, float] = {
    ("torch", "fp32", False, False): 1.0,
    ("torch", "fp32", False, True): 2.53,
    ("torch", "bf16", False, False): 1.0,
    ("torch", "bf16", False, True): 2.53,
    ("single_pass", "fp32", False, False): 1.0,
    ("single_pass", "fp32", False, True): 1.15,
    ("single_pass", "fp32", True, False): 0.94,
    ("single_pass", "fp32", True, True): 0.94 * 1.15,
    ("single_pass", "bf16", False, False): 0.73,
    ("single_pass", "bf16", False, True): 0.73 * 1.15,
    ("single_pass", "bf16", True, False): 0.73,
    ("single_pass", "bf16", True, True): 0.73 * 1.15,
}
"""Each configuration's step time over torch's fused fp32 step's, for profiles made
without measuring (``python benchmarks/host_adam_bench.py`` times them; BENCHMARKS.md,
Decisions, "Single-pass host Adam"): the single-pass kernel 1.00x plain, 0.94x with fp16
I/O, 0.73x with bf16 moments (with or without fp16 I/O, the one ratio recorded), and a
speculative step 1.15x its plain one; torch's speculative route 2.53x. torch's chunked
route for bf16 moments is recorded only as no faster than its fp32 step: 1.0x."""


@dataclass(frozen=True)
class HostStepRate:
    """The measured rate of one configuration of the host Adam step."""

    kernel: str
    """``"torch"`` (torch's fused CPU Adam) or ``"single_pass"``."""
    moments: str
    """``"fp32"`` or ``"bf16"``: the dtype of the Adam moments it steps."""
    fp16_io: bool
    """Reads fp16 gradients and writes the master's fp16 copy in the same pass
    (single-pass kernels only)."""
    speculative: bool
    """Keeps what an exact undo needs (a master backup and a spare pair of moments)."""
    params_per_s: float
    """Parameters stepped per second."""
    threads: int = 0
    """CPU threads the step ran with; 0 where not measured (documented defaults)."""

    def __post_init__(self) -> None:
        check_numbers(self, "HostStepRate")
        if self.kernel not in HOST_KERNELS:
            raise ValueError(
                f"HostStepRate.kernel is {self.kernel!r}; use one of {', '.join(HOST_KERNELS)}"
            )
        if self.moments not in HOST_MOMENTS:
            raise ValueError(
                f"HostStepRate.moments is {self.moments!r}; use one of {', '.join(HOST_MOMENTS)}"
            )
        if self.fp16_io and self.kernel != "single_pass":
            raise ValueError("HostStepRate.fp16_io is a configuration of the single_pass kernel")
        rate = self.params_per_s
        if isinstance(rate, bool) or not isinstance(rate, int | float) or not 0 < rate < math.inf:
            raise ValueError(
                f"HostStepRate.params_per_s is {rate!r}; must be a finite rate > 0 parameters/s"
            )
        if isinstance(self.threads, bool) or not isinstance(self.threads, int) or self.threads < 0:
            raise ValueError(f"HostStepRate.threads is {self.threads!r}; must be an int >= 0")

    @property
    def key(self) -> HostStepKey:
        """(kernel, moments, fp16_io, speculative)."""
        return (self.kernel, self.moments, self.fp16_io, self.speculative)


def default_host_step_rates(fused_params_per_s: float) -> tuple[HostStepRate, ...]:
    """Every configuration's rate derived from torch's fused fp32 rate by
    :data:`DEFAULT_HOST_STEP_TIMES`, so that a plan made without measuring chooses among
    kernels as a measured one would."""
    return tuple(
        HostStepRate(kernel, moments, io, spec, fused_params_per_s / time)
        for (kernel, moments, io, spec), time in DEFAULT_HOST_STEP_TIMES.items()
    )


__all__ = [
    "DEFAULT_HOST_STEP_TIMES",
    "HOST_KERNELS",
    "HOST_MOMENTS",
    "HostStepKey",
    "HostStepRate",
    "default_host_step_rates",
]
