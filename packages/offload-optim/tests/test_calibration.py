"""check_host_rate: the host rate the training loop ran at, against the plan's, on CPU plans
made by memory_optimize (every host-state region stepped by the host worker)."""

from __future__ import annotations

import copy
import statistics
from typing import Any

import pytest
import torch
from optim_helpers import (
    batch,
    offload_module,
    plan_at_least_budget,
    rel_diff,
    tiny_gpt2,
    train_offload,
    train_plain,
)

from offload_optim import (
    AMPOptimizer,
    HostRateCheck,
    HybridAdam,
    check_host_rate,
    planned_host_busy_s,
)
from offload_runtime import OffloadModule, default_cpu_profile
from offload_solver import Stream


def _all_host(model: torch.nn.Module, **kwargs: Any) -> OffloadModule:
    """memory_optimize on the CPU at the least budget, every region's state on the host."""
    options: dict[str, Any] = {
        "hardware": default_cpu_profile(),
        "device": "cpu",
        "block_search_range_bytes": 0,
        "dtype": torch.float32,
        "state_on_device": False,
        **kwargs,
    }
    return plan_at_least_budget(model, batch(0), **options)


def _trained(steps: int, keep: int) -> tuple[AMPOptimizer, OffloadModule]:
    module = _all_host(tiny_gpt2())
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=keep)
    train_offload(amp, module, range(steps))
    return amp, module


def test_the_check_sets_the_loop_beside_the_plan() -> None:
    amp, module = _trained(steps=6, keep=6)
    check = check_host_rate(amp, last=4)
    assert check is not None
    reports = amp.recent_steps()[-4:]
    assert check.steps == 4
    assert check.measured_busy_s == statistics.median(r.host_step_s for r in reports)
    assert module.hardware is not None
    assert check.planned_params_per_s == module.hardware.host_adam_params_per_s
    host_lane = [iv for iv in module.plan.timeline if iv.stream is Stream.HOST]
    assert host_lane
    assert check.planned_busy_s == pytest.approx(sum(iv.end_s - iv.start_s for iv in host_lane))
    assert check.planned_busy_s == planned_host_busy_s(module.plan)
    assert check.loop_params_per_s == pytest.approx(
        check.planned_params_per_s * check.planned_busy_s / check.measured_busy_s
    )
    assert check_host_rate(amp) is not None  # every kept step


def test_planning_again_with_the_loop_rate_simulates_the_measured_host() -> None:
    amp, module = _trained(steps=6, keep=5)
    check = check_host_rate(amp, last=4)
    assert check is not None and module.hardware is not None
    again = _all_host(
        tiny_gpt2(),
        hardware=module.hardware,
        host_step_params_per_s=check.loop_params_per_s,
    )
    assert again.hardware is not None
    assert again.hardware.host_adam_params_per_s == pytest.approx(check.loop_params_per_s)
    # Every region's state is on the host either way: the new plan's host lane is as busy
    # as the loop measured.
    assert planned_host_busy_s(again.plan) == pytest.approx(check.measured_busy_s, rel=0.02)


def test_arithmetic() -> None:
    check = HostRateCheck(
        planned_params_per_s=5e9, planned_busy_s=1.0, measured_busy_s=1.25, steps=3
    )
    assert check.busy_ratio == pytest.approx(1.25)
    assert check.loop_params_per_s == pytest.approx(4e9)


def test_no_reports_kept_or_a_bad_count_is_refused() -> None:
    amp, _ = _trained(steps=2, keep=0)
    with pytest.raises(ValueError, match="keep_reports"):
        check_host_rate(amp)
    amp, _ = _trained(steps=2, keep=2)
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="last"):
            check_host_rate(amp, last=bad)  # type: ignore[arg-type]


def test_a_plan_without_a_profile_has_no_check() -> None:
    module = offload_module(tiny_gpt2(), batch(0))  # hand-made plan: no hardware
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2), module, keep_reports=3)
    train_offload(amp, module, range(3))
    assert check_host_rate(amp) is None


def test_planning_again_mid_training_continues_exactly() -> None:
    """The recipe: train, check the host rate, save the state, plan again with the loop's
    rate (here also with room for device state, so that the two plans place regions
    differently), load the state and go on: the losses are AdamW's."""
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    first = _all_host(model)
    amp = AMPOptimizer(
        HybridAdam(first.parameters(), lr=1e-2, weight_decay=0.01), first, keep_reports=3
    )
    losses = train_offload(amp, first, range(4))
    check = check_host_rate(amp, last=3)
    assert check is not None and first.hardware is not None
    state = amp.state_dict()
    first.close()
    # Another model's weights: everything the run continues from comes from the state.
    second = plan_at_least_budget(
        tiny_gpt2(seed=7),
        batch(0),
        scale=3,
        hardware=first.hardware,
        host_step_params_per_s=check.loop_params_per_s,
        device="cpu",
        block_search_range_bytes=0,
        dtype=torch.float32,
    )
    placements = [(rp.placement, rp.state) for rp in second.plan.regions]
    assert placements != [(rp.placement, rp.state) for rp in first.plan.regions]
    again = AMPOptimizer(HybridAdam(second.parameters(), lr=1e-2, weight_decay=0.01), second)
    again.load_state_dict(state)
    losses += train_offload(again, second, range(4, 8))
    opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.01)
    expected = train_plain(opt, reference, range(8))
    assert rel_diff(losses, expected) < 1e-5
