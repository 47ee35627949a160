"""offload-optim: the optimizer side of offloaded training.

- :class:`HybridAdam`: Adam(W) over an ``OffloadModule``'s fp32 master weights, one fused
  kernel launch per region (CPU for host-resident state, CUDA for device-resident state),
  torch's ``AdamW`` surface; the host kernel, fp16 I/O and moments' dtype come from the
  module's plan and configuration;
- :class:`AMPOptimizer`: fp16 loss scaling with overflow skip, bf16 / fp32 without scaling,
  global-norm clipping, gradient accumulation, checkpoints, and host steps that overlap
  backward (in fp16 too where the plan speculates: steps undone exactly on overflow);
- streamed host-state regions (``StatePlacement.STREAMED``): host-resident state stepped
  on the device, chunk by chunk (:mod:`offload_optim.streamed`);
- :func:`check_host_rate`: the host Adam rate the training loop ran at, against the one
  the plan assumed, to plan again with, :func:`check_stream_rate` the same for the
  streamed regions' copies up, and :func:`check_backward_issue` for the backward's issue
  cost beside host-state regions (:mod:`offload_optim.calibration`);
- :func:`save_distributed` / :func:`load_distributed`: checkpoints of data-parallel
  training (``torch.distributed.checkpoint``), saved on N ranks and resumed on M.
"""

from offload_optim.amp import AMPOptimizer, OverlapMode, StepReport
from offload_optim.calibration import (
    BackwardIssueCheck,
    HostRateCheck,
    StreamRateCheck,
    check_backward_issue,
    check_host_rate,
    check_stream_rate,
    planned_host_busy_s,
)
from offload_optim.dist_checkpoint import load_distributed, save_distributed
from offload_optim.hybrid_adam import HybridAdam, RegionStepTiming
from offload_optim.scaler import DynamicLossScaler

__all__ = [
    "AMPOptimizer",
    "BackwardIssueCheck",
    "DynamicLossScaler",
    "HostRateCheck",
    "HybridAdam",
    "OverlapMode",
    "RegionStepTiming",
    "StepReport",
    "StreamRateCheck",
    "check_backward_issue",
    "check_host_rate",
    "check_stream_rate",
    "load_distributed",
    "planned_host_busy_s",
    "save_distributed",
]
