"""Models of kernels whose saved tensors on the target device differ from the meta run.

[Note: kernel models]
The cost run executes the graph on the meta device, where composite operations take their
reference decomposition. Two operations in transformer training keep far less for backward
on the real device than their decomposition does, so the cost run replaces them with a
stand-in autograd function that allocates (on meta) exactly what the real kernel allocates
and saves:

- ``aten.scaled_dot_product_attention`` on CUDA runs a fused kernel (cuDNN or flash for
  fp16/bf16, memory-efficient for fp32, as torch 2.11 dispatches them). It saves
  q, k and v (the caller's tensors, usually views of one projection), its output, a
  float32 log-sum-exp of B x H x S (the memory-efficient kernel pads S to a multiple of
  32) and, when a boolean mask is given, that mask converted to the compute dtype. The
  meta run takes the math path and keeps the B x H x S x S attention matrices instead
  (several times too many bytes at long sequences).
  Which kernel may run follows torch's dispatcher (``select_sdp_backend`` in
  ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``, torch 2.11):
  * flash (fp16/bf16, head dim <= 256) takes no explicit mask. ``attention.cpp`` pads q,
    k and v to a head dim that is a multiple of 8 (``pad_last_dim<8>``) before calling
    it, so for other head dims the saved q/k/v are padded copies and the output is a
    slice of a padded buffer;
  * memory-efficient needs head dims divisible by ``minimum_gemm_alignment``: 8 for
    fp16/bf16 and 4 for fp32 on sm80 and newer (``check_head_dim_size_mem_efficient``);
  * cuDNN needs fp16/bf16 and head dims divisible by 8 (``check_cudnn_tensor_shapes``).
  So with an explicit mask and a head dim off that alignment (GPT-2 XL: 50) no fused
  kernel applies and CUDA runs the math path; the model then lets the meta run take the
  math path too. That over-estimates a little: on CUDA the math path's inner dropout is
  ``native_dropout`` (a one-byte mask) where the meta decomposition keeps a noise tensor,
  and an over-estimate only makes the plan more careful. fp32 without a mask needs the
  same 4-alignment (flash and cuDNN are fp16/bf16 only).
  On the CPU the flash kernel is used when dropout is off (it saves the same set, with a
  B x H x S log-sum-exp); with dropout the CPU takes the math path, which the meta run
  reproduces exactly.
- ``aten.dropout`` on CUDA is ``native_dropout``, which keeps a one-byte boolean mask;
  the meta (and CPU) decomposition keeps a noise tensor in the input's dtype.

FLOPs of the fused attention follow ``torch.utils.flop_counter`` (two matmuls forward;
a score recomputation plus four matmuls backward; causal masking not discounted).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.autograd.function import FunctionCtx

aten = torch.ops.aten


class FlopSink(Protocol):
    """Where a stand-in kernel reports the FLOPs it stands for."""

    def add_flop(self, flop: int) -> None: ...


KernelModel = Callable[[tuple[Any, ...], dict[str, Any], FlopSink], Any]
"""Runs a stand-in for one graph operation, or returns ``NotImplemented`` to run it as is."""


def _attention_flop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[int, int]:
    """Forward and backward FLOPs of attention, as ``torch.utils.flop_counter`` counts them."""
    batch_heads = math.prod(q.shape[:-2])
    s_q, d_q = q.shape[-2], q.shape[-1]
    s_k, d_v = k.shape[-2], v.shape[-1]
    score = 2 * batch_heads * s_q * s_k * d_q
    weigh = 2 * batch_heads * s_q * s_k * d_v
    return score + weigh, score + 2 * weigh + 2 * score


class _FusedAttention(torch.autograd.Function):
    """Meta stand-in for a fused attention kernel: same outputs, same saved tensors."""

    @staticmethod
    def forward(
        ctx: FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        lse_len: int,
        pad_to: int,
        sink: FlopSink,
    ) -> torch.Tensor:
        # Fused kernels write the output as (batch, seq, heads, dim) and return it
        # transposed; a later `.transpose(1, 2).contiguous()` is then free.
        b, h, s_q = q.shape[0], q.shape[1], q.shape[2]
        q_dim, k_dim, d_v = q.shape[-1], k.shape[-1], v.shape[-1]
        padded_v = pad_to * math.ceil(d_v / pad_to)
        out_buf = q.new_empty((b, s_q, h, padded_v)).transpose(1, 2)
        out = out_buf[..., :d_v] if padded_v != d_v else out_buf
        if pad_to > 1 and (q.shape[-1] % pad_to or d_v % pad_to):
            # The kernel sees zero-padded copies; they, not the caller's q/k/v, are saved.
            q, k, v = (_padded(t, pad_to) for t in (q, k, v))
        lse = q.new_empty((*q.shape[:-2], lse_len), dtype=torch.float32)
        # FLOPs at the padded head dim: the kernel does that work, and torch's flop
        # counter sees the padded inputs of the flash op on CUDA too.
        fwd_flop, bwd_flop = _attention_flop(q, k, v)
        bias = mask
        if mask is not None and mask.dtype != q.dtype:
            # The kernel converts a boolean (or other-dtype) mask into an additive bias of
            # the compute dtype and keeps that copy for backward.
            bias = torch.empty(tuple(mask.shape), dtype=q.dtype, device=q.device)
        sink.add_flop(fwd_flop)
        ctx.sink = sink  # type: ignore[attr-defined]
        ctx.bwd_flop = bwd_flop  # type: ignore[attr-defined]
        ctx.dims = (q_dim, k_dim, d_v)  # type: ignore[attr-defined]
        ctx.save_for_backward(q, k, v, out_buf, lse, bias)  # type: ignore[arg-type]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, _out, _lse, bias = ctx.saved_tensors
        ctx.sink.add_flop(ctx.bwd_flop)
        need = ctx.needs_input_grad
        grad_mask = torch.empty_like(bias) if need[3] and bias is not None else None
        # Gradients come out at the kernel's (padded) head dim and are sliced back.
        grads = tuple(
            torch.empty_like(t)[..., :dim] if need[i] else None
            for i, (t, dim) in enumerate(zip((q, k, v), ctx.dims, strict=True))
        )
        return (*grads, grad_mask, None, None, None)


def _padded(t: torch.Tensor, multiple: int) -> torch.Tensor:
    """A new tensor like ``t`` with its last dimension rounded up to ``multiple``."""
    dim = multiple * math.ceil(t.shape[-1] / multiple)
    return t.new_empty((*t.shape[:-1], dim))


class _FusedDropout(torch.autograd.Function):
    """Meta stand-in for CUDA ``native_dropout``: keeps a one-byte mask for backward."""

    @staticmethod
    def forward(ctx: FunctionCtx, x: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(x)
        mask = torch.empty(tuple(x.shape), dtype=torch.bool, device=x.device)
        ctx.save_for_backward(mask)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(grad_out)


def _arg(args: tuple[Any, ...], kwargs: dict[str, Any], index: int, name: str, default: Any) -> Any:
    if len(args) > index:
        return args[index]
    return kwargs.get(name, default)


def _sdpa(
    args: tuple[Any, ...], kwargs: dict[str, Any], sink: FlopSink, *, device_type: str
) -> Any:
    q, k, v = args[0], args[1], args[2]
    mask = _arg(args, kwargs, 3, "attn_mask", None)
    dropout_p = float(_arg(args, kwargs, 4, "dropout_p", 0.0))
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return NotImplemented
    if q.shape[-1] != k.shape[-1]:
        return NotImplemented
    s_q = q.shape[-2]
    pad_to = 1
    if mask is not None and not isinstance(mask, torch.Tensor):
        return NotImplemented
    if device_type == "cuda":
        # Kernel eligibility as in the note: flash (no mask, fp16/bf16, pads the head dim
        # to 8), memory-efficient / cuDNN (head dims aligned to 8, fp32: 4), else math.
        d_q, d_v = q.shape[-1], v.shape[-1]
        if q.dtype in (torch.float16, torch.bfloat16):
            lse_len = s_q
            aligned = d_q % 8 == 0 and d_v % 8 == 0
            is_causal = bool(_arg(args, kwargs, 5, "is_causal", False))
            flash = mask is None and d_q == d_v and d_q <= 256
            if flash and not (is_causal and s_q != k.shape[-2]):
                pad_to = 8
            elif not aligned:
                return NotImplemented
        elif q.dtype == torch.float32:
            lse_len = 32 * math.ceil(s_q / 32)  # memory-efficient kernel pads to 32
            if d_q % 4 or d_v % 4:
                return NotImplemented
        else:
            return NotImplemented
    elif device_type == "cpu":
        # The CPU flash kernel refuses dropout; the math path then runs, as on meta.
        if dropout_p > 0.0 or q.shape[-1] != v.shape[-1]:
            return NotImplemented
        if q.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            return NotImplemented
        lse_len = s_q
    else:
        return NotImplemented
    return _FusedAttention.apply(q, k, v, mask, lse_len, pad_to, sink)  # type: ignore[no-untyped-call]


def _dropout(args: tuple[Any, ...], kwargs: dict[str, Any], sink: FlopSink) -> Any:
    x = args[0]
    p = float(_arg(args, kwargs, 1, "p", 0.5))
    train = bool(_arg(args, kwargs, 2, "train", True))
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        return NotImplemented
    if not train or not 0.0 < p < 1.0 or x.numel() == 0:
        return NotImplemented
    return _FusedDropout.apply(x)  # type: ignore[no-untyped-call]


def kernel_models(device_type: str) -> dict[Any, KernelModel]:
    """The stand-ins that apply when training runs on ``device_type`` (see the note)."""
    if device_type == "cuda":
        return {
            aten.scaled_dot_product_attention.default: lambda a, kw, s: _sdpa(
                a, kw, s, device_type="cuda"
            ),
            aten.dropout.default: _dropout,
        }
    if device_type == "cpu":
        return {
            aten.scaled_dot_product_attention.default: lambda a, kw, s: _sdpa(
                a, kw, s, device_type="cpu"
            ),
        }
    return {}
