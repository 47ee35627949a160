"""The traced model's fused attention calls (their shapes), and whether the planner prices
them at rates measured on the training GPU (``offload_runtime.hardware.attention``)."""

from __future__ import annotations

import torch
from torch import fx

from offload_runtime.hardware.attention import AttentionShape
from offload_solver import HardwareProfile
from offload_trace.traced import ATTENTION_OPS


def measures_attention(
    measure_attention: bool | None, device: torch.device, hardware: HardwareProfile | None
) -> bool:
    """Whether the planner measures fused attention on ``device`` for its plan: as
    ``measure_attention`` says (``PlanForce.measure_attention``), or, where it is None, on
    a CUDA device unless ``hardware`` (the profile given, if any) already has both
    attention rates. True on a device other than CUDA is a ValueError: the rates are the
    training GPU's."""
    if measure_attention is None:
        return device.type == "cuda" and not (
            hardware is not None
            and hardware.attention_fwd_flop_per_s > 0
            and hardware.attention_bwd_flop_per_s > 0
        )
    if measure_attention and device.type != "cuda":
        raise ValueError(
            f"PlanForce(measure_attention=True) measures fused attention on the GPU that "
            f"trains the model, and the device is {device}: leave it False on the CPU"
        )
    return measure_attention


def _dropout_of(node: fx.Node) -> float:
    """A fused attention node's dropout probability: ``dropout_p`` by keyword, else the
    position each op's schema gives it (``aten.scaled_dot_product_attention``: 4th
    argument after the mask; the flash / efficient / cudnn variants: right after the
    value, or after their bias)."""
    given = node.kwargs.get("dropout_p")
    if isinstance(given, float | int) and not isinstance(given, bool):
        return float(given)
    aten = torch.ops.aten
    index = 4 if node.target is aten.scaled_dot_product_attention.default else 3
    for arg in node.args[index:]:  # the first number after the tensors
        if isinstance(arg, float | int) and not isinstance(arg, bool):
            return float(arg)
    return 0.0


def attention_shapes(gm: fx.GraphModule) -> list[AttentionShape]:
    """The distinct shapes of the fused attention calls in a traced graph, in graph order,
    each with its number of calls (the example zoo's GPT-2 XL: one shape, 48 calls)."""
    counts: dict[tuple[int, int, int, int, float], int] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in ATTENTION_OPS or not node.args:
            continue
        query = node.args[0].meta.get("val") if isinstance(node.args[0], fx.Node) else None
        if not isinstance(query, torch.Tensor) or query.dim() != 4:
            continue
        b, h, sq, d = (int(x) for x in query.shape)
        key = (b, h, sq, d, _dropout_of(node))
        counts[key] = counts.get(key, 0) + 1
    return [AttentionShape(*key, calls=n) for key, n in counts.items()]


__all__ = ["attention_shapes", "measures_attention"]
