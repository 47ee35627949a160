"""A module torch.export cannot capture runs as one opaque operation of the plan: its
parameters form part of an offloaded region, are uploaded before the operation runs (in
forward, and again for the recomputation in backward), and its gradients equal plain
PyTorch's with the same random draws."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from tiny_models import uploads_per_step
from torch import nn

from offload_runtime import OffloadConfig, OffloadModule
from offload_runtime.hardware import default_cpu_profile
from offload_runtime.planning import build_offload_module, plan_model
from offload_solver import InfeasibleBudgetError, ParamPlacement
from offload_trace._opaque import OpaqueEntry


class _LayerDrop(nn.Module):
    """Each layer skipped at random in training, decided in Python (as Hugging Face's
    layer drop is): torch.export cannot capture it."""

    def __init__(self, width: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if self.training and torch.rand([]) < 0.5:
                continue
            x = torch.nn.functional.gelu(layer(x))
        return x


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(16, 32)
        self.body = _LayerDrop(32, 3)
        self.head = nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.embed(x)))


def _least_budget_module(model: nn.Module, inp: dict[str, torch.Tensor]) -> OffloadModule:
    def planned(budget: int) -> Any:
        return plan_model(
            model,
            inp,
            budget,
            "syn",
            config=OffloadConfig(dtype=torch.float32, fuse_gelu=False),
            hardware=default_cpu_profile(),
            device="cpu",
            progress=False,
        )

    with pytest.raises(InfeasibleBudgetError) as info:
        planned(1)
    return build_offload_module(model, planned(info.value.least_budget_bytes))


def test_an_opaque_modules_offloaded_parameters_are_uploaded_before_it_runs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    torch.manual_seed(0)
    model = _Net()
    reference = copy.deepcopy(model)
    inp = {"x": torch.randn(4, 16)}
    module = _least_budget_module(model, inp)
    assert module.opaque_modules == ("body",)
    body = {f"body.{n}" for n, _ in model.body.named_parameters()}
    [region] = [st for st in module.storages if body & {lay.name for lay in st.layouts}]
    assert body <= {lay.name for lay in region.layouts}, "the module spans one region"
    assert region.offloaded
    # Another offloaded region shares its pool slot: without an upload before the
    # operation it would read that region's values.
    assert any(
        st.offloaded and st.slot == region.slot for st in module.storages if st is not region
    )
    # Every run of the module (forward, and the recomputation in backward) sees the
    # model's own parameter values.
    expected = [p.detach().clone() for p in model.body.parameters()]
    seen: list[bool] = []
    run = OpaqueEntry.run

    def checked(entry: OpaqueEntry, training: bool, inputs: Any, state: Any) -> Any:
        seen.append(all(torch.equal(s, e) for s, e in zip(state, expected, strict=True)))
        return run(entry, training, inputs, state)

    monkeypatch.setattr(OpaqueEntry, "run", checked)
    dropped = kept = 0
    for seed in range(4):
        for p in reference.parameters():
            p.grad = None
        module.zero_grad()
        before = dict(module.controller.stats)
        torch.manual_seed(seed)
        loss = module(**inp).square().mean()
        module.backward(loss)
        uploads = {k: module.controller.stats[k] - before[k] for k in uploads_per_step(module.plan)}
        assert uploads == uploads_per_step(module.plan)
        grads = dict(module.named_gradients())
        torch.manual_seed(seed)
        ref_loss = reference(**inp).square().mean()
        ref_loss.backward()  # type: ignore[no-untyped-call]
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=0)
        for name, p in reference.named_parameters():
            if p.grad is None:  # a dropped layer: no gradient in either
                assert not grads[name].any(), name
                dropped += 1
            else:
                torch.testing.assert_close(grads[name], p.grad, rtol=0, atol=0)
                kept += name.startswith("body.")
    assert seen == [True] * 8  # four forwards, four recomputations
    assert dropped and kept, "the seeds should both drop and keep layers"
    assert sum(rp.placement is not ParamPlacement.RESIDENT for rp in module.plan.regions) > 1
    module.close()
