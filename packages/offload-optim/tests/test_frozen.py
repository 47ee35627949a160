"""Frozen parameters and LoRA adapters (peft) trained through the planner under a budget:
AdamW's losses and weights, frozen weights unchanged, no optimizer state for them."""

from __future__ import annotations

import copy
from typing import Any

import peft
import torch
from optim_helpers import (
    LogitsOnly,
    batch,
    plan_at_least_budget,
    rel_diff,
    tiny_llama,
    train_offload,
    train_plain,
)

from offload_optim import AMPOptimizer, HybridAdam
from offload_runtime import OffloadConfig, OffloadModule, default_cpu_profile
from offload_runtime.planning.planner import PlanForce, plan_model
from offload_runtime.storage import required_host_bytes
from offload_solver import InfeasibleBudgetError, StatePlacement

STEPS = 8


def _train_and_compare(model: torch.nn.Module) -> tuple[OffloadModule, HybridAdam]:
    """Train ``model`` through the planner at the least budget and a copy with AdamW over
    its trainable parameters; check losses and every weight agree, frozen ones unchanged."""
    reference = copy.deepcopy(model)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = plan_at_least_budget(
        model,
        batch(0),
        "asyn",
        dtype=torch.float32,
        hardware=default_cpu_profile(),
        block_search_range_bytes=0,
    )
    assert any(st.offloaded and st.frozen for st in module.storages)
    assert any(st.offloaded and st.trainable_numel for st in module.storages)
    opt = HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01)
    amp = AMPOptimizer(opt, module)
    losses = train_offload(amp, module, range(STEPS))
    trainable = [p for p in reference.parameters() if p.requires_grad]
    expected = train_plain(
        torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01), reference, range(STEPS)
    )
    assert rel_diff(losses, expected) < 1e-5
    ref = dict(reference.named_parameters())
    for name, master in module.named_parameters():
        if ref[name].requires_grad:
            torch.testing.assert_close(master, ref[name].detach(), rtol=1e-5, atol=1e-6)
            assert not torch.equal(master, initial[name]), f"{name} did not train"
        else:
            assert torch.equal(master, initial[name]), f"frozen {name} changed"
    return module, opt


def _state_only_for_trainable(module: OffloadModule, opt: HybridAdam) -> None:
    frozen = {n for st in module.storages for n in st.frozen}
    masters = dict(module.named_parameters())
    with_state = {id(p) for p in opt.state}
    assert with_state == {id(p) for n, p in masters.items() if n not in frozen}
    assert all(masters[n].grad is None for n in frozen)
    assert {n for n, _ in module.named_gradients()}.isdisjoint(frozen)
    moments = sum(rs.exp_avg.numel() for rs in opt._layout.regions.values())
    assert moments == sum(masters[n].numel() for n in masters if n not in frozen)


def test_frozen_embeddings_and_first_layer_match_adamw() -> None:
    llama = tiny_llama()
    llama.model.embed_tokens.weight.requires_grad_(False)
    llama.model.layers[0].requires_grad_(False)
    module, opt = _train_and_compare(LogitsOnly(llama))
    _state_only_for_trainable(module, opt)
    module.close()


def test_lora_on_tiny_llama_matches_peft_with_adamw() -> None:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    lora = peft.get_peft_model(tiny_llama(), config)
    # LoRA's B starts at zero; a random start makes every adapter weight's gradient non-zero.
    with torch.no_grad():
        for name, p in lora.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)
    module, opt = _train_and_compare(LogitsOnly(lora))
    _state_only_for_trainable(module, opt)
    trainable = {n for st in module.storages for lay in st.layouts for n in [lay.name]}
    trainable -= {n for st in module.storages for n in st.frozen}
    assert trainable and all("lora_" in n for n in trainable)
    module.close()


def _lora_llama() -> torch.nn.Module:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return LogitsOnly(peft.get_peft_model(tiny_llama(), config))


def _least_budget(model: torch.nn.Module) -> int:
    try:
        plan_model(
            model,
            batch(0),
            1,
            "asyn",
            device="cpu",
            progress=False,
            config=OffloadConfig(dtype=torch.float32),
            hardware=default_cpu_profile(),
        )
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes
    raise AssertionError("the planner accepted a 1-byte budget")


def test_lora_profile_marks_frozen_parameters_and_plans_cheaper() -> None:
    lora = _lora_llama()
    full = _lora_llama()
    for p in full.parameters():
        p.requires_grad_(True)

    def planned(model: torch.nn.Module, budget: int) -> Any:
        return plan_model(
            model,
            batch(0),
            budget,
            "asyn",
            device="cpu",
            progress=False,
            config=OffloadConfig(dtype=torch.float32),
            hardware=default_cpu_profile(),
            force=PlanForce(block_search_range_bytes=0),
        )

    budget = 2**30  # room for everything: all state on the device
    got, ref = planned(lora, budget), planned(full, budget)
    frozen = {p.name for p in got.profile.parameters if not p.trainable}
    assert frozen and not any("lora_" in n for n in frozen)
    assert {p.name for p in got.profile.parameters if p.trainable} == {
        n for n, p in lora.named_parameters() if p.requires_grad
    }
    assert all(p.trainable for p in ref.profile.parameters)
    assert got.profile.trainable_param_numel < ref.profile.trainable_param_numel / 10
    assert got.plan.predicted_peak_bytes < ref.plan.predicted_peak_bytes
    device_state = [rp for rp in got.plan.regions if rp.state is StatePlacement.DEVICE]
    assert device_state
    # The least budget each fits: the LoRA model fits one the all-trainable one does not.
    least = _least_budget(lora)
    assert least < _least_budget(full)
    assert required_host_bytes(got.plan, torch.float32) <= required_host_bytes(
        ref.plan, torch.float32
    )
