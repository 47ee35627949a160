"""AdamW steps of a module whose plan recomputes or moves to the host what some regions
save for backward equal plain PyTorch training's, with dropout on.

The plans here are the solver's, with placements set by hand per region
(dataclasses.replace on its RegionPlans), so that every mix is exercised.
"""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from optim_helpers import batch, tiny_gpt2, train_offload, train_plain

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig, PlanForce
from offload_runtime.hardware import default_cpu_profile
from offload_runtime.module import OffloadModule
from offload_runtime.planning import PlannedModel, build_offload_module, plan_model
from offload_solver import ActivationPlacement, InfeasibleBudgetError, ParamPlacement

LR = 1e-2
WD = 0.01
STEPS = 3


def dropout_gpt2() -> torch.nn.Module:
    """A tiny GPT-2 with every dropout at 0.1, in training mode."""
    return tiny_gpt2(dropout=0.1).train()


def offloading_plan(model: torch.nn.Module) -> PlannedModel:
    """The solver's fp32 plan at 1.2 times the least budget it accepts: it offloads."""

    def plan_at(budget: int) -> PlannedModel:
        return plan_model(
            model,
            batch(0),
            budget,
            "asyn",
            config=OffloadConfig(dtype=torch.float32, fuse_gelu=False),
            hardware=default_cpu_profile(),
            device="cpu",
            progress=False,
            force=PlanForce(block_search_range_bytes=0),
        )

    with pytest.raises(InfeasibleBudgetError) as info:
        plan_at(1)
    return plan_at(int(1.2 * info.value.least_budget_bytes))


def placement(mix: str, r: int) -> ActivationPlacement:
    """``mix``'s placement of region ``r``: every region's for keep, recompute and host;
    for mix, cycling keep, recompute, host, host (so that HOST regions sit side by side)."""
    if mix != "mix":
        return ActivationPlacement(mix)
    return [
        ActivationPlacement.KEEP,
        ActivationPlacement.RECOMPUTE,
        ActivationPlacement.HOST,
        ActivationPlacement.HOST,
    ][r % 4]


def build(model: torch.nn.Module, base: PlannedModel, mix: str) -> OffloadModule:
    regions = tuple(
        dataclasses.replace(rp, activations=placement(mix, rp.region.index))
        for rp in base.plan.regions
    )
    plan = dataclasses.replace(base.plan, regions=regions)
    return build_offload_module(model, dataclasses.replace(base, plan=plan))


@pytest.fixture(scope="module")
def planned() -> tuple[torch.nn.Module, PlannedModel]:
    """The model (never trained itself: each test trains a copy and a module built from
    it) and its plan, made once."""
    model = dropout_gpt2()
    base = offloading_plan(model)
    assert any(rp.placement is not ParamPlacement.RESIDENT for rp in base.plan.regions)
    return model, base


@pytest.mark.parametrize("mix", ["keep", "recompute", "host", "mix"])
def test_three_adamw_steps_match_plain_training(
    mix: str, planned: tuple[torch.nn.Module, PlannedModel]
) -> None:
    model, base = planned
    reference = copy.deepcopy(model)
    module = build(model, base, mix)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=LR, weight_decay=WD), module)
    torch.manual_seed(11)
    losses = train_offload(amp, module, range(STEPS))
    opt = torch.optim.AdamW(reference.parameters(), lr=LR, weight_decay=WD)
    torch.manual_seed(11)
    expected = train_plain(opt, reference, range(STEPS))
    torch.testing.assert_close(losses, expected, rtol=1e-5, atol=0)
    stats = module.controller.activations.stats
    recomputed = sum(rp.activations is ActivationPlacement.RECOMPUTE for rp in module.plan.regions)
    assert stats["recomputes"] == STEPS * recomputed
    assert (stats["host_copies_up"] > 0) == (mix in ("host", "mix"))
    module.close()
