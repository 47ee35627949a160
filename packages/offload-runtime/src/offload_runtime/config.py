"""What a user chooses for offloaded training: ``OffloadConfig``.

It holds only choices that change the trained values (the training precision, the host
moments' precision, GELU fusion), the run's shape the plan prices (gradient accumulation),
and limits (host memory, host threads). Everything that only changes speed is the
planner's to decide and the plan's to record (``offload_solver.PlanOptions``). The module
keeps its configuration (``OffloadModule.config``) and the optimizer reads it from there,
so that the plan and the optimizer cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

TRAINING_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Training precisions: fp16 (with loss scaling), bf16, fp32."""
HOST_MOMENT_DTYPES = (torch.float32, torch.bfloat16)
"""Dtypes of host-resident Adam moments."""


@dataclass(frozen=True)
class OffloadConfig:
    """The user's choices for offloaded training (see the module docstring). Invalid values
    raise ``ValueError`` naming the field and the fix."""

    dtype: torch.dtype = torch.float16
    """Training precision: ``torch.float16`` (dynamic loss scaling), ``torch.bfloat16``,
    or ``torch.float32`` (exact: for tests). The model runs forward and backward in it;
    master weights and optimizer state stay fp32."""
    host_moments: torch.dtype = torch.float32
    """Dtype of the Adam moments of host-resident optimizer state: ``torch.float32`` or
    ``torch.bfloat16`` (4 fewer bytes of host memory per parameter, rounding to bf16 once
    per moment per step; faster with the single-pass host kernel). Device-resident
    moments stay fp32."""
    host_memory_bytes: int | None = None
    """Most host memory, in bytes, that the plan's host-resident state and its buffers
    (fp32 masters, gradients and moments, pinned staging, and the undo buffers of
    speculative fp16 host steps) may take; it bounds how many parameters may speculate.
    None: the host memory available when the model is planned."""
    host_threads: int | None = None
    """CPU threads for host optimizer steps, set as torch's intra-op thread count
    (``torch.set_num_threads``, process-wide) when the model is planned, so that the host
    steps are planned at the rate they will run; None: torch's count as it is."""
    accumulation_steps: int = 1
    """Micro-batches (forward and backward passes) per optimizer step. The plan prices
    them all per step; the optimizer accumulates that many (``AMPOptimizer`` reads it
    from the module)."""
    fuse_gelu: bool = True
    """Trace GPT-2's written-out tanh GELU as one ``aten.gelu(approximate="tanh")``: the
    same formula in one kernel, fewer operations to issue and fewer activations kept;
    results differ from the model as written by rounding (measured: BENCHMARKS.md,
    Decisions, "Fused tanh GELU"). A model without that chain is traced unchanged."""

    def __post_init__(self) -> None:
        if self.dtype not in TRAINING_DTYPES:
            raise ValueError(
                f"OffloadConfig.dtype is {self.dtype}; use torch.float16, torch.bfloat16 or "
                "torch.float32"
            )
        if self.host_moments not in HOST_MOMENT_DTYPES:
            raise ValueError(
                f"OffloadConfig.host_moments is {self.host_moments}; use torch.float32 or "
                "torch.bfloat16"
            )
        for name in ("host_memory_bytes", "host_threads"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value <= 0
            ):
                raise ValueError(
                    f"OffloadConfig.{name} is {value!r}; give a positive int, or None for "
                    "what the machine has"
                )
        steps = self.accumulation_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(
                f"OffloadConfig.accumulation_steps is {steps!r}; give an int >= 1 "
                "(micro-batches per optimizer step)"
            )
        if not isinstance(self.fuse_gelu, bool):
            raise ValueError(f"OffloadConfig.fuse_gelu is {self.fuse_gelu!r}; give True or False")

    @property
    def moments_name(self) -> str:
        """``"fp32"`` or ``"bf16"``: :attr:`host_moments` as ``offload_solver``'s
        ``HostStepRate.moments`` names it."""
        return "bf16" if self.host_moments == torch.bfloat16 else "fp32"


__all__ = ["HOST_MOMENT_DTYPES", "TRAINING_DTYPES", "OffloadConfig"]
