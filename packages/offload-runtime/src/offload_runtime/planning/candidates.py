"""The planner's candidates: which host kernel, I/O precision, conversion place and
speculation each plan is solved with, and what each costs on this machine.

[Note: the planner's candidates]
Every choice here changes speed only (see ``offload_solver.PlanOptions``), so the planner
solves a few candidate configurations and keeps the one with the shortest predicted step;
a tie keeps the earlier candidate, which moves fewer PCIe bytes (conversions on the
host: training-dtype bytes cross, not fp32). Two solves at most:

- fp16 training where the single-pass kernels load: (a) fp16 I/O (where the CPU's half
  conversions compile) with speculative host steps under backward, conversions on the
  host; (b) the three-pass route with conversions on the device, host steps after the
  overflow answer (BENCHMARKS.md, Decisions, "fp16 I/O host steps", "Speculative fp16 host
  steps", "Dtype conversions on the device");
- bf16 training, or fp16 where numba cannot load: conversions on the host, and on the
  device; bf16 and fp32 host steps run under backward without undo (nothing waits for an
  answer), fp16 ones after the answer;
- fp32 training: one candidate (fp32 has nothing to convert: both places plan alike);
- a bf16-master rung (``OffloadConfig.host_state``): one candidate, conversions on the
  host, which has none to make: gradients land in bf16 and the bf16 master is its own
  upload copy; no streamed state (the streamed ring steps fp32 masters).

The host kernel of a candidate without fp16 I/O or speculation is the single-pass one on
every rung but fp32 (bf16 moments: 0.73x torch's step) and torch's with fp32 moments (the
two tie at 1.00x, and torch's needs no compilation): BENCHMARKS.md, Decisions,
"Single-pass host Adam". Each candidate is charged the hardware profile's rate of its own
kernel configuration (``HardwareProfile.host_step_params_per_s``), a speculative one its
speculative step's time over its plain step's. Streamed host state is offered to the solver in every
candidate, which streams a region only where that shortens the step and the ring fits
(BENCHMARKS.md, Decisions, "Streamed host state"). ``PlanForce`` fixes any of these.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from offload_runtime.config import OffloadConfig
from offload_runtime.host_kernels import single_pass
from offload_runtime.planning.force import PlanForce
from offload_solver import HardwareProfile


@dataclass(frozen=True)
class Candidate:
    """One configuration the planner solves (see [Note: the planner's candidates])."""

    host_kernel: str
    fp16_io: bool
    convert_on_device: bool
    speculative: bool

    def describe(self) -> str:
        """E.g. ``single_pass kernel, fp16 I/O, speculative, conversions on the host``."""
        parts = [f"{self.host_kernel} kernel"]
        if self.fp16_io:
            parts.append("fp16 I/O")
        if self.speculative:
            parts.append("speculative")
        parts.append(f"conversions on the {'device' if self.convert_on_device else 'host'}")
        return ", ".join(parts)


def plain_kernel(config: OffloadConfig, numba: bool) -> str:
    """The host kernel of a step without fp16 I/O or speculation: the single-pass one on
    every rung but fp32 where numba loads, torch's otherwise."""
    return "single_pass" if numba and config.host_state != "fp32" else "torch"


def candidates(config: OffloadConfig, force: PlanForce) -> list[Candidate]:
    """The candidates to solve, forced values applied, in tie-break order (see the note).
    Warns once per process where numba cannot load and the single-pass kernels would
    have been planned; raises where a forced value cannot run here."""
    numba = single_pass.available()
    fp16 = config.dtype == torch.float16
    would_run_it = fp16 or config.host_state != "fp32"
    if not numba and would_run_it and force.host_kernel is None and not force.fp16_io:
        single_pass.warn_unavailable()
    kernel = plain_kernel(config, numba)
    found: list[Candidate]
    if fp16 and numba:
        io = single_pass.fp16_io_available()
        found = [Candidate("single_pass", io, False, True), Candidate(kernel, False, True, False)]
    elif config.dtype == torch.float32 or config.bf16_master:
        found = [Candidate(kernel, False, False, False)]
    else:
        found = [Candidate(kernel, False, False, False), Candidate(kernel, False, True, False)]
    out: list[Candidate] = []
    for c in found:
        forced = _forced(c, force, fp16)
        if forced not in out:
            out.append(forced)
    for c in out:
        if config.bf16_master and c.convert_on_device:
            raise ValueError(
                f"PlanForce.convert_on_device uploads fp32 masters, but host_state="
                f"{config.host_state!r} keeps bf16 ones: leave it None"
            )
        if c.host_kernel == "single_pass":
            single_pass.require()
        if c.fp16_io:
            single_pass.require_fp16_io()
    return out


def _forced(c: Candidate, force: PlanForce, fp16: bool) -> Candidate:
    """``c`` with ``force``'s values, made consistent: fp16 I/O steps with the single-pass
    kernel and converts on the host; the other kernel or conversions on the device drop
    fp16 I/O; without overlap nothing speculates."""
    if force.fp16_io is not None:
        c = replace(c, fp16_io=force.fp16_io)
        if force.fp16_io:
            c = replace(c, host_kernel="single_pass", convert_on_device=False)
    if force.host_kernel is not None:
        c = replace(c, host_kernel=force.host_kernel)
        if force.host_kernel == "torch":
            c = replace(c, fp16_io=False)
    if force.convert_on_device is not None:
        c = replace(c, convert_on_device=force.convert_on_device)
        if force.convert_on_device:
            c = replace(c, fp16_io=False)
    if force.speculative is not None:
        c = replace(c, speculative=force.speculative)
    if force.overlap is False:
        c = replace(c, speculative=False)
    if not fp16 and (c.fp16_io or c.speculative):
        what = "fp16_io" if c.fp16_io else "speculative"
        raise ValueError(
            f"PlanForce.{what} applies to fp16 training: set OffloadConfig(dtype="
            "torch.float16), or leave it None"
        )
    return c


def host_rates(
    c: Candidate, config: OffloadConfig, hardware: HardwareProfile, force: PlanForce
) -> tuple[float, float]:
    """(plain host step rate in parameters/s, a speculative step's time over a plain one's)
    of candidate ``c`` on ``hardware``; ``PlanForce.host_step_params_per_s`` replaces the
    plain rate."""
    state = config.host_state
    plain = hardware.host_step_params_per_s(c.host_kernel, state, c.fp16_io, False)
    cost = 1.0
    if c.speculative:
        spec = hardware.host_step_params_per_s(c.host_kernel, state, c.fp16_io, True)
        cost = max(1.0, plain / spec)
    if force.host_step_params_per_s is not None:
        plain = force.host_step_params_per_s
    return plain, cost


def planning_hardware(
    c: Candidate, config: OffloadConfig, hardware: HardwareProfile, force: PlanForce
) -> tuple[HardwareProfile, float]:
    """``hardware`` as candidate ``c`` is solved on it: the host Adam rate is the rate of
    its own kernel configuration (:func:`host_rates`), and with fp16 I/O or a bf16 master
    no conversion pass is charged (they happen inside the host step, or there are none);
    and its speculative step cost."""
    plain, cost = host_rates(c, config, hardware, force)
    planned = replace(hardware, host_adam_params_per_s=plain)
    if c.fp16_io or config.bf16_master:
        planned = replace(planned, host_convert_elems_per_s=0.0)
    return planned, cost


__all__ = ["Candidate", "candidates", "host_rates", "plain_kernel", "planning_hardware"]
