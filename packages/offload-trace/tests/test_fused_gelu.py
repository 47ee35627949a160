"""The tanh-GELU pass ([Note: fused tanh GELU] in ``offload_trace/_gelu.py``): GPT-2's
written-out GELU becomes one ``aten.gelu(approximate="tanh")``; anything else stays."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import fx, nn
from trace_helpers import IdsOnly, assign_real, gpt2, token_inputs

from offload_trace import rewrite_tanh_gelu, trace

GELU = torch.ops.aten.gelu.default
TANH = torch.ops.aten.tanh.default


def _count(gm: fx.GraphModule, target: object) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target is target)


def _loss_and_grads(
    run: Callable[..., torch.Tensor], model: nn.Module, ids: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = run(input_ids=ids)
    weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        grads[name] = p.grad.clone()
        p.grad = None
    return out.detach(), grads


def test_gpt2_gelus_fuse_and_training_matches_the_eager_model() -> None:
    """Each layer's written-out GELU becomes one node: seven operations fewer per layer,
    three fewer activations saved per layer, and logits and gradients equal the eager
    model's to float32 rounding."""
    torch.manual_seed(0)
    model = IdsOnly(gpt2(hidden=64, layers=3, dropout=0.0).lm)
    ids = token_inputs(4, 16)["input_ids"]
    plain = trace(model, {"input_ids": ids}, dtype=torch.float32, target_device="cpu")
    fused = trace(
        model, {"input_ids": ids}, dtype=torch.float32, target_device="cpu", fuse_gelu=True
    )
    assert plain.fused_gelu == ()
    assert len(fused.fused_gelu) == 3
    assert _count(fused.graph_module, GELU) == 3 and _count(fused.graph_module, TANH) == 0
    assert _count(plain.graph_module, GELU) == 0 and _count(plain.graph_module, TANH) == 3
    assert len(plain.operation_names) - len(fused.operation_names) == 3 * 7
    # The written-out form also saves tanh's output and both factors of its last product:
    # three (batch, seq, 4 * hidden) float32 activations a layer.
    activation = 4 * 16 * 4 * 64 * 4
    assert plain.saved_bytes - fused.saved_bytes == 3 * 3 * activation
    assert {op.name for op in fused.to_profile().operations} == set(fused.operation_names)

    gm = assign_real(fused.module_for("cpu"), model)
    assert _count(gm, GELU) == 3
    expected, expected_grads = _loss_and_grads(model, model, ids)
    got, got_grads = _loss_and_grads(gm, model, ids)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        # float32 rounding of the two forms, against each gradient's own scale (the fused
        # kernel rounds once where the chain rounds eight times).
        scale = float(grad.abs().max())
        torch.testing.assert_close(got_grads[name], grad, rtol=0, atol=2e-5 * scale, msg=name)


def test_public_pass_fuses_a_torch_export_graph_in_fp16() -> None:
    """On a graph from ``torch.export`` directly, in float16: the fused GELU's logits are
    within fp16 rounding of the written-out chain's."""
    torch.manual_seed(0)
    model = IdsOnly(gpt2(hidden=64, layers=2, dropout=0.0).lm).to(torch.float16)
    ids = token_inputs(2, 16)["input_ids"]
    gm = torch.export.export(model, (), {"input_ids": ids}, strict=False).module()
    expected = gm(input_ids=ids).float()
    names = rewrite_tanh_gelu(gm)
    assert len(names) == 2 and _count(gm, GELU) == 2
    torch.testing.assert_close(gm(input_ids=ids).float(), expected, rtol=2e-2, atol=2e-2)


class _Gelus(nn.Module):
    """A written-out tanh GELU in several spellings, and near-misses that must stay."""

    def __init__(self, variant: str) -> None:
        super().__init__()
        self.variant = variant
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        c = math.sqrt(2.0 / math.pi)
        if self.variant == "gpt2":
            return 0.5 * h * (1.0 + torch.tanh(c * (h + 0.044715 * torch.pow(h, 3.0))))
        if self.variant == "swapped":  # every product and sum with its operands swapped
            return (torch.tanh((torch.pow(h, 3.0) * 0.044715 + h) * c) + 1.0) * (h * 0.5)
        if self.variant == "other_constant":  # not the tanh GELU's constant
            return 0.5 * h * (1.0 + torch.tanh(c * (h + 0.05 * torch.pow(h, 3.0))))
        if self.variant == "other_input":  # the cube of another tensor
            return 0.5 * h * (1.0 + torch.tanh(c * (h + 0.044715 * torch.pow(x, 3.0))))
        if self.variant == "tanh_reused":  # an inner value used elsewhere must stay
            t = torch.tanh(c * (h + 0.044715 * torch.pow(h, 3.0)))
            return 0.5 * h * (1.0 + t) + t
        raise AssertionError(self.variant)


@pytest.mark.parametrize("variant", ["gpt2", "swapped"])
def test_either_operand_order_fuses(variant: str) -> None:
    torch.manual_seed(0)
    model = _Gelus(variant)
    x = torch.randn(4, 8)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu", fuse_gelu=True)
    assert len(traced.fused_gelu) == 1
    gm = assign_real(traced.module_for("cpu"), model)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("variant", ["other_constant", "other_input", "tanh_reused"])
def test_near_misses_are_left_alone(variant: str) -> None:
    torch.manual_seed(0)
    model = _Gelus(variant)
    x = torch.randn(4, 8)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu", fuse_gelu=True)
    assert traced.fused_gelu == ()
    assert _count(traced.graph_module, GELU) == 0
    gm = assign_real(traced.module_for("cpu"), model)
    torch.testing.assert_close(gm(x), model(x), rtol=1e-6, atol=1e-7)
