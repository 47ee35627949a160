"""``trace``: from a model and example inputs to a costed :class:`TracedModel`."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Mapping
from typing import Any

import torch
from torch import fx, nn

from offload_solver import Parameter
from offload_trace._causal import apply_causal_attention, constant_lookup, find_causal_attention
from offload_trace._costs import CALL_OPS, measure_costs
from offload_trace._export import export_twin
from offload_trace._gelu import fuse_tanh_gelu
from offload_trace._inputs import check_example_inputs
from offload_trace._opaque import META_KEY as OPAQUE_META_KEY
from offload_trace._opaque import is_opaque, lookup
from offload_trace._twin import MetaTwin, build_meta_twin
from offload_trace.errors import TraceError
from offload_trace.traced import TracedModel

logger = logging.getLogger(__name__)


def _check_target(target_device: torch.device | str) -> torch.device:
    try:
        dev = torch.device(target_device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"target_device {target_device!r} is not a torch device; pass 'cuda' or 'cpu'"
        ) from exc
    if dev.type == "meta":
        raise ValueError(
            "target_device is 'meta'; pass the device training will run on ('cuda' or "
            "'cpu'): its kernels decide what is kept for backward"
        )
    return dev


def _device_allowed(target: torch.device, model_devices: set[torch.device]) -> set[torch.device]:
    allowed = {torch.device("cpu"), *model_devices}
    if target.type != "cpu":
        count = torch.cuda.device_count() if target.type == "cuda" else 0
        indices = [target.index] if target.index is not None else list(range(max(count, 1)))
        allowed |= {torch.device(target.type, i) for i in indices}
    return allowed


def trace(
    model: nn.Module,
    example_inputs: Mapping[str, torch.Tensor] | tuple[torch.Tensor, ...],
    *,
    dtype: torch.dtype = torch.float16,
    target_device: torch.device | str = "cuda",
    dynamic_batch: bool = False,
    causal_attention: bool = True,
    fuse_gelu: bool = False,
) -> TracedModel:
    """Trace ``model`` on the meta device and measure what each operation costs.

    The model may live on meta, the CPU or a GPU; it is never modified, and no real
    weights or activations are allocated: a meta twin in ``dtype`` is traced with
    ``torch.export`` (non-strict) in training mode, then run forward and backward on meta
    to measure bytes and FLOPs (see [Note: cost run] in ``_costs.py``). A module that
    export cannot capture (data-dependent Python such as layer drop, ``.item()``, an
    unsupported operation) runs as one opaque operation, recomputed in backward, and is
    named in :attr:`TracedModel.opaque_modules` (see [Note: opaque operations] in
    ``_opaque.py``).

    Args:
        model: the module to train.
        example_inputs: a dict of keyword tensors or a tuple of positional tensors, as
            ``model`` is called. Only shapes and dtypes are used; floating inputs are
            taken in ``dtype``.
        dtype: training dtype of parameters and floating buffers.
        target_device: device type whose kernels the costs describe (``"cuda"`` or
            ``"cpu"``).
        dynamic_batch: trace with a symbolic batch dimension (dimension 0 of every input);
            costs are still measured at the example batch size. Refused (TraceError)
            where a module would have to run as an opaque operation.
        causal_attention: rewrite attention whose mask is provably the constant causal
            mask into ``is_causal=True`` attention, as eager mode runs it (see
            [Note: causal attention] in ``_causal.py``). The returned graph, the costs and
            :meth:`TracedModel.module_for` all use the rewritten attention.
        fuse_gelu: replace each tanh GELU written out in element-wise operations (GPT-2's
            ``gelu_new``) by one ``aten.gelu(approximate="tanh")``: the same formula,
            seven fewer operations to issue in forward and in backward, and three fewer
            activations of the MLP's width saved per layer; results differ by rounding
            (see [Note: fused tanh GELU] in ``_gelu.py``). The graph, the costs and
            :meth:`TracedModel.module_for` all use the fused GELU. Default False.

    Raises:
        ValueError: a bad argument: ``model`` not a module, ``example_inputs`` of the
            wrong type or with a tensor on an unexpected device, a non-floating ``dtype``,
            an invalid ``target_device``.
        TraceError: the model could not be traced (export failed in the root module's
            own code, or a module to run opaquely cannot run on meta tensors); the
            message names the module and operation, the cause and what to try.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"model is a {type(model).__name__}; trace() needs a torch.nn.Module")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"dtype {dtype!r} is not a floating-point torch dtype; pass torch.float16, "
            "torch.bfloat16 or torch.float32"
        )
    target = _check_target(target_device)
    model_devices = {
        t.device for t in [*model.parameters(), *model.buffers()] if t.device.type != "meta"
    }
    inputs = check_example_inputs(
        example_inputs, dtype=dtype, allowed_devices=_device_allowed(target, model_devices)
    )
    name = type(model).__name__
    start = time.perf_counter()
    twin = build_meta_twin(model, dtype)
    ep, opaque = export_twin(
        twin.module, inputs.args, inputs.kwargs, model_name=name, dynamic_batch=dynamic_batch
    )
    exported_s = time.perf_counter() - start
    opaque_modules = tuple(dict.fromkeys(e.path for e in opaque))
    if opaque:
        labels = dict.fromkeys(e.label for e in opaque)
        logger.info(
            "%s: %d modules torch.export cannot capture run as opaque operations (forward "
            "recomputed in backward): %s",
            name,
            len(labels),
            ", ".join(labels),
        )
    gm = ep.module()
    gm.meta[OPAQUE_META_KEY] = opaque
    causal = rewrite_causal_attention(gm, model) if causal_attention else ()
    fused = rewrite_tanh_gelu(gm) if fuse_gelu else ()
    op_nodes = [n for n in gm.graph.nodes if n.op in CALL_OPS]
    param_names = _map_param_names(gm, twin)
    extra = {i: lookup(str(n.args[0])).cost for i, n in enumerate(op_nodes) if is_opaque(n)}
    try:
        costs = measure_costs(gm, inputs.args, inputs.kwargs, op_nodes, target.type, extra)
    except Exception as exc:
        raise TraceError(
            f"cannot cost {name}: running the traced graph on the meta device failed with "
            f"{type(exc).__name__}: {exc}. Try target_device='cpu' to rule out a kernel "
            "model, or report the operation named above"
        ) from exc
    op_params, first_use = _op_params(op_nodes, param_names)
    tied = tuple(
        tuple(sorted(group, key=lambda n: (first_use.get(n, math.inf), group.index(n))))
        for group in twin.identity_groups
    )
    buffers = set(twin.buffer_names)
    valueless = tuple(
        k
        for k, v in ep.constants.items()
        if isinstance(v, torch.Tensor) and v.device.type == "meta" and k not in buffers
    )
    traced = TracedModel(
        exported=ep,
        graph_module=gm,
        param_names=param_names,
        buffer_names=twin.buffer_names,
        tied_groups=tied,
        dtype=dtype,
        target_device=target,
        operation_names=tuple(n.name for n in op_nodes),
        op_costs=tuple(costs),
        op_param_names=op_params,
        parameters=tuple(
            Parameter(
                name=n,
                numel=twin.param_numel[n],
                size_bytes=twin.param_numel[n] * twin.param_dtype[n].itemsize,
                trainable=twin.param_trainable[n],
            )
            for n in twin.param_names
        ),
        model_name=name,
        valueless_constants=valueless,
        causal_attention=causal,
        fused_gelu=fused,
        opaque_modules=opaque_modules,
        opaque_entries=opaque,
    )
    logger.info(
        "traced %s: %d operations, %d parameters, %d tied groups; export %.1f s, total "
        "%.1f s; saved %.1f MiB, forward peak %.1f MiB, %.3g FLOP",
        name,
        len(op_nodes),
        len(twin.param_names),
        len(tied),
        exported_s,
        time.perf_counter() - start,
        traced.saved_bytes / 2**20,
        traced.forward_peak_bytes / 2**20,
        traced.fwd_flop + traced.bwd_flop,
    )
    return traced


def rewrite_causal_attention(gm: fx.GraphModule, model: nn.Module) -> tuple[str, ...]:
    """Rewrite ``gm``'s attention calls whose mask is provably the constant causal mask
    into ``is_causal=True`` attention, in place; the names of the rewritten nodes.

    ``gm`` is a graph of ``model`` (e.g. ``torch.export.export(model, ...).module()``):
    the mask's constants are read from ``model``'s buffers, wherever they live. :func:`trace`
    applies this itself; it is public for graphs exported by other means (see
    [Note: causal attention] in ``_causal.py``).
    """

    def original_buffer(name: str) -> torch.Tensor | None:
        try:
            return model.get_buffer(name)
        except AttributeError:
            return None

    report = find_causal_attention(gm, constant_lookup(gm, original_buffer))
    erased = apply_causal_attention(gm, report.rewritten)
    gm.recompile()
    masked = len(report.rewritten) + len(report.input_dependent) + len(report.other)
    logger.info(
        "causal attention pass: %d of %d masked attention nodes rewritten to "
        "is_causal=True, %d mask nodes removed",
        len(report.rewritten),
        masked,
        erased,
    )
    if report.input_dependent:
        logger.info(
            "%d attention masks are computed from graph inputs (e.g. attention_mask) and "
            "stay explicit; on CUDA that can rule out fused attention kernels. If the "
            "inputs never pad (an all-ones attention_mask), call the model without it",
            len(report.input_dependent),
        )
    return report.rewritten


def rewrite_tanh_gelu(gm: fx.GraphModule) -> tuple[str, ...]:
    """Replace every tanh GELU written out in element-wise operations in ``gm`` by one
    ``aten.gelu(approximate="tanh")``, in place; the names of the replaced chains' output
    nodes. :func:`trace` applies this with ``fuse_gelu=True``; it is public for graphs
    exported by other means (see [Note: fused tanh GELU] in ``_gelu.py``).
    """
    names, erased = fuse_tanh_gelu(gm)
    gm.recompile()
    logger.info(
        "tanh GELU pass: %d written-out GELUs fused, %d element-wise nodes removed",
        len(names),
        erased - len(names),
    )
    return names


def _map_param_names(gm: fx.GraphModule, twin: MetaTwin) -> dict[str, str]:
    """``get_attr`` target of each graph parameter -> its original name."""
    known = set(twin.param_names)
    out: dict[str, str] = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        value: Any = gm
        for part in str(node.target).split("."):
            value = getattr(value, part)
        if not isinstance(value, nn.Parameter):
            continue
        target = str(node.target)
        names = twin.names_by_twin_id.get(id(value), ())
        if target in known:
            out[target] = target
        elif names:
            out[target] = names[0]
        else:
            raise TraceError(
                f"graph parameter {target!r} matches no parameter of the model; this "
                "torch version renames parameters in a way offload-trace does not know"
            )
    return out


def _op_params(
    op_nodes: list[fx.Node], param_names: Mapping[str, str]
) -> tuple[tuple[tuple[str, ...], ...], dict[str, int]]:
    """Parameters each op reads directly, and the first op index reading each name."""
    out: list[tuple[str, ...]] = []
    first_use: dict[str, int] = {}
    for i, node in enumerate(op_nodes):
        names: list[str] = []
        for inp in node.all_input_nodes:
            if inp.op == "get_attr" and str(inp.target) in param_names:
                pname = param_names[str(inp.target)]
                if pname not in names:
                    names.append(pname)
                first_use.setdefault(pname, i)
        out.append(tuple(names))
    return tuple(out), first_use
