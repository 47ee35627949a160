"""The host optimizer's step rates, one per kernel configuration (:class:`HostStepRate`).

A host-state region's Adam step runs on the host CPU, with one of the kernels a runtime
offers (``offload_runtime.host_kernels``): torch's fused CPU Adam (``"torch"``) or the
single-pass kernels (``"single_pass"``), over one rung of the ladder of host-state
precisions (``state``, :data:`HOST_STATES`), reading fp32 gradients or fp16 ones with the
fp16 copy of the master written in the same pass (``fp16_io``), plainly or keeping what an
exact undo needs (``speculative``). Each
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
HOST_STATES = ("fp32", "bf16_moments", "bf16_stochastic", "bf16_8bit", "bf16_nearest")
"""The ladder of host-state precisions (``offload_runtime.OffloadConfig.host_state``), by
name: fp32 master and moments; fp32 master and bf16 moments; bf16 master updated with
stochastic rounding and bf16 moments; bf16 master (stochastic rounding) and 8-bit
block-quantized moments; bf16 master and moments rounded to nearest (torchao's
``CPUOffloadOptimizer`` numerics). The last three keep the master in the training dtype
(bf16), so it is its own upload copy and nothing is converted on the host."""
BF16_MASTER_STATES = ("bf16_stochastic", "bf16_8bit", "bf16_nearest")
"""The rungs whose host master is bf16 (bf16 training only)."""
HOST_STATE_BYTES: dict[str, int] = {
    "fp32": 28,
    "bf16_moments": 20,
    "bf16_stochastic": 14,
    "bf16_8bit": 10,
    "bf16_nearest": 14,
}
"""Host memory bytes one step moves per parameter on each rung, reading 2-byte gradients:
the gradient (2), the master read and written (2 x 4 fp32, 2 x 2 bf16), the two moments
read and written (4 x 4 fp32, 4 x 2 bf16, 4 x 1 8-bit; the 8-bit rung's per-block scales,
8 bytes per 256 parameters, rounded away), and the 2-byte upload copy written where the
master is fp32."""

HostStepKey = tuple[str, str, bool, bool]
"""(kernel, state, fp16_io, speculative): one configuration of the host step."""

DEFAULT_HOST_STEP_TIMES: dict[HostStepKey, float] = {
    ("torch", "fp32", False, False): 1.0,
    ("torch", "fp32", False, True): 2.53,
    ("torch", "bf16_moments", False, False): 1.0,
    ("torch", "bf16_moments", False, True): 2.53,
    ("single_pass", "fp32", False, False): 1.0,
    ("single_pass", "fp32", False, True): 1.15,
    ("single_pass", "fp32", True, False): 0.94,
    ("single_pass", "fp32", True, True): 0.94 * 1.15,
    ("single_pass", "bf16_moments", False, False): 0.73,
    ("single_pass", "bf16_moments", False, True): 0.73 * 1.15,
    ("single_pass", "bf16_moments", True, False): 0.73,
    ("single_pass", "bf16_moments", True, True): 0.73 * 1.15,
    # The bf16-master rungs at the single-pass fp32 step's time scaled by their bytes
    # (HOST_STATE_BYTES over fp32's 28): the kernels are bound by host memory traffic.
    # torch's route for them (the reference kernels, chunked) is recorded at 2x fp32's.
    **{
        ("single_pass", rung, False, False): HOST_STATE_BYTES[rung] / 28
        for rung in BF16_MASTER_STATES
    },
    **{("torch", rung, False, False): 2.0 for rung in BF16_MASTER_STATES},
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
    state: str
    """The host-state rung it steps (one of :data:`HOST_STATES`)."""
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
        if self.state not in HOST_STATES:
            raise ValueError(
                f"HostStepRate.state is {self.state!r}; use one of {', '.join(HOST_STATES)}"
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
        """(kernel, state, fp16_io, speculative)."""
        return (self.kernel, self.state, self.fp16_io, self.speculative)


def default_host_step_rates(fused_params_per_s: float) -> tuple[HostStepRate, ...]:
    """Every configuration's rate derived from torch's fused fp32 rate by
    :data:`DEFAULT_HOST_STEP_TIMES`, so that a plan made without measuring chooses among
    kernels as a measured one would."""
    return tuple(
        HostStepRate(kernel, state, io, spec, fused_params_per_s / time)
        for (kernel, state, io, spec), time in DEFAULT_HOST_STEP_TIMES.items()
    )


__all__ = [
    "BF16_MASTER_STATES",
    "DEFAULT_HOST_STEP_TIMES",
    "HOST_KERNELS",
    "HOST_STATES",
    "HOST_STATE_BYTES",
    "HostStepKey",
    "HostStepRate",
    "default_host_step_rates",
]
