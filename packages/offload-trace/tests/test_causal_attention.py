"""The causal-attention pass and the CUDA attention kernel model.

[Note: causal attention] in ``offload_trace/_causal.py``: a mask proved to be the constant
causal pattern is replaced by ``is_causal=True``; anything else is left alone.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn
from trace_helpers import IdsOnly, assign_real, gpt2, llama, token_inputs

from offload_trace import TracedModel, rewrite_causal_attention, trace

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def _rewritten_close(got: torch.Tensor, expected: torch.Tensor, msg: str | None = None) -> None:
    """Assert a rewritten attention's result is close to the masked one's.

    ``is_causal`` runs a different CPU kernel from an explicit mask, so the sums round
    differently, by an amount that depends on the CPU's vector width: on CI's CPU the logits
    differed by up to 1.7e-6 (relative 3e-3 on a logit near zero). A wrong mask moves
    logits by orders of magnitude more, and the masks that must not be rewritten are
    compared exactly.
    """
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5, msg=msg)


def _attention_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is SDPA]


def _is_plain_causal(node: fx.Node) -> bool:
    return node.args[3] is None and node.args[5] is True


def _grads(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        assert p.grad is not None, name
        out[name] = p.grad.clone()
        p.grad = None
    return out


def _outputs_and_grads(
    run: Callable[[], torch.Tensor], model: nn.Module
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    out = run()
    # A loss that weighs every logit differently, so every gradient path is exercised.
    weights = torch.linspace(-1.0, 1.0, out.numel()).reshape(out.shape)
    (out * weights).sum().backward()
    return out.detach(), _grads(model)


@pytest.mark.parametrize("builder", [gpt2, llama], ids=["gpt2", "llama"])
def test_constant_causal_mask_becomes_is_causal_and_training_is_unchanged(
    builder: Callable[..., nn.Module],
) -> None:
    """Without an attention_mask input every attention is rewritten, and the rewritten
    graph's logits and gradients equal the eager model's."""
    torch.manual_seed(0)
    model = IdsOnly(builder(dropout=0.0).lm)
    ids = token_inputs(3, 16)["input_ids"]
    traced = trace(model, {"input_ids": ids}, dtype=torch.float32, target_device="cpu")

    attention = _attention_nodes(traced.graph_module)
    assert len(attention) == 2
    assert traced.causal_attention == tuple(n.name for n in attention)
    assert all(_is_plain_causal(n) for n in attention)
    # The erased mask nodes are no longer operations of the profile either.
    names = set(traced.operation_names)
    assert {op.name for op in traced.to_profile().operations} == names
    assert not any(n.target is torch.ops.aten.tril.default for n in traced.graph_module.graph.nodes)

    gm = assign_real(traced.module_for("cpu"), model)
    assert all(_is_plain_causal(n) for n in _attention_nodes(gm))
    expected, expected_grads = _outputs_and_grads(lambda: model(input_ids=ids), model)
    got, got_grads = _outputs_and_grads(lambda: gm(input_ids=ids), model)
    _rewritten_close(got, expected)
    assert got_grads.keys() == expected_grads.keys()
    for name, grad in expected_grads.items():
        _rewritten_close(got_grads[name], grad, msg=name)


def test_public_pass_rewrites_a_torch_export_graph() -> None:
    """``rewrite_causal_attention`` on a graph from ``torch.export`` directly (not through
    ``trace``): every attention becomes plain causal, and the logits do not change."""
    torch.manual_seed(0)
    model = IdsOnly(gpt2(dropout=0.0).lm)
    ids = token_inputs(2, 16)["input_ids"]
    gm = torch.export.export(model, (), {"input_ids": ids}, strict=False).module()
    expected = gm(input_ids=ids)
    assert not any(_is_plain_causal(n) for n in _attention_nodes(gm))
    names = rewrite_causal_attention(gm, model)
    attention = _attention_nodes(gm)
    assert len(names) == len(attention) == 2
    assert all(_is_plain_causal(n) for n in attention)
    _rewritten_close(gm(input_ids=ids), expected)


def test_rewrite_can_be_turned_off() -> None:
    model = IdsOnly(gpt2(dropout=0.0).lm)
    ids = token_inputs(2, 8)["input_ids"]
    traced = trace(
        model, {"input_ids": ids}, dtype=torch.float32, target_device="cpu", causal_attention=False
    )
    assert traced.causal_attention == ()
    assert all(isinstance(n.args[3], fx.Node) for n in _attention_nodes(traced.graph_module))


def test_mask_computed_from_an_input_is_left_alone() -> None:
    """An attention_mask input (even all ones) makes the mask input-dependent."""
    model = gpt2(dropout=0.0)
    traced = trace(model, token_inputs(2, 8), dtype=torch.float32, target_device="cpu")
    assert traced.causal_attention == ()
    attention = _attention_nodes(traced.graph_module)
    assert len(attention) == 2
    assert all(isinstance(n.args[3], fx.Node) for n in attention)


SEQ = 8


Device = torch.device | str


def _bool_causal(device: Device = "cpu") -> torch.Tensor:
    return torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).tril()


def _band(device: Device = "cpu") -> torch.Tensor:
    i = torch.arange(SEQ, device=device)
    return (i[:, None] - i[None, :]).abs() <= 2


def _strictly_lower(device: Device = "cpu") -> torch.Tensor:
    return torch.ones(SEQ, SEQ, dtype=torch.bool, device=device).tril(-1)


def _additive_inf(device: Device = "cpu") -> torch.Tensor:
    return torch.full((SEQ, SEQ), float("-inf"), device=device).triu(1)


def _additive_min(device: Device = "cpu") -> torch.Tensor:
    return torch.full((SEQ, SEQ), torch.finfo(torch.float32).min, device=device).triu(1)


def _additive_wrong_value(device: Device = "cpu") -> torch.Tensor:
    return torch.full((SEQ, SEQ), -1000.0, device=device).triu(1)


class MaskedAttention(nn.Module):
    """One attention layer with a hand-built mask: a buffer, or computed in forward."""

    def __init__(self, make_mask: Callable[[Device], torch.Tensor], *, as_buffer: bool) -> None:
        super().__init__()
        self.qkv = nn.Linear(16, 48)
        self.make_mask = make_mask
        self.as_buffer = as_buffer
        if as_buffer:
            self.register_buffer("mask", make_mask("cpu"), persistent=False)

    def forward(self, x: torch.Tensor, keys: torch.Tensor | None = None) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, 2, 8).permute(2, 0, 3, 1, 4)
        if keys is not None:  # cross attention: fewer keys than queries
            k, v = k[:, :, : keys.shape[1]], v[:, :, : keys.shape[1]]
        mask = self.mask if self.as_buffer else self.make_mask(x.device)
        mask = mask[: q.shape[2], : k.shape[2]]
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


MASKS = {
    "bool_causal": (_bool_causal, True),
    "additive_inf": (_additive_inf, True),
    "additive_finfo_min": (_additive_min, True),
    "band": (_band, False),
    "strictly_lower": (_strictly_lower, False),
    "additive_minus_1000": (_additive_wrong_value, False),
}


@pytest.mark.parametrize("as_buffer", [True, False], ids=["buffer", "in_forward"])
@pytest.mark.parametrize("mask_name", sorted(MASKS))
def test_only_the_exact_causal_pattern_is_rewritten(mask_name: str, as_buffer: bool) -> None:
    make_mask, causal = MASKS[mask_name]
    torch.manual_seed(0)
    model = MaskedAttention(make_mask, as_buffer=as_buffer)
    x = torch.randn(2, SEQ, 16)
    traced = trace(model, (x,), dtype=torch.float32, target_device="cpu")
    assert len(traced.causal_attention) == (1 if causal else 0)
    (node,) = _attention_nodes(traced.graph_module)
    assert _is_plain_causal(node) == causal
    gm = assign_real(traced.module_for("cpu"), model)
    expected = model(x)
    if not causal:
        # A wrong rewrite would change the output; the pass must not have touched it.
        torch.testing.assert_close(gm(x), expected, rtol=0, atol=0)
        return
    _rewritten_close(gm(x), expected)


def test_non_square_attention_is_left_alone() -> None:
    """``is_causal`` aligns the triangle top-left; only S_q == S_k is rewritten."""
    model = MaskedAttention(_bool_causal, as_buffer=True)
    x = torch.randn(2, SEQ, 16)
    keys = torch.randn(2, SEQ - 2, 16)
    traced = trace(model, (x, keys), dtype=torch.float32, target_device="cpu")
    assert traced.causal_attention == ()


def test_buffer_without_a_value_is_left_alone() -> None:
    """A model built on meta has no mask values to check at trace time."""
    with torch.device("meta"):
        model = MaskedAttention(_bool_causal, as_buffer=True)
    model.mask = torch.empty(SEQ, SEQ, dtype=torch.bool, device="meta")
    x = torch.empty(2, SEQ, 16, device="meta")
    traced = trace(model, (x,), dtype=torch.float16, target_device="cuda")
    assert traced.causal_attention == ()


# -- CUDA attention kernel model (on meta) ------------------------------------------------


class Attention(nn.Module):
    """Self attention with a configurable head dim and an optional constant band mask."""

    def __init__(self, heads: int, head_dim: int, *, masked: bool) -> None:
        super().__init__()
        self.heads, self.head_dim, self.masked = heads, head_dim, masked
        self.qkv = nn.Linear(heads * head_dim, 3 * heads * head_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4)
        if self.masked:
            i = torch.arange(s, device=x.device)
            # Not causal, so the pass leaves it: the kernel model sees an explicit mask.
            mask = (i[:, None] - i[None, :]).abs() <= 4
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


BATCH, HEADS, S = 2, 4, 256


def _sdpa_saved_bytes(head_dim: int, *, masked: bool, dtype: torch.dtype) -> int:
    with torch.device("meta"):
        model = Attention(HEADS, head_dim, masked=masked)
    x = torch.empty(BATCH, S, HEADS * head_dim, device="meta")
    traced: TracedModel = trace(model, (x,), dtype=dtype, target_device="cuda")
    (cost,) = [c for c in traced.op_costs if c.name.startswith("scaled_dot_product_attention")]
    return cost.saved_bytes


def test_masked_attention_with_aligned_head_dim_saves_fused_kernel_bytes() -> None:
    """Head dim 64 with a mask: memory-efficient / cuDNN kernel, no S x S matrices."""
    d = 64
    qkv = 3 * BATCH * S * HEADS * d * 2  # one projection, fp16
    out = BATCH * HEADS * S * d * 2
    lse = BATCH * HEADS * S * 4
    bias = S * S * 2  # the boolean mask converted to fp16
    assert _sdpa_saved_bytes(d, masked=True, dtype=torch.float16) == qkv + out + lse + bias


def test_masked_attention_with_head_dim_50_takes_the_math_path() -> None:
    """No fused kernel takes a mask with head dim 50 in fp16 (alignment 8), so the model
    counts the math path's attention matrices: at least one fp32 B x H x S x S."""
    fused_like = 3 * BATCH * S * HEADS * 50 * 2 + BATCH * HEADS * S * 50 * 2
    saved = _sdpa_saved_bytes(50, masked=True, dtype=torch.float16)
    assert saved >= fused_like + BATCH * HEADS * S * S * 4


def test_fp32_alignment_is_4() -> None:
    """fp32 runs the memory-efficient kernel, which needs head dims divisible by 4."""
    matrix = BATCH * HEADS * S * S * 4
    assert _sdpa_saved_bytes(52, masked=True, dtype=torch.float32) < matrix
    assert _sdpa_saved_bytes(50, masked=True, dtype=torch.float32) >= matrix


def test_causal_attention_with_head_dim_50_saves_flash_padded_bytes() -> None:
    """Flash pads the head dim to 56 and keeps the padded q/k/v copies and output."""
    padded = BATCH * HEADS * S * 56 * 2
    lse = BATCH * HEADS * S * 4
    assert _sdpa_saved_bytes(50, masked=False, dtype=torch.float16) == 4 * padded + lse


def test_the_profile_marks_attention_operations() -> None:
    """``TracedModel.to_profile`` marks the fused attention operations (the solver prices
    them at ``HardwareProfile.attention_*_flop_per_s`` where known) and nothing else."""
    model = IdsOnly(gpt2(dropout=0.0).lm)
    ids = token_inputs(2, 16)["input_ids"]
    traced = trace(model, {"input_ids": ids}, dtype=torch.float32, target_device="cpu")
    profile = traced.to_profile()
    marked = [op.name for op in profile.operations if op.attention]
    assert marked == [n.name for n in _attention_nodes(traced.graph_module)]
    assert len(marked) == 2  # one per layer
    assert all(op.fwd_flop > 0 for op in profile.operations if op.attention)
