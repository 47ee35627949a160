"""Fused attention's rates from the traced model's own shapes (``attention_shapes``,
``with_attention_rates``, ``PlanForce(measure_attention=True)``), on the CPU with a
made-up measurement: what is read from the graph, how shapes are weighted, and the errors."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from tiny_models import tiny_gpt2
from torch.nn import functional as F
from torch.utils.flop_counter import sdpa_flop_count

from offload_runtime import OffloadConfig, OffloadModule, PlanForce, default_cpu_profile
from offload_runtime.planning import (
    AttentionShape,
    attention_shapes,
    build_offload_module,
    plan_model,
    with_attention_rates,
)
from offload_trace import trace


class TwoAttentions(torch.nn.Module):
    """Two causal attention calls of different shapes, the second with dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).view(2, 16, 4, 8).transpose(1, 2)  # [2, 4, 16, 8]
        a = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        wide = a.transpose(1, 2).reshape(2, 16, 2, 16).transpose(1, 2)  # [2, 2, 16, 16]
        b = F.scaled_dot_product_attention(wide, wide, wide, dropout_p=0.25, is_causal=True)
        return b.sum(dim=1)


def test_gpt2_has_one_shape_with_a_call_per_layer() -> None:
    model = tiny_gpt2(layers=3)  # 4 heads of 8
    traced = trace(model, {"input_ids": torch.zeros(2, 16, dtype=torch.long)}, dtype=torch.float32)
    assert attention_shapes(traced.graph_module) == [AttentionShape(2, 4, 16, 8, 0.0, calls=3)]


def test_distinct_shapes_and_dropout_are_read_in_graph_order() -> None:
    traced = trace(TwoAttentions(), (torch.randn(2, 16, 32),), dtype=torch.float32)
    assert attention_shapes(traced.graph_module) == [
        AttentionShape(2, 4, 16, 8, 0.0),
        AttentionShape(2, 2, 16, 16, 0.25),
    ]


def test_rates_are_the_models_attention_flops_over_their_time() -> None:
    hw = default_cpu_profile()
    small = AttentionShape(2, 4, 16, 8, 0.0, calls=3)
    large = AttentionShape(2, 2, 16, 16, 0.25, calls=1)
    rates = {small: (1e12, 2e12), large: (4e12, 8e12)}
    got = with_attention_rates(hw, [small, large], rates.__getitem__)

    def flop(s: AttentionShape) -> float:
        dims = (s.batch, s.heads, s.seq, s.head_dim)
        return s.calls * float(sdpa_flop_count(dims, dims, dims))

    fs, fl = flop(small), flop(large)
    assert got.attention_fwd_flop_per_s == pytest.approx((fs + fl) / (fs / 1e12 + fl / 4e12))
    # Between the two shapes' rates, nearer the one whose calls take longer.
    assert 1e12 < got.attention_fwd_flop_per_s < 4e12
    assert 2e12 < got.attention_bwd_flop_per_s < 8e12
    # Nothing else of the profile changes.
    assert (
        dataclasses.replace(got, attention_fwd_flop_per_s=0.0, attention_bwd_flop_per_s=0.0) == hw
    )


def test_no_attention_leaves_the_profile_alone_and_a_bad_rate_is_named() -> None:
    hw = default_cpu_profile()
    assert with_attention_rates(hw, [], lambda s: (1.0, 1.0)) is hw
    with pytest.raises(ValueError, match="must be > 0 FLOP/s"):
        with_attention_rates(hw, [AttentionShape(1, 1, 8, 8, 0.0)], lambda s: (0.0, 1e12))


def _planned_on_the_cpu(**kwargs: Any) -> OffloadModule:
    """A two-layer tiny GPT-2 planned on the CPU under 1 GiB, ``kwargs`` forced."""
    model = tiny_gpt2(layers=2)
    planned = plan_model(
        model,
        {"input_ids": torch.zeros(2, 8, dtype=torch.long)},
        2**30,
        "asyn",
        config=OffloadConfig(dtype=torch.float32),
        device="cpu",
        progress=False,
        force=PlanForce(**kwargs),
    )
    return build_offload_module(model, planned)


def test_measure_attention_on_the_cpu_is_a_named_error() -> None:
    with pytest.raises(ValueError, match=r"measure_attention=True\) .* leave it False on the CPU"):
        _planned_on_the_cpu(measure_attention=True)


def test_attention_is_measured_by_default_on_cuda_unless_the_profile_has_rates() -> None:
    """``PlanForce(measure_attention=None)``, the default:
    measured on a CUDA device, not on the CPU, and not where the profile given already
    carries both rates (a plan saved with them, planned again the same way)."""
    from offload_runtime.planning.attention import measures_attention

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    hw = default_cpu_profile()
    assert hw.attention_fwd_flop_per_s == hw.attention_bwd_flop_per_s == 0.0
    rated = dataclasses.replace(hw, attention_fwd_flop_per_s=1e14, attention_bwd_flop_per_s=2e14)
    half = dataclasses.replace(hw, attention_fwd_flop_per_s=1e14)
    assert measures_attention(None, cuda, None)
    assert measures_attention(None, cuda, hw)
    assert measures_attention(None, cuda, half)
    assert not measures_attention(None, cuda, rated)
    assert not measures_attention(None, cpu, None)
    assert not measures_attention(False, cuda, None)
    assert measures_attention(True, cuda, rated)
    assert not measures_attention(False, cpu, None)
    with pytest.raises(ValueError, match="leave it False on the CPU"):
        measures_attention(True, cpu, None)


def test_memory_optimize_on_the_cpu_plans_at_the_matmul_rate_by_default() -> None:
    module = _planned_on_the_cpu()
    try:
        assert module.hardware is not None
        assert module.hardware.attention_fwd_flop_per_s == 0.0
        assert module.hardware.attention_bwd_flop_per_s == 0.0
    finally:
        module.close()
