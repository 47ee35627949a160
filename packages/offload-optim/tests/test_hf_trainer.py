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
    TrainerCallback,
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


def _least_budget(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32
) -> int:
    config = OffloadConfig(dtype=dtype)
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
    """Keeps the batches it trained on and their losses, in order."""

    seen: list[dict[str, torch.Tensor]]
    losses: list[float]

    def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
        self.seen.append({k: v.clone() for k, v in inputs.items()})
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.losses.append(float(loss))
        return loss


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
    trainer.losses = []
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


class _StopAt(TrainerCallback):
    """Stops the run after step ``step``, as if it were killed after that checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def _trainer(
    tmp_path: Path, model: torch.nn.Module, budget: int, dtype: torch.dtype, **kw: Any
) -> _Recording:
    trainer = _Recording(
        model,
        _args(tmp_path, **{"gradient_accumulation_steps": 2, "max_steps": 6, **kw}),
        memory_budget=budget,
        offload_config=OffloadConfig(dtype=dtype),
        train_dataset=_dataset(2 * 2 * 6),
        data_collator=default_data_collator,
    )
    trainer.seen = []
    trainer.losses = []
    return trainer


def _equal_states(a: Any, b: Any, where: str = "state") -> None:
    """``a`` and ``b`` are equal bit for bit: tensors, and the containers holding them."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and set(a) == set(b), where
        for key in a:
            _equal_states(a[key], b[key], f"{where}[{key!r}]")
    elif isinstance(a, list | tuple):
        assert isinstance(b, list | tuple) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _equal_states(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
def test_resuming_from_a_checkpoint_continues_the_run_bit_for_bit(
    tmp_path: Path, dtype: torch.dtype
) -> None:
    model = tiny_llama(3)
    budget = _least_budget(model, default_data_collator(_dataset(2)), dtype)
    straight = _trainer(tmp_path / "straight", model, budget, dtype)
    straight.train()
    assert straight.offload_module is not None
    assert any(st.offloaded for st in straight.offload_module.storages), "nothing offloaded"

    # The same run, stopped after its step-3 checkpoint.
    checkpointing = dict(save_strategy="steps", save_steps=3)
    first = _trainer(tmp_path / "split", tiny_llama(3), budget, dtype, **checkpointing)
    first.add_callback(_StopAt(3))
    first.train()
    assert first.state.global_step == 3
    first_module = first.offload_module
    assert first_module is not None
    at_step_3 = first_module.state_dict()
    first_module.close()
    folder = tmp_path / "split" / "out" / "checkpoint-3"
    loaded = LlamaForCausalLM.from_pretrained(str(folder))
    for name, value in loaded.state_dict().items():
        assert torch.equal(value, at_step_3[name]), name
    saved = torch.load(folder / "optimizer.pt", weights_only=True)
    assert "module" not in saved, "the masters are in model.safetensors, once"

    # A fresh trainer over a model of other weights: everything must come from checkpoint-3.
    second = _trainer(tmp_path / "split", tiny_llama(3, seed=5), budget, dtype, **checkpointing)
    second.train(resume_from_checkpoint=True)  # the last checkpoint in output_dir
    assert second.state.global_step == 6

    assert len(straight.seen) == len(first.seen) + len(second.seen) == 12
    for a, b in zip(straight.seen, first.seen + second.seen, strict=True):
        _equal_states(a, b, "batch")
    assert straight.losses == first.losses + second.losses  # every micro-batch, exactly
    logged = [
        (log["loss"], log["learning_rate"]) for log in straight.state.log_history if "loss" in log
    ]
    resumed_logged = [
        (log["loss"], log["learning_rate"]) for log in second.state.log_history if "loss" in log
    ]
    assert len(logged) == 6 and resumed_logged == logged
    one, two = straight.offload_module, second.offload_module
    assert one is not None and two is not None
    _equal_states(one.state_dict(), two.state_dict(), "masters")
    amp_one, amp_two = straight.shell.amp, second.shell.amp
    assert amp_one is not None and amp_two is not None
    _equal_states(amp_one.state_dict(masters=False), amp_two.state_dict(masters=False))
    if dtype == torch.float16:
        assert amp_one.loss_scale == amp_two.loss_scale
    one.close()
    two.close()


def _checkpoint_1(tmp_path: Path) -> Path:
    trainer = _trainer(
        tmp_path, tiny_llama(3), 2**30, torch.float32, max_steps=1, save_strategy="steps"
    )
    trainer.train()
    assert trainer.offload_module is not None
    trainer.offload_module.close()
    return tmp_path / "out" / "checkpoint-1"


def test_resuming_without_the_optimizer_file_names_it(tmp_path: Path) -> None:
    folder = _checkpoint_1(tmp_path)
    (folder / "optimizer.pt").unlink()
    trainer = _trainer(tmp_path, tiny_llama(3), 2**30, torch.float32)
    with pytest.raises(ValueError, match=r"optimizer\.pt is missing"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.offload_module is None, "refused before planning"


def test_resuming_another_model_names_the_file_and_the_mismatch(tmp_path: Path) -> None:
    folder = _checkpoint_1(tmp_path)
    trainer = _trainer(tmp_path, tiny_llama(2), 2**30, torch.float32)
    with pytest.raises(ValueError, match=r"model\.safetensors is not a checkpoint of this model"):
        trainer.train(resume_from_checkpoint=str(folder))
    assert trainer.offload_module is not None
    trainer.offload_module.close()
