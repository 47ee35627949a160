"""What a user chooses for offloaded training: ``OffloadConfig``.

It holds only choices that change the trained values (the training precision, the rung of
the host state's precision ladder, GELU fusion), the run's shape the plan prices (gradient
accumulation), and limits (host memory, host threads). Everything that only changes speed is the
planner's to decide and the plan's to record (``offload_solver.PlanOptions``). The module
keeps its configuration (``OffloadModule.config``) and the optimizer reads it from there,
so that the plan and the optimizer cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from offload_solver.host_rates import BF16_MASTER_STATES, HOST_STATES

TRAINING_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
"""Training precisions: fp16 (with loss scaling), bf16, fp32."""
_MOMENTS_DTYPE = {
    "fp32": torch.float32,
    "bf16_moments": torch.bfloat16,
    "bf16_stochastic": torch.bfloat16,
    "bf16_8bit": torch.uint8,
    "bf16_nearest": torch.bfloat16,
}


@dataclass(frozen=True)
class OffloadConfig:
    """The user's choices for offloaded training (see the module docstring). Invalid values
    raise ``ValueError`` naming the field and the fix."""

    dtype: torch.dtype = torch.float16
    """Training precision: ``torch.float16`` (dynamic loss scaling), ``torch.bfloat16``,
    or ``torch.float32`` (exact: for tests). The model runs forward and backward in it;
    master weights and optimizer state stay fp32."""
    host_state: str = "fp32"
    """Precision of host-resident optimizer state, a rung of the ladder (bytes a step
    moves per parameter over host memory, and quality: offload-optim's README, "Host-state
    precision"); the planner prices each rung at its own measured rate:

    - ``"fp32"``: fp32 master and moments (the reference's numerics; 28 bytes);
    - ``"bf16_moments"``: fp32 master, bf16 moments (20 bytes);
    - ``"bf16_stochastic"``: bf16 master updated with stochastic rounding, bf16 moments
      (14 bytes);
    - ``"bf16_8bit"``: bf16 master with stochastic rounding, 8-bit block-quantized
      moments (10 bytes);
    - ``"bf16_nearest"``: bf16 master and moments rounded to nearest, torchao's
      ``CPUOffloadOptimizer`` numerics (14 bytes).

    The bf16-master rungs train in bf16 (``dtype=torch.bfloat16``): the host master is
    then the model's own weights, uploaded as they are. Device-resident state (regions the
    plan keeps on the device) stays fp32 on every rung."""
    host_memory_bytes: int | None = None
    """Most host memory, in bytes, that the plan's host-resident state and its buffers
    (fp32 masters, gradients and moments, pinned staging, and the undo buffers of
    speculative fp16 host steps) may take; it bounds how many parameters may speculate.
    None: the host memory available when the model is planned."""
    host_threads: int | None = None
    """CPU threads for host optimizer steps, set as torch's intra-op thread count
    (``torch.set_num_threads``, process-wide) when the model is planned, so that the host
    steps are planned at the rate they will run; None: torch's count as it is, or under
    data parallel this rank's share of the machine's cores
    (``distributed.host_threads_per_rank``)."""
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
        if self.host_state not in HOST_STATES:
            raise ValueError(
                f"OffloadConfig.host_state is {self.host_state!r}; use one of "
                f"{', '.join(repr(s) for s in HOST_STATES)}"
            )
        if self.bf16_master and self.dtype != torch.bfloat16:
            raise ValueError(
                f"OffloadConfig.host_state={self.host_state!r} keeps a bf16 master, which "
                f"trains in bf16, but dtype is {self.dtype}: set dtype=torch.bfloat16, or "
                "use host_state='fp32' or 'bf16_moments'"
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
    def bf16_master(self) -> bool:
        """Whether host-resident masters are bf16 (the bf16-master rungs)."""
        return self.host_state in BF16_MASTER_STATES

    @property
    def host_moments(self) -> torch.dtype:
        """The storage dtype of host-resident moments: fp32 or bf16; ``torch.uint8``
        stands for the 8-bit rung's quantized codes (int8 for the first moment, uint8
        for the second: ``low_precision.QUANT_DTYPES``), which the optimizer lays out per
        segment."""
        return _MOMENTS_DTYPE[self.host_state]

    @property
    def host_moment_bytes(self) -> float:
        """Host memory bytes one Adam moment takes per parameter (the 8-bit rung's
        per-block scales included)."""
        if self.host_state == "bf16_8bit":
            return 1.0 + 4.0 / 256
        return float(self.host_moments.itemsize)


__all__ = ["HOST_STATES", "TRAINING_DTYPES", "OffloadConfig"]
