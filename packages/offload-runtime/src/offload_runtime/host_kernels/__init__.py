"""The host optimizer's Adam kernels, beside the runtime that plans and measures them.

The hardware profile times every kernel a host-state region can step with
(``offload_runtime.hardware``), and the planner chooses among them; ``offload_optim``'s
``HybridAdam`` runs the one the plan chose. By job:

- ``torch_adam.py``: torch's fused Adam(W) (:func:`fused_adam_`, host and device), its
  chunked route for bf16 moments ([Note: bf16 moments]), and the speculative step that
  keeps what an exact undo needs (:func:`speculative_adam_`);
- ``single_pass.py``: the one-pass host kernels compiled by numba ([Note: single-pass host
  Adam]): plain, speculative, and fp16 I/O;
- ``_numba_adam.py``: their numba code (imported only when used);
- ``low_precision.py``: the one-pass kernels for bf16 master weights ([Note: bf16 master
  weights]): bf16 moments (master rounded to nearest or stochastically) or 8-bit
  block-quantized moments, their torch references, the 8-bit state's (de)quantization,
  and the one dispatch of a rung's step (``step_bf16_master_``);
- ``_numba_lowp.py``: their numba code (imported only when used).
"""

from offload_runtime.host_kernels import low_precision, single_pass
from offload_runtime.host_kernels.low_precision import (
    QBLOCK,
    adam_bf16_,
    adam_bf16_8bit_,
    dequantize_moments,
    quantize_moments_,
    quantized_numel,
    reference_adam_bf16_,
    reference_adam_bf16_8bit_,
    step_bf16_master_,
)
from offload_runtime.host_kernels.torch_adam import (
    CHUNK_NUMEL,
    HOST_KERNELS,
    SPECULATE_CHUNK_NUMEL,
    SUPPORTED_DEVICE_TYPES,
    AdamHyper,
    fused_adam_,
    scale_tensor,
    speculative_adam_,
)

__all__ = [
    "CHUNK_NUMEL",
    "HOST_KERNELS",
    "QBLOCK",
    "SPECULATE_CHUNK_NUMEL",
    "SUPPORTED_DEVICE_TYPES",
    "AdamHyper",
    "adam_bf16_",
    "adam_bf16_8bit_",
    "dequantize_moments",
    "fused_adam_",
    "low_precision",
    "quantize_moments_",
    "quantized_numel",
    "reference_adam_bf16_",
    "reference_adam_bf16_8bit_",
    "scale_tensor",
    "single_pass",
    "speculative_adam_",
    "step_bf16_master_",
]
