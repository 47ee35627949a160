"""On a CUDA device, under a budget that offloads: a peft LoRA fine-tune of a tiny Llama,
and the Hugging Face Trainer through ``OffloadTrainer``, each as plain PyTorch trains.
fp32 training, so the comparison is to rounding. Run with ``nox -s gpu_tests``."""

from __future__ import annotations

import copy
import gc
from pathlib import Path

import peft
import pytest
import torch
from optim_helpers import (
    LogitsOnly,
    batch,
    loss_of,
    plan_at_least_budget,
    rel_diff,
    tiny_llama,
)
from transformers import TrainingArguments, default_data_collator

from offload_optim import AMPOptimizer, HybridAdam
from offload_optim.hf import OffloadTrainer
from offload_runtime import OffloadConfig, plan
from offload_solver import InfeasibleBudgetError

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
STEPS = 8
MARGIN = 64 * 1024
"""Bytes above the least budget: between the plan that names it and the next, the test's
own small device tensors (the Trainer's loss accumulator) are in use beside the plan."""


def _cuda_batch(step: int) -> dict[str, torch.Tensor]:
    return {k: v.to(CUDA) for k, v in batch(step).items()}


@pytest.fixture(autouse=True)
def _exact_matmuls(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32 matrix products in fp32 (not TF32, which an earlier test may have allowed), and
    no memory left allocated by earlier tests in the peak."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_tf32", False)
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)
    gc.collect()
    torch.cuda.empty_cache()


def test_cuda_lora_fine_tune_matches_peft_with_adamw() -> None:
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    model = LogitsOnly(peft.get_peft_model(tiny_llama(), config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, 0.02)  # LoRA's B starts at zero: every adapter then trains
    reference = copy.deepcopy(model).to(CUDA)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    module = plan_at_least_budget(
        model, _cuda_batch(0), dtype=torch.float32, device=CUDA, margin_bytes=MARGIN
    )
    assert any(st.offloaded and st.frozen for st in module.storages)
    amp = AMPOptimizer(HybridAdam(module.parameters(), lr=1e-2, weight_decay=0.01), module)
    torch.cuda.reset_peak_memory_stats()
    losses = []
    for step in range(STEPS):
        amp.zero_grad()
        b = _cuda_batch(step)
        loss = loss_of(module(**b), b["input_ids"])
        amp.backward(loss)
        amp.step()
        losses.append(loss.item())
    amp.synchronize()
    peak = torch.cuda.max_memory_allocated()
    assert peak <= module.plan.budget_bytes, (peak, module.plan.budget_bytes)
    trainable = [p for p in reference.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=1e-2, weight_decay=0.01)
    expected = []
    for step in range(STEPS):
        opt.zero_grad()
        b = _cuda_batch(step)
        loss = loss_of(reference(**b), b["input_ids"])
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
        expected.append(loss.item())
    assert rel_diff(losses, expected) < 1e-4, (losses, expected)
    ref = dict(reference.named_parameters())
    for name, master in module.named_parameters():
        if ref[name].requires_grad:
            torch.testing.assert_close(master.cpu(), ref[name].detach().cpu(), rtol=1e-4, atol=1e-5)
        else:
            assert torch.equal(master.cpu(), initial[name]), f"frozen {name} changed"
    with_state = {id(p) for p in amp.optimizer.state}
    frozen = {n for st in module.storages for n in st.frozen}
    assert with_state == {id(p) for n, p in module.named_parameters() if n not in frozen}
    module.close()


def test_cuda_trainer_trains_under_a_budget_that_offloads(tmp_path: Path) -> None:
    model = tiny_llama(3)
    gen = torch.Generator().manual_seed(7)
    data = []
    for s in torch.randint(0, 96, (2 * STEPS,), generator=gen).tolist():
        ids = (s + torch.arange(16)) % 96
        data.append({"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long)})
    example = {k: v.to(CUDA) for k, v in default_data_collator(data[:2]).items()}
    config = OffloadConfig(dtype=torch.float32)
    try:
        plan(model, example, 1, config=config, device=CUDA, progress=False)
    except InfeasibleBudgetError as exc:
        budget = exc.least_budget_bytes + MARGIN
    else:
        raise AssertionError("the planner accepted a 1-byte budget")
    args = TrainingArguments(
        output_dir=str(tmp_path / "out"),
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        learning_rate=1e-2,
        max_steps=STEPS,
        logging_steps=1,
        max_grad_norm=1.0,
        dataloader_drop_last=True,
        seed=0,
    )
    trainer = OffloadTrainer(
        model,
        args,
        memory_budget=budget,
        offload_config=config,
        train_dataset=data,
        data_collator=default_data_collator,
    )
    torch.cuda.reset_peak_memory_stats()
    trainer.train()
    module = trainer.offload_module
    assert module is not None and module.device.type == "cuda"
    assert any(st.offloaded for st in module.storages), "the budget offloads nothing"
    assert torch.cuda.max_memory_allocated() <= budget
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    module.close()
