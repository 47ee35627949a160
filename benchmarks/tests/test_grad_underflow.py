"""benchmarks/grad_underflow.py: fp16 gradients' zero and subnormal shares (CPU)."""

from __future__ import annotations

import pytest
import torch
from grad_underflow import FP16_SMALLEST_NORMAL, Shares, measure, shares


def test_shares_count_zeros_and_subnormals_apart() -> None:
    t = torch.tensor([0.0, 0.0, 1e-6, -3e-7, FP16_SMALLEST_NORMAL, 1.0, -2.0, 0.5]).half()
    assert shares([t]) == Shares(zero=2 / 8, subnormal=2 / 8)
    assert shares([t, torch.ones(8).half()]) == Shares(zero=2 / 16, subnormal=2 / 16)
    with pytest.raises(ValueError, match="no gradient"):
        shares([])


def test_a_loss_scale_lifts_a_tiny_gpt2s_gradients_out_of_the_subnormal_range() -> None:
    # 30 predicted tokens over a 1024 vocabulary: the logits' gradients are about
    # 1/1024/30, below fp16's smallest normal, unless scaled.
    (unscaled, p1, o1), (scaled, p2, o2) = measure(1, 2, 16, [1.0, 65536.0], width=64, heads=2)
    assert (unscaled, scaled) == (1.0, 65536.0)
    assert set(o1) == set(o2) == {"h0.attn.c_attn", "h0.mlp.c_fc"}
    # (Zeros that dropout leaves stay zero at any scale.)
    assert o1["h0.attn.c_attn"].subnormal > 0.3
    for name in o1:
        assert o2[name].subnormal < min(0.01, o1[name].subnormal), name
    assert p1.subnormal > 0.1 > 0.01 > p2.subnormal
