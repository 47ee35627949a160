"""Rewrites that turn the meta-traced graph module into one that runs on a real device."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import fx

from offload_trace._opaque import OPAQUE_OP

logger = logging.getLogger(__name__)

aten = torch.ops.aten

# Operations that behave differently in training; value: (position, keyword) of the flag
# (or probability) and the value it takes in eval.
_EVAL_FLAGS: dict[Any, tuple[int, str, bool | float]] = {
    aten.dropout.default: (2, "train", False),
    aten.feature_dropout.default: (2, "train", False),
    aten.alpha_dropout.default: (2, "train", False),
    aten.feature_alpha_dropout.default: (2, "train", False),
    aten.native_dropout.default: (2, "train", False),
    aten.batch_norm.default: (5, "training", False),
    aten._native_batch_norm_legit.default: (5, "training", False),
    aten._native_batch_norm_legit_functional.default: (5, "training", False),
    aten.rrelu.default: (3, "training", False),
    aten.rrelu_with_noise.default: (4, "training", False),
    aten.scaled_dot_product_attention.default: (4, "dropout_p", 0.0),
    OPAQUE_OP: (1, "training", False),
}


def _set_arg(node: fx.Node, position: int, keyword: str, value: bool | float) -> bool:
    if keyword in node.kwargs:
        node.kwargs = {**node.kwargs, keyword: value}
        return True
    if len(node.args) > position:
        args = list(node.args)
        args[position] = value
        node.args = tuple(args)
        return True
    if keyword in ("train", "training"):
        # Schema default is training mode for these ops; make it explicit.
        node.kwargs = {**node.kwargs, keyword: value}
        return True
    return False  # e.g. sdpa without dropout_p: already no dropout


def to_eval(gm: fx.GraphModule) -> int:
    """Flip dropout-like and batch-norm nodes to eval behaviour; returns how many changed.

    ``ExportedProgram.module().eval()`` raises, so eval is done by rewriting arguments.
    """
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        flag = _EVAL_FLAGS.get(node.target)
        if flag is not None and _set_arg(node, *flag):
            changed += 1
    return changed


def move_device_constants(gm: fx.GraphModule, device: torch.device) -> int:
    """Point every ``device=meta`` baked into node arguments at ``device``.

    Covers factory kwargs (``arange(device=meta)``), ``aten.to.device``'s positional device
    and ``_assert_tensor_metadata``'s device check. Returns how many nodes changed.
    """

    hits = 0

    def swap(value: Any) -> Any:
        nonlocal hits
        if isinstance(value, torch.device) and value.type == "meta":
            hits += 1
            return device
        if isinstance(value, str) and value == "meta":
            hits += 1
            return str(device)
        return value

    changed = 0
    for node in gm.graph.nodes:
        if node.op not in ("call_function", "call_method"):
            continue
        before = hits
        new_args = fx.node.map_aggregate(node.args, swap)
        new_kwargs = fx.node.map_aggregate(node.kwargs, swap)
        if hits != before:
            node.args = new_args
            node.kwargs = new_kwargs
            changed += 1
    return changed


def _histc_through_float64(
    input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0
) -> torch.Tensor:
    """``aten.histc`` of an integer tensor on the CPU, which has no integer kernel: counted
    in float64 (exact for every int32, and int64 up to 2**53) and cast back, so the result
    has the dtype and values the integer kernel (CUDA's) gives."""
    counts: torch.Tensor = torch.histc(input.to(torch.float64), bins, min, max)
    return counts.to(input.dtype)


def widen_integer_histc(gm: fx.GraphModule, device: torch.device) -> int:
    """On the CPU, run ``aten.histc`` nodes with an integer input through float64.

    Python code that branches on its tensors' device type sees ``meta`` while tracing,
    so it takes the non-CPU branch; Hugging Face's grouped-matmul experts (the default
    for Mixtral, Qwen2-MoE, OLMoE, ...) then call ``histc`` on an ``int32`` tensor, which
    CUDA counts but the CPU rejects (``"histogram_cpu" not implemented for 'Int'``). The
    node keeps its name (operation names index the plan's regions); only its target
    changes. Returns how many nodes changed.
    """
    if device.type != "cpu":
        return 0
    changed = 0
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not aten.histc.default:
            continue
        source = node.args[0] if node.args else node.kwargs.get("input")
        val = source.meta.get("val") if isinstance(source, fx.Node) else None
        if isinstance(val, torch.Tensor) and not val.is_floating_point():
            node.target = _histc_through_float64
            changed += 1
    return changed
