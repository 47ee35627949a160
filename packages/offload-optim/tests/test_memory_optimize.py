"""Training an OffloadModule built by the planner (``memory_optimize``'s path)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from optim_helpers import (
    batch,
    fell,
    plan_at_least_budget,
    rel_diff,
    tiny_gpt2,
    train_offload,
    train_plain,
)

from offload_optim import AMPOptimizer, HybridAdam, OverlapMode
from offload_runtime import OffloadConfig, OffloadModule, PlanForce, default_cpu_profile
from offload_runtime.planning import build_offload_module, plan_model


def at_least_budget(model: torch.nn.Module, solver: str, **kwargs: Any) -> OffloadModule:
    """The planner at the least budget the solver accepts: it offloads all it can."""
    options: dict[str, Any] = {
        "hardware": default_cpu_profile(),
        "device": "cpu",
        "block_search_range_bytes": 0,  # the finest regions: several of each kind
        **kwargs,
    }
    return plan_at_least_budget(model, batch(0), solver, **options)


@pytest.mark.parametrize("solver", ["syn", "asyn"])
def test_twenty_steps_through_memory_optimize_match_adamw(solver: str) -> None:
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    module = at_least_budget(model, solver, dtype=torch.float32, state_on_device=False)
    assert any(st.offloaded for st in module.storages)
    assert all(st.host_state for st in module.storages)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    losses = train_offload(amp, module, range(20))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = train_plain(opt, reference, range(20))
    assert fell(losses)
    assert rel_diff(losses, expected) < 1e-5
    assert amp.last_step is not None and amp.last_step.overlap is OverlapMode.SPECULATIVE


def test_bf16_through_memory_optimize_trains_unscaled() -> None:
    module = at_least_budget(tiny_gpt2(), "asyn", dtype=torch.bfloat16)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module)
    losses = train_offload(amp, module, range(15))
    assert amp.loss_scale == 1.0
    assert fell(losses)


def test_streamed_plan_through_the_planner_matches_adamw(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a profile whose host Adam is slow and PCIe fast, the planner streams some
    host-state regions (it offers streaming by default); they step through a ring of the
    size the plan counted, and training matches AdamW as the all-host plan does."""
    import dataclasses

    from offload_optim.streamed import StreamRing
    from offload_runtime.planning import streamed_step_costs
    from offload_solver import StatePlacement

    chunks: list[int] = []
    issue = StreamRing.issue

    def recording(self: StreamRing, pieces: list[Any], grad_scale: float | None, **kw: Any) -> Any:
        chunks.append(self.chunk)
        return issue(self, pieces, grad_scale, **kw)

    monkeypatch.setattr(StreamRing, "issue", recording)
    hardware = dataclasses.replace(default_cpu_profile(), host_adam_params_per_s=1e5)
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    budget = 64 << 20
    planned = plan_model(
        model,
        batch(0),
        budget,
        "asyn",
        config=OffloadConfig(dtype=torch.float32),
        hardware=hardware,
        device="cpu",
        progress=False,
        force=PlanForce(block_search_range_bytes=0, state_on_device=False),
    )
    module = build_offload_module(model, planned)
    streamed = [
        rp.region.index for rp in module.plan.regions if rp.state is StatePlacement.STREAMED
    ]
    assert streamed, "the planner streams on a host-bound profile"
    costs = streamed_step_costs(torch.float32, False, budget_bytes=budget)
    assert module.plan.streamed == costs
    assert {st.index for st in module.storages if st.streamed} == set(streamed)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    losses = train_offload(amp, module, range(12))
    report = amp.last_step
    assert report is not None
    assert {t.region for t in report.region_steps if t.streamed} == set(streamed)
    assert chunks and set(chunks) == {costs.staged_chunk_numel}, "rings built to the plan"
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = train_plain(opt, reference, range(12))
    assert fell(losses)
    assert rel_diff(losses, expected) < 1e-5
    module.close()


def test_twenty_steps_of_the_default_plan_in_fp32_match_adamw() -> None:
    """What a user gets in fp32 at the least budget with nothing forced (the planner's
    placements, streaming offered, its conversion place and kernel): AdamW's losses."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    module = plan_at_least_budget(
        model, batch(0), dtype=torch.float32, hardware=default_cpu_profile()
    )
    assert module.plan.options.host_kernel == "torch", "fp32 moments: torch's kernel"
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    losses = train_offload(amp, module, range(20))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = train_plain(opt, reference, range(20))
    assert fell(losses)
    assert rel_diff(losses, expected) < 1e-5
    module.close()
