"""The fused Adam step the stand-alone measurement scripts time (torch's kernel, fixed
hyperparameters: lr 1e-4, betas 0.9/0.999, eps 1e-8, no weight decay)."""

from __future__ import annotations

import torch


def fused_adam_(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    steps: list[torch.Tensor],
) -> None:
    """One in-place fused Adam step over same-device fp32 tensors (CPU or CUDA)."""
    torch._fused_adam_(
        params, grads, exp_avgs, exp_avg_sqs, [], steps, lr=1e-4, beta1=0.9, beta2=0.999,
        weight_decay=0.0, eps=1e-8, amsgrad=False, maximize=False, grad_scale=None,
        found_inf=None,
    )  # fmt: skip
