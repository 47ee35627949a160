"""Fused attention's rates at the traced model's own shapes, which the planner measures on
the training GPU and plans with (``HardwareProfile.attention_fwd_flop_per_s`` and
``attention_bwd_flop_per_s``): fused attention runs well under the matrix products' rate,
so pricing it at that rate would predict steps shorter than they run (measured:
BENCHMARKS.md, "Decisions")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch
from torch import fx

from offload_runtime.hardware import measure_attention_flop_per_s
from offload_solver import HardwareProfile
from offload_trace.traced import ATTENTION_OPS


@dataclasses.dataclass(frozen=True)
class AttentionShape:
    """One fused attention call of a traced graph: its query's ``[batch, heads, seq,
    head_dim]`` and its dropout probability, and how many calls have them."""

    batch: int
    heads: int
    seq: int
    head_dim: int
    dropout_p: float
    calls: int = 1


AttentionMeasure = Callable[[AttentionShape], tuple[float, float]]
"""Measures causal fused attention at one shape: (forward, backward) FLOP/s."""


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


def measure_attention_at(
    device: torch.device | str,
    shape: AttentionShape,
    *,
    dtype: torch.dtype | None = None,
    reps: int = 5,
) -> tuple[float, float]:
    """:func:`offload_runtime.hardware.measure_attention_flop_per_s` at ``shape``:
    (forward, backward) FLOP/s on ``device``."""
    return measure_attention_flop_per_s(
        device,
        batch=shape.batch,
        heads=shape.heads,
        seq=shape.seq,
        head_dim=shape.head_dim,
        dtype=dtype,
        dropout_p=shape.dropout_p,
        reps=reps,
    )


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


def with_attention_rates(
    hardware: HardwareProfile, shapes: list[AttentionShape], measure: AttentionMeasure
) -> HardwareProfile:
    """``hardware`` with fused attention's rates (``attention_fwd_flop_per_s`` /
    ``attention_bwd_flop_per_s``) measured by ``measure`` at ``shapes``: the whole
    model's attention FLOPs over the time they take, each shape weighted by its calls and
    FLOPs (``torch.utils.flop_counter``'s count, which is the trace's for these operations
    and which ``measure_attention_flop_per_s`` divides by the time). Unchanged when there
    is no attention call."""
    from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

    if not shapes:
        return hardware
    fwd_flop = bwd_flop = fwd_s = bwd_s = 0.0
    for shape in shapes:
        dims = (shape.batch, shape.heads, shape.seq, shape.head_dim)
        f = shape.calls * float(sdpa_flop_count(dims, dims, dims))  # type: ignore[no-untyped-call]
        b = shape.calls * float(sdpa_backward_flop_count(dims, dims, dims, dims))  # type: ignore[no-untyped-call]
        fwd_rate, bwd_rate = measure(shape)
        if fwd_rate <= 0 or bwd_rate <= 0:
            raise ValueError(
                f"attention rates must be > 0 FLOP/s, measured {fwd_rate} and {bwd_rate} at {shape}"
            )
        fwd_flop, bwd_flop = fwd_flop + f, bwd_flop + b
        fwd_s, bwd_s = fwd_s + f / fwd_rate, bwd_s + b / bwd_rate
    return dataclasses.replace(
        hardware,
        attention_fwd_flop_per_s=fwd_flop / fwd_s,
        attention_bwd_flop_per_s=bwd_flop / bwd_s,
    )


__all__ = [
    "AttentionMeasure",
    "AttentionShape",
    "attention_shapes",
    "measure_attention_at",
    "measures_attention",
    "with_attention_rates",
]
