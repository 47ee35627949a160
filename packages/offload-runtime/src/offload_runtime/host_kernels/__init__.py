"""The host optimizer's Adam kernels, beside the runtime that plans and measures them.

The hardware profile times every kernel a host-state region can step with
(``offload_runtime.hardware``), and the planner chooses among them; ``offload_optim``'s
``HybridAdam`` runs the one the plan chose. By job:

- ``torch_adam.py``: torch's fused Adam(W) (:func:`fused_adam_`, host and device), its
  chunked route for bf16 moments ([Note: bf16 moments]), and the speculative step that
  keeps what an exact undo needs (:func:`speculative_adam_`);
- ``single_pass.py``: the one-pass host kernels compiled by numba ([Note: single-pass host
  Adam]): plain, speculative, and fp16 I/O;
- ``_numba_adam.py``: their numba code (imported only when used).
"""

from offload_runtime.host_kernels import single_pass
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
    "SPECULATE_CHUNK_NUMEL",
    "SUPPORTED_DEVICE_TYPES",
    "AdamHyper",
    "fused_adam_",
    "scale_tensor",
    "single_pass",
    "speculative_adam_",
]
