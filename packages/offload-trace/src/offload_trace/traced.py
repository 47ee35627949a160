"""The result of tracing: the graph, the name maps, the costs, and the solver's profile."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

from offload_solver import ModelProfile, Operation, Parameter
from offload_trace._causal import apply_causal_attention
from offload_trace._costs import CALL_OPS, OpCost
from offload_trace._gelu import apply_tanh_gelu
from offload_trace._opaque import META_KEY as OPAQUE_META_KEY
from offload_trace._opaque import OpaqueEntry
from offload_trace._rewrite import move_device_constants, to_eval, widen_integer_histc

_aten = torch.ops.aten
ATTENTION_OPS = frozenset(
    getattr(_aten, name).default
    for name in (
        "scaled_dot_product_attention",
        "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_efficient_attention",
        "_scaled_dot_product_cudnn_attention",
    )
    if hasattr(_aten, name)
)
"""Graph targets of fused attention, whose operations the profile marks
``Operation.attention``."""

logger = logging.getLogger(__name__)


def device_state_bytes_per_param(dtype: torch.dtype) -> int:
    """Device bytes per parameter element of master weights, Adam moments and gradient.

    Mixed precision (element size < 4) keeps an fp32 master (4), fp32 moments (8) and an
    fp32 gradient accumulator (4); fp32 training needs no separate master (8 + 4); wider
    dtypes keep moments and gradient in their own precision.
    """
    size = dtype.itemsize
    if size < 4:
        return 16
    if size == 4:
        return 12
    return 3 * size


@dataclass(frozen=True, eq=False)
class TracedModel:
    """A model traced on the meta device, with per-operation costs.

    The runtime rewrites :meth:`module_for`'s graph; the solver reads :meth:`to_profile`.
    Operation ``i`` of the profile is graph node ``operation_names[i]``.
    """

    exported: torch.export.ExportedProgram
    """The program as ``torch.export`` produced it (meta state)."""
    graph_module: fx.GraphModule
    """``exported.module()``: unlifted, parameters as ``get_attr`` nodes, on meta."""
    param_names: Mapping[str, str]
    """``get_attr`` target of every parameter in the graph -> original parameter name (as
    listed by ``model.named_parameters(remove_duplicate=False)``)."""
    buffer_names: tuple[str, ...]
    """Original buffer names (``remove_duplicate=False``); the runtime assigns real buffers
    along these names, in the traced dtype (floating buffers are cast to ``dtype``)."""
    tied_groups: tuple[tuple[str, ...], ...]
    """Original parameter names grouped by tensor identity; the member the graph uses
    first comes first."""
    dtype: torch.dtype
    """Training dtype the model was traced (and costed) in."""
    target_device: torch.device
    """Device type whose kernels the costs describe."""
    operation_names: tuple[str, ...]
    """Names of the graph's call_function / call_method / call_module nodes, in
    execution order; every one is an operation of the profile."""
    op_costs: tuple[OpCost, ...]
    """Measured costs, one per entry of ``operation_names``."""
    op_param_names: tuple[tuple[str, ...], ...]
    """Original names of the parameters each operation reads directly."""
    parameters: tuple[Parameter, ...]
    """Every original parameter (``remove_duplicate=False``, model order) with its size in
    the training dtype; tied names are each listed with the shared size."""
    model_name: str
    """Class name of the traced model (default profile name)."""
    valueless_constants: tuple[str, ...] = ()
    """Lifted tensor constants created on the meta device during tracing; they have no
    values, so :meth:`module_for` refuses to build a runnable module while any exist."""
    causal_attention: tuple[str, ...] = ()
    """Attention nodes whose constant causal mask was replaced by ``is_causal=True`` (see
    [Note: causal attention] in ``_causal.py``); :meth:`module_for` applies the same
    rewrite."""
    fused_gelu: tuple[str, ...] = ()
    """Output nodes (names before the rewrite) of written-out tanh GELUs replaced by one
    ``aten.gelu(approximate="tanh")`` each (``trace(fuse_gelu=True)``, see [Note: fused
    tanh GELU] in ``_gelu.py``); :meth:`module_for` applies the same rewrite."""
    opaque_modules: tuple[str, ...] = ()
    """Paths of the modules ``torch.export`` could not capture, each run as one opaque
    operation whose backward recomputes its forward (see [Note: opaque operations] in
    ``_opaque.py``)."""
    opaque_entries: tuple[OpaqueEntry, ...] = ()
    """What those operations run (one per module and call signature); held here and by
    every graph :meth:`module_for` returns, which keeps them registered."""

    @property
    def forward_peak_bytes(self) -> int:
        """Predicted activation bytes at the forward peak (parameters excluded)."""
        return max((c.fwd_peak_bytes for c in self.op_costs), default=0)

    @property
    def backward_peak_bytes(self) -> int:
        """Predicted activation and gradient bytes at the backward peak (parameters and
        parameter gradients excluded)."""
        return max((c.bwd_peak_bytes for c in self.op_costs), default=0)

    @property
    def saved_bytes(self) -> int:
        """Bytes kept from forward to backward, storages counted once."""
        return sum(c.saved_bytes for c in self.op_costs)

    @property
    def fwd_flop(self) -> int:
        return sum(c.fwd_flop for c in self.op_costs)

    @property
    def bwd_flop(self) -> int:
        return sum(c.bwd_flop for c in self.op_costs)

    def to_profile(self, name: str | None = None) -> ModelProfile:
        """The solver's view of the model: parameters, costed operations, tied groups.

        Args:
            name: profile name; defaults to the model's class name.
        """
        attention = {
            n.name
            for n in self.graph_module.graph.nodes
            if n.op == "call_function" and n.target in ATTENTION_OPS
        }
        # Operations that write in place into an input (a mutable ATen schema): their
        # regions are never recomputed (``offload_solver.Operation.mutates``).
        mutating = {
            n.name
            for n in self.graph_module.graph.nodes
            if n.op == "call_function"
            and getattr(n.target, "_schema", None) is not None
            and n.target._schema.is_mutable
        }
        operations = tuple(
            Operation(
                name=c.name,
                param_names=pnames,
                fwd_out_bytes=c.fwd_out_bytes,
                fwd_tmp_bytes=c.fwd_tmp_bytes,
                saved_bytes=c.saved_bytes,
                bwd_tmp_bytes=c.bwd_tmp_bytes,
                bwd_out_bytes=c.bwd_out_bytes,
                fwd_flop=c.fwd_flop,
                bwd_flop=c.bwd_flop,
                attention=c.name in attention,
                mutates=c.name in mutating,
                out_storage_bytes=c.out_storage_bytes,
                reads=c.reads,
            )
            for c, pnames in zip(self.op_costs, self.op_param_names, strict=True)
        )
        return ModelProfile(
            name=name if name is not None else self.model_name,
            parameters=self.parameters,
            operations=operations,
            tied_groups=self.tied_groups,
            device_state_bytes_per_param=device_state_bytes_per_param(self.dtype),
            host_grad_bytes_per_param=self.dtype.itemsize,
        )

    def module_for(self, device: torch.device | str, *, training: bool = True) -> fx.GraphModule:
        """A fresh graph module that runs on ``device``.

        Node names equal :attr:`operation_names` (plus placeholders, ``get_attr`` and
        output nodes); attention listed in :attr:`causal_attention` and GELUs listed in
        :attr:`fused_gelu` are rewritten as in :func:`~offload_trace.trace`. Device
        constants baked in at trace time (``arange(device=meta)``, ``.to(meta)``,
        metadata asserts) point at ``device``; lifted tensor constants are moved there.
        On the CPU, ``histc`` nodes of integer tensors (a branch taken for the meta device,
        which the CPU has no kernel for) count in float64 instead. Opaque operations
        (:attr:`opaque_modules`) run their module's own code on ``device``.
        Parameters and buffers stay meta placeholders: assign real tensors with
        ``setattr`` along the original names (both names of a tied group). Call it with
        the same argument structure as the example inputs.

        Args:
            device: where the module will run.
            training: ``False`` flips dropout, batch norm and attention dropout to eval
                behaviour by rewriting their arguments, and runs opaque modules in eval
                mode.

        Raises:
            ValueError: ``device`` is not a valid device or is ``meta``.
            RuntimeError: the trace holds tensor constants without values (created on the
                meta device inside ``forward``).
        """
        try:
            dev = torch.device(device)
        except (RuntimeError, TypeError) as exc:
            raise ValueError(
                f"module_for: device {device!r} is not a torch device; pass e.g. 'cuda' or 'cpu'"
            ) from exc
        if dev.type == "meta":
            raise ValueError(
                "module_for: device 'meta' is where the trace already lives; use "
                "graph_module, or pass the device you will run on"
            )
        if self.valueless_constants:
            raise RuntimeError(
                "module_for: the model creates tensor constants inside forward on the "
                "device of its inputs, so tracing on meta left them without values: "
                f"{', '.join(self.valueless_constants)}. Register them as buffers "
                "(self.register_buffer(name, tensor, persistent=False)) and trace again"
            )
        gm = self.exported.module()
        # The opaque operations' entries live as long as a graph that calls them.
        gm.meta[OPAQUE_META_KEY] = self.opaque_entries
        apply_causal_attention(gm, self.causal_attention)
        apply_tanh_gelu(gm, self.fused_gelu)
        names = tuple(n.name for n in gm.graph.nodes if n.op in CALL_OPS)
        if names != self.operation_names:
            raise RuntimeError(
                "module_for: torch.export produced different node names on a second "
                "unlift; this torch version is not supported by offload-trace"
            )
        moved = flipped = widened = 0
        # Regions such as `with torch.no_grad():` are exported as higher-order ops whose
        # bodies are nested graph modules: rewrite every graph, not only the top one.
        graphs = [m for m in gm.modules() if isinstance(m, fx.GraphModule)]
        for graph_module in graphs:
            moved += move_device_constants(graph_module, dev)
            widened += widen_integer_histc(graph_module, dev)
            flipped += 0 if training else to_eval(graph_module)
        for target in _lifted_constants(self):
            value = _get_attr(gm, target)
            if isinstance(value, torch.Tensor):
                _set_attr(gm, target, value.to(dev))
        for graph_module in graphs:
            graph_module.recompile()
        logger.info(
            "module_for(%s, training=%s): %d device constants moved, %d nodes set to eval, "
            "%d integer histc nodes widened",
            dev,
            training,
            moved,
            flipped,
            widened,
        )
        return gm


def _lifted_constants(traced: TracedModel) -> list[str]:
    buffers = set(traced.buffer_names)
    return [
        name
        for name, value in traced.exported.constants.items()
        if isinstance(value, torch.Tensor) and name not in buffers
    ]


def _get_attr(root: torch.nn.Module, target: str) -> Any:
    obj: Any = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _set_attr(root: torch.nn.Module, target: str, value: torch.Tensor) -> None:
    *path, last = target.split(".")
    parent: Any = root
    for part in path:
        parent = getattr(parent, part)
    setattr(parent, last, value)
