"""Activation handling on a GPU: regions that recompute their activations or send them to
the host train exactly as plain PyTorch with dropout on (the device's random-number state
restored for the recomputation, the copies ordered by events on the runtime's streams),
and a plan that needs them keeps the measured peak within the budget.

Run with ``nox -s gpu_tests`` on a CUDA machine.
"""

from __future__ import annotations

import copy
import dataclasses
import gc

import pytest
import torch
from tiny_models import gpt2, loss_of

from offload_runtime import OffloadConfig, PlanForce, memory_optimize, profile_hardware
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import ActivationPlacement, InfeasibleBudgetError, ParamPlacement

pytestmark = pytest.mark.gpu

KEEP = ActivationPlacement.KEEP


@pytest.fixture(autouse=True)
def _cuda() -> None:
    if not torch.cuda.is_available():
        pytest.fail("this test is marked gpu: run it on a machine with CUDA")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()


def dropout_gpt2(hidden: int, layers: int, heads: int) -> torch.nn.Module:
    """A GPT-2 of this shape with every dropout at 0.1, fp32 on the CPU, training."""
    torch.manual_seed(0)
    return gpt2(hidden, layers, heads, positions=2048, dropout=0.1).train()


def tokens(b: int, s: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, 1024, (b, s), generator=gen).cuda()}


def test_recomputed_runs_and_host_regions_match_plain_fp32_training_with_dropout() -> None:
    model = dropout_gpt2(256, 6, 4)
    inp = tokens(4, 256)
    reference = copy.deepcopy(model).cuda()
    planned = plan_model(
        model,
        inp,
        8 * 2**30,
        "asyn",
        config=OffloadConfig(dtype=torch.float32, fuse_gelu=False),
        hardware=profile_hardware("cuda", progress=False),
        progress=False,
        force=PlanForce(block_search_range_bytes=0, device_bytes_in_use=0),
    )
    # Of every four regions: one keeps its activations, the next two are recomputed as one
    # run (the first of them resident, as a run needs), the last sends them to the host.
    with_previous = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
    modes = [KEEP, ActivationPlacement.RECOMPUTE, with_previous, ActivationPlacement.HOST]
    regions = tuple(
        dataclasses.replace(rp, activations=modes[i % 4])
        if i % 4 != 1
        else dataclasses.replace(
            rp,
            activations=modes[1],
            placement=ParamPlacement.RESIDENT,
            prefetch_at=None,
            pool_offset_bytes=None,
        )
        for i, rp in enumerate(planned.plan.regions)
    )
    assert len(regions) >= 8
    plan = dataclasses.replace(planned.plan, regions=regions)
    module = build_offload_module(model, dataclasses.replace(planned, plan=plan))
    torch.manual_seed(5)
    expected = reference(**inp)
    loss_of(expected, inp["input_ids"]).backward()
    torch.manual_seed(5)
    logits = module(**inp)
    module.backward(loss_of(logits, inp["input_ids"]))
    module.controller.wait_host()
    torch.cuda.synchronize()
    torch.testing.assert_close(logits.detach(), expected.detach(), rtol=1e-5, atol=1e-6)
    grads = dict(module.named_gradients())
    for name, p in reference.named_parameters():
        assert p.grad is not None
        torch.testing.assert_close(
            grads[name].float().cpu(), p.grad.cpu(), rtol=1e-4, atol=1e-6, msg=name
        )
    stats = module.controller.activations.stats
    assert stats["recomputes"] == sum(rp.activations is modes[1] for rp in regions)
    assert stats["host_copies_down"] == stats["host_copies_up"] > 0
    module.close()


def _least(model: torch.nn.Module, inp: dict[str, torch.Tensor], **force: object) -> int:
    with pytest.raises(InfeasibleBudgetError) as info:
        plan_model(
            model,
            inp,
            1,
            "asyn",
            hardware=profile_hardware("cuda", progress=False),
            progress=False,
            force=PlanForce(**force),  # type: ignore[arg-type]
        )
    return info.value.least_budget_bytes


def test_a_budget_that_needs_activations_moved_holds_the_measured_peak() -> None:
    """Between the least budget that keeps every region's activations and the least that
    recomputes them all, memory_optimize moves some, and training stays within it."""
    model = dropout_gpt2(1024, 8, 16)
    inp = tokens(8, 1024)
    keep_least = _least(model, inp, activations=False)
    least = _least(model, inp)
    assert least < keep_least
    # Both least budgets count what this process holds on the device already.
    budget = (least + keep_least) // 2
    module = memory_optimize(model, inp, budget, progress=False)
    assert any(rp.activations is not KEEP for rp in module.plan.regions)
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        module.backward(loss_of(module(**inp), inp["input_ids"]))
        module.controller.wait_host()
        module.zero_grad()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    print(
        f"least {least / 2**20:.0f} MiB (all recomputed), {keep_least / 2**20:.0f} MiB "
        f"(all kept); budget {budget / 2**20:.0f} MiB, measured peak {peak / 2**20:.0f} MiB, "
        f"predicted {module.plan.predicted_peak_bytes / 2**20:.0f} MiB"
    )
    assert peak <= budget
    module.close()
