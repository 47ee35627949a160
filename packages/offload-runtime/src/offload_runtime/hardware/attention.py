"""Fused attention's rates at a model's own shapes: measured on the training GPU and kept
in the shape file of its hardware profile (``HardwareProfile.attention_fwd_flop_per_s``
and ``attention_bwd_flop_per_s``; see [Note: hardware cache]), so that every plan of one
model on one machine prices attention alike. Fused attention runs well under the matrix
products' rate, so pricing it at that rate would predict steps shorter than they run
(measured: BENCHMARKS.md, "Decisions")."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from offload_runtime.hardware.probes import measure_attention_flop_per_s
from offload_solver import HardwareProfile


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
    "measure_attention_at",
    "with_attention_rates",
]
