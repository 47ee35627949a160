"""The training run the checkpoint test saves and resumes (shared by parent and child)."""

from __future__ import annotations

import torch
from optim_helpers import batch, offload_module, tiny_gpt2

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig
from offload_runtime.module import OffloadModule


def build_run(
    seed: int,
) -> tuple[AMPOptimizer, OffloadModule, torch.optim.lr_scheduler.StepLR]:
    """fp16 training (so the scaler state matters), bf16 host moments, a StepLR schedule."""
    config = OffloadConfig(host_state="bf16_moments")
    module = offload_module(tiny_gpt2(seed=seed), batch(0), dtype=torch.float16, config=config)
    opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01)
    amp = AMPOptimizer(opt, module, initial_scale=2.0**20, growth_interval=4, clipping_norm=1.0)
    sched = torch.optim.lr_scheduler.StepLR(amp, step_size=3, gamma=0.7)
    return amp, module, sched
