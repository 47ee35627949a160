"""OffloadTrainer: the Hugging Face Trainer trains a tiny Llama through the planner under a
budget that offloads, as plain AdamW with the same batches and lr schedule would."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
from optim_helpers import VOCAB, tiny_llama
from transformers import (
    LlamaForCausalLM,
    TrainingArguments,
    default_data_collator,
    get_scheduler,
)

from offload_optim.hf import OffloadTrainer, causal_lm_loss, model_inputs
from offload_runtime import OffloadConfig, plan
from offload_solver import InfeasibleBudgetError

SEQ = 16
STEPS = 8
LR = 1e-2


def _dataset(n: int, seq: int = SEQ) -> list[dict[str, torch.Tensor]]:
    """Counting sequences from random starts (easy to learn), fixed length."""
    gen = torch.Generator().manual_seed(7)
    starts = torch.randint(0, VOCAB, (n,), generator=gen)
    rows = []
    for s in starts.tolist():
        ids = (s + torch.arange(seq)) % VOCAB
        rows.append({"input_ids": ids, "attention_mask": torch.ones(seq, dtype=torch.long)})
    return rows


def _least_budget(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> int:
    config = OffloadConfig(dtype=torch.float32)
    try:
        plan(model, batch, 1, config=config, device="cpu", progress=False)
    except InfeasibleBudgetError as exc:
        return exc.least_budget_bytes
    raise AssertionError("the planner accepted a 1-byte budget")


def _args(tmp_path: Path, **kw: Any) -> TrainingArguments:
    base: dict[str, Any] = dict(
        output_dir=str(tmp_path / "out"),
        use_cpu=True,
        report_to=[],
        save_strategy="no",
        per_device_train_batch_size=2,
        learning_rate=LR,
        weight_decay=0.01,
        lr_scheduler_type="linear",
        warmup_steps=2,
        max_grad_norm=0.0,
        logging_steps=1,
        dataloader_drop_last=True,
        seed=0,
    )
    base.update(kw)
    return TrainingArguments(**base)


class _Recording(OffloadTrainer):
    """Keeps the batches it trained on, in order, for the plain reference."""

    seen: list[dict[str, torch.Tensor]]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.seen.append({k: v.clone() for k, v in inputs.items()})
        return super().training_step(model, inputs, num_items_in_batch)


def test_trainer_matches_plain_adamw_with_accumulation(tmp_path: Path) -> None:
    model = tiny_llama(3)
    reference = copy.deepcopy(model)
    data = _dataset(2 * 2 * STEPS)
    budget = _least_budget(model, default_data_collator(data[:2]))
    args = _args(tmp_path, gradient_accumulation_steps=2, max_steps=STEPS)
    trainer = _Recording(
        model,
        args,
        memory_budget=budget,
        offload_config=OffloadConfig(dtype=torch.float32),
        train_dataset=data,
        data_collator=default_data_collator,
    )
    trainer.seen = []
    trainer.train()
    module = trainer.offload_module
    assert module is not None
    assert any(st.offloaded for st in module.storages), "the budget offloads nothing"
    losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    assert len(losses) == STEPS and losses[-1] < losses[0]
    assert len(trainer.seen) == 2 * STEPS

    # The same steps in plain PyTorch: AdamW with the Trainer's decay groups and schedule.
    decay = set(trainer.get_decay_parameter_names(reference))
    named = list(reference.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for n, p in named if n in decay], "weight_decay": 0.01},
            {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0},
        ],
        lr=LR,
    )
    sched = get_scheduler("linear", opt, num_warmup_steps=2, num_training_steps=STEPS)
    plain_losses = []
    for step in range(STEPS):
        opt.zero_grad()
        total = 0.0
        for micro in trainer.seen[2 * step : 2 * step + 2]:
            out = reference(**model_inputs(micro))
            loss = causal_lm_loss(out, micro) / 2
            loss.backward()  # type: ignore[no-untyped-call]
            total += float(loss.detach())
        opt.step()
        sched.step()
        plain_losses.append(total)
    assert losses == pytest.approx(plain_losses, rel=1e-5)
    ref = reference.state_dict()  # tied names too
    for name, master in module.named_parameters():
        torch.testing.assert_close(master, ref[name].detach(), rtol=1e-5, atol=1e-6)

    trainer.save_model(str(tmp_path / "saved"))
    loaded = LlamaForCausalLM.from_pretrained(str(tmp_path / "saved"))
    trained = module.state_dict()
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, trained[name]), name
    module.close()


def test_a_batch_of_another_shape_is_refused(tmp_path: Path) -> None:
    model = tiny_llama(3)
    data = _dataset(6)  # batches of 4, 2: the last is smaller
    trainer = OffloadTrainer(
        model,
        _args(tmp_path, per_device_train_batch_size=4, dataloader_drop_last=False),
        memory_budget=2**30,
        offload_config=OffloadConfig(dtype=torch.float32),
        train_dataset=data,
        data_collator=default_data_collator,
    )
    with pytest.raises(ValueError, match="dataloader_drop_last=True"):
        trainer.train()
    assert trainer.offload_module is not None
    trainer.offload_module.close()


def test_fp16_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="OffloadConfig"):
        OffloadTrainer(tiny_llama(3), _args(tmp_path, bf16=True), memory_budget=2**30)


def test_resuming_from_a_trainer_checkpoint_is_refused_with_the_way_round(
    tmp_path: Path,
) -> None:
    trainer = OffloadTrainer(tiny_llama(3), _args(tmp_path), memory_budget=2**30)
    with pytest.raises(ValueError, match="does not resume from a Trainer checkpoint"):
        trainer.train(resume_from_checkpoint=str(tmp_path))
