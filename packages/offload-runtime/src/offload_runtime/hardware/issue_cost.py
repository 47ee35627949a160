"""The host-side cost of issuing one operation of a traced training graph.

A launch-bound plan's step scales with it: the simulator charges ``op_overhead_s`` to
every traced operation once in forward and once in backward.
"""

from __future__ import annotations

import statistics
import time

import torch

from offload_runtime.attr_reads import flatten_attribute_reads

__all__ = ["ISSUE_COST_HIDDEN", "measure_op_overhead_s"]

ISSUE_COST_HIDDEN = 64
"""Hidden size of the per-operation issue-cost graph: small enough that no kernel of it
takes longer to run than to issue."""


class _IssueCostBlocks(torch.nn.Module):
    """Tiny GPT-2 blocks written as the operations a traced GPT-2 graph runs, per block:
    layer norm, ``view``/``addmm``/``view`` projections, ``split`` and three ``getitem``,
    head ``view``/``transpose``, causal scaled-dot-product attention, ``transpose``/
    ``contiguous``/``reshape``, dropout, residual adds and the tanh GELU decomposed into
    element-wise ops. Shapes are tiny so that issuing, not computing, is what is timed.
    """

    def __init__(self, layers: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = ISSUE_COST_HIDDEN
        self.hidden = hidden
        self.heads = 4

        def weight(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(0.02 * torch.randn(*shape, device=device, dtype=dtype))

        self.ln_w = torch.nn.ParameterList([weight(hidden) for _ in range(2 * layers)])
        self.ln_b = torch.nn.ParameterList([weight(hidden) for _ in range(2 * layers)])
        # (in, out) features of each block's four projections; plain ints, so that tracing
        # records no shape arithmetic.
        self.dims = [
            (hidden, 3 * hidden),
            (hidden, hidden),
            (hidden, 4 * hidden),
            (4 * hidden, hidden),
        ]
        self.mm_w = torch.nn.ParameterList([weight(*d) for _ in range(layers) for d in self.dims])
        self.mm_b = torch.nn.ParameterList([weight(d[1]) for _ in range(layers) for d in self.dims])
        self.layers = layers

    def _proj(self, x: torch.Tensor, i: int, batch: int, seq: int) -> torch.Tensor:
        fan_in, fan_out = self.dims[i % 4]
        return torch.addmm(self.mm_b[i], x.view(-1, fan_in), self.mm_w[i]).view(batch, seq, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, c = 2, 8, self.hidden
        heads, d = self.heads, self.hidden // self.heads
        for layer in range(self.layers):
            ln, mm = 2 * layer, 4 * layer
            h = torch.nn.functional.layer_norm(x, (c,), self.ln_w[ln], self.ln_b[ln])
            parts = torch.split(self._proj(h, mm, batch, seq), c, dim=2)
            q = parts[0].view(batch, seq, heads, d).transpose(1, 2)
            k = parts[1].view(batch, seq, heads, d).transpose(1, 2)
            v = parts[2].view(batch, seq, heads, d).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).contiguous().reshape(batch, seq, c)
            a = self._proj(a, mm + 1, batch, seq)
            x = x + torch.nn.functional.dropout(a, 0.1, training=True)
            h = torch.nn.functional.layer_norm(x, (c,), self.ln_w[ln + 1], self.ln_b[ln + 1])
            h = self._proj(h, mm + 2, batch, seq)
            h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
            h = self._proj(h, mm + 3, batch, seq)
            x = x + torch.nn.functional.dropout(h, 0.1, training=True)
        return x.float().sum()  # the loss, as a traced training graph ends


def issue_cost_graph(
    layers: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.fx.GraphModule, int]:
    """The traced :class:`_IssueCostBlocks` and its number of operations (``call_*`` nodes:
    per block, the operations ``offload_trace`` records for the same code)."""
    graph = torch.fx.symbolic_trace(_IssueCostBlocks(layers, dtype, device))
    flatten_attribute_reads(graph)  # as the runtime reads its graphs' parameters
    num_ops = sum(
        node.op in ("call_function", "call_method", "call_module") for node in graph.graph.nodes
    )
    return graph, num_ops


def measure_op_overhead_s(
    device: torch.device | str = "cpu",
    *,
    layers: int = 4,
    reps: int = 10,
    dtype: torch.dtype | None = None,
) -> float:
    """Seconds per operation per pass of a tiny GPT-2-like graph, forward and backward.

    The graph is ``layers`` blocks of :class:`_IssueCostBlocks` (linear layers with bias,
    layer norm, split, views and transposes, causal attention, dropout, residual adds, the
    decomposed tanh GELU), traced with ``torch.fx`` and run as a ``GraphModule``, which is
    how the offload runtime runs a model, reading its parameters as the runtime does
    (:func:`~offload_runtime.attr_reads.flatten_attribute_reads`). Its tensors are tiny,
    so one step's time is what issuing the operations costs: Python, dispatcher, autograd
    recording and the backward nodes, kernel launches (views launch none). The result is
    the median wall time of a forward plus backward over twice the graph's operation
    count (its ``call_*`` nodes): the simulator charges ``op_overhead_s`` to every traced
    operation once in forward and once in backward, so that is the per-charge cost a
    graph of this mix needs. ``dtype`` defaults to float16 on CUDA and float32 on the
    CPU.
    """
    if layers < 1 or reps < 1:
        raise ValueError(f"layers ({layers}) and reps ({reps}) must be >= 1")
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    graph, num_ops = issue_cost_graph(layers, dtype, dev)
    x = torch.randn(2, 8, ISSUE_COST_HIDDEN, device=dev, dtype=dtype)
    params = list(graph.parameters())

    def step() -> float:
        for p in params:
            p.grad = None
        started = time.perf_counter()
        graph(x).backward()
        if dev.type == "cuda":
            # Sync point: the time must include kernels the host has issued but not run.
            torch.cuda.synchronize(dev)
        return time.perf_counter() - started

    for _ in range(2):
        step()  # first calls allocate and pick kernels
    seconds = statistics.median(step() for _ in range(reps))
    return seconds / (2 * num_ops)
