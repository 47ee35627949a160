"""Graph pass: attention with a constant causal mask becomes ``is_causal=True`` attention.

[Note: causal attention]
``torch.export`` runs Hugging Face's mask code in tracing mode, where the shortcut that
eager mode takes (no mask at all, ``is_causal=True``) is disabled; the causal mask is then
materialised as a boolean tensor and passed to every
``aten.scaled_dot_product_attention`` node as ``attn_mask``. On CUDA an explicit mask
rules out the flash kernel, and the memory-efficient and cuDNN kernels need a head
dimension that is a multiple of 8 (fp16/bf16): GPT-2 XL (head dim 50) then falls back to
the math path, which keeps several B x H x S x S tensors per layer for backward (at long
sequences more than the device holds).

The pass proves, node by node, that a mask is exactly the causal pattern, and only then
drops it in favour of ``is_causal=True``, which is what eager mode runs:

1. The mask's producing subgraph reads no graph input (placeholder) and no parameter:
   only constants, shapes and buffers, through deterministic, non-mutating ATen ops.
2. That subgraph, evaluated concretely on the CPU at trace time (shapes are static, and
   devices baked into it as ``meta`` are read as ``cpu``), gives a tensor that, broadcast
   over the last two dimensions to ``S_q x S_k``, is the lower-triangular pattern in every
   leading index: boolean ``True`` on and below the diagonal, ``False`` above; or an
   additive float mask of ``0`` below and ``-inf`` / the dtype's most negative finite
   value above (softmax weights of exactly zero either way, since every row keeps its
   diagonal). ``S_q == S_k`` (``is_causal`` aligns the triangle top-left).
3. The mask broadcasts to the attention's ``(batch, heads, S_q, S_k)``.

A mask that depends on an input (an ``attention_mask`` argument, even when it is all ones)
cannot be proved constant at trace time and is left alone; deciding at run time would
need a host synchronisation per forward. Buffers are read from the caller's model at
trace time: a mask computed from a buffer is assumed not to change after tracing.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

logger = logging.getLogger(__name__)

aten = torch.ops.aten

SDPA = aten.scaled_dot_product_attention.default
_METADATA_CHECK = aten._assert_tensor_metadata.default
_MASK_POS = 3
_CAUSAL_POS = 5

MAX_MASK_EVAL_BYTES = 2**30
"""Largest tensor (bytes) the pass evaluates while checking one mask; bigger masks are
left alone rather than allocate that much host memory at trace time."""

ConstantLookup = Callable[[str], torch.Tensor | None]
"""``get_attr`` target -> its concrete (CPU) value, or ``None`` when it has none."""


@dataclass(frozen=True)
class CausalMaskReport:
    """What the pass decided for each attention node of a graph."""

    rewritten: tuple[str, ...]
    """Names of the attention nodes whose mask was proved causal (now ``is_causal``)."""
    input_dependent: tuple[str, ...]
    """Attention nodes whose mask reads a graph input, e.g. an ``attention_mask``."""
    other: tuple[str, ...]
    """Attention nodes with a mask left alone for another reason (not causal, too large,
    not evaluable at trace time)."""


def _mask_arg(node: fx.Node) -> Any:
    if len(node.args) > _MASK_POS:
        return node.args[_MASK_POS]
    return node.kwargs.get("attn_mask")


def _is_causal_arg(node: fx.Node) -> bool:
    if len(node.args) > _CAUSAL_POS:
        return bool(node.args[_CAUSAL_POS])
    return bool(node.kwargs.get("is_causal", False))


def _subgraph(mask: fx.Node) -> list[fx.Node]:
    """``mask`` and every node it depends on, in graph order."""
    seen: set[fx.Node] = set()
    stack = [mask]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        stack.extend(node.all_input_nodes)
    return [n for n in mask.graph.nodes if n in seen]


def _val_bytes(node: fx.Node) -> int:
    val = node.meta.get("val")
    total = 0
    for t in val if isinstance(val, (tuple, list)) else (val,):
        if isinstance(t, torch.Tensor):
            total += t.numel() * t.element_size()
    return total


def _evaluable_op(target: Any) -> bool:
    if target is operator.getitem:
        return True
    if not isinstance(target, torch._ops.OpOverload):
        return False
    # Random ops would give a different mask on every call; mutating ops could change
    # state the graph reads elsewhere.
    return torch.Tag.nondeterministic_seeded not in target.tags and not target._schema.is_mutable


def _on_cpu(value: Any) -> Any:
    if isinstance(value, torch.device) and value.type == "meta":
        return torch.device("cpu")
    if isinstance(value, str) and value == "meta":
        return "cpu"
    return value


class _NotProvable(Exception):
    """The mask cannot be evaluated at trace time (the reason is the message)."""


def _evaluate(nodes: list[fx.Node], lookup: ConstantLookup) -> Any:
    """Concrete value of the last of ``nodes`` (a closed subgraph), computed on the CPU."""
    env: dict[fx.Node, Any] = {}
    with torch.no_grad():
        for node in nodes:
            if node.op == "get_attr":
                value = lookup(str(node.target))
                if value is None:
                    raise _NotProvable(f"{node.target} has no value at trace time")
                # A model on the GPU hands out GPU constants; everything here runs on the CPU.
                env[node] = value.cpu() if isinstance(value, torch.Tensor) else value
                continue
            args = fx.node.map_aggregate(fx.node.map_arg(node.args, env.__getitem__), _on_cpu)
            kwargs = fx.node.map_aggregate(fx.node.map_arg(node.kwargs, env.__getitem__), _on_cpu)
            try:
                env[node] = node.target(*args, **kwargs)  # type: ignore[operator]
            except Exception as exc:  # any op failing on CPU values: not provable
                raise _NotProvable(f"{node.name} failed on the CPU: {exc}") from exc
    return env[nodes[-1]]


def _causal_pattern(mask: torch.Tensor, shape: tuple[int, int, int, int]) -> bool:
    """Whether ``mask`` broadcast to ``shape`` (B, H, S_q, S_k) is the causal mask."""
    s_q, s_k = shape[2], shape[3]
    if s_q != s_k or mask.dim() > 4:
        return False
    # Broadcasting to `shape` must not grow it: every mask dim is 1 or the target's.
    if any(m not in (1, t) for m, t in zip(reversed(mask.shape), reversed(shape), strict=False)):
        return False
    # Expand only the two trailing dimensions; leading ones are compared as they are.
    rows = mask.expand(*mask.shape[:-2], s_q, s_k) if mask.dim() >= 2 else mask.expand(s_q, s_k)
    keep = torch.ones(s_q, s_k, dtype=torch.bool, device=rows.device).tril()
    if rows.dtype == torch.bool:
        return bool((rows == keep).all())
    if not rows.is_floating_point():
        return False
    blocked = torch.isneginf(rows) | (rows == torch.finfo(rows.dtype).min)
    return bool(torch.where(keep, rows == 0, blocked).all())


def _attention_shape(node: fx.Node) -> tuple[int, int, int, int] | None:
    q, k = node.args[0], node.args[1]
    if not isinstance(q, fx.Node) or not isinstance(k, fx.Node):
        return None
    qv, kv = q.meta.get("val"), k.meta.get("val")
    if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor):
        return None
    if qv.dim() != 4 or kv.dim() != 4:
        return None
    dims = (qv.shape[0], qv.shape[1], qv.shape[2], kv.shape[2])
    if not all(isinstance(d, int) for d in dims):
        return None  # symbolic (dynamic batch): not evaluable at trace time
    return (int(dims[0]), int(dims[1]), int(dims[2]), int(dims[3]))


def find_causal_attention(gm: fx.GraphModule, lookup: ConstantLookup) -> CausalMaskReport:
    """Classify every masked ``scaled_dot_product_attention`` of ``gm``'s top graph.

    Args:
        gm: the traced graph (meta values in ``node.meta["val"]``).
        lookup: concrete values of ``get_attr`` targets (buffers, constants).
    """
    rewritten: list[str] = []
    input_dependent: list[str] = []
    other: list[str] = []
    verdicts: dict[tuple[fx.Node, tuple[int, int, int, int]], str] = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not SDPA:
            continue
        mask = _mask_arg(node)
        if not isinstance(mask, fx.Node) or _is_causal_arg(node):
            continue
        shape = _attention_shape(node)
        if shape is None:
            other.append(node.name)
            continue
        key = (mask, shape)
        if key not in verdicts:
            verdicts[key] = _verdict(mask, shape, lookup)
        {"causal": rewritten, "input": input_dependent}.get(verdicts[key], other).append(node.name)
    return CausalMaskReport(tuple(rewritten), tuple(input_dependent), tuple(other))


def _verdict(mask: fx.Node, shape: tuple[int, int, int, int], lookup: ConstantLookup) -> str:
    nodes = _subgraph(mask)
    inputs = [n.name for n in nodes if n.op == "placeholder"]
    if inputs:
        logger.debug("mask %s reads graph inputs %s: left alone", mask.name, inputs)
        return "input"
    for n in nodes:
        if n.op == "get_attr":
            continue
        if n.op != "call_function" or not _evaluable_op(n.target):
            logger.debug("mask %s: node %s (%s) is not evaluable", mask.name, n.name, n.target)
            return "other"
        if _val_bytes(n) > MAX_MASK_EVAL_BYTES:
            logger.debug("mask %s: node %s is too large to evaluate", mask.name, n.name)
            return "other"
    try:
        value = _evaluate(nodes, lookup)
    except _NotProvable as exc:
        logger.debug("mask %s: %s", mask.name, exc)
        return "other"
    if isinstance(value, torch.Tensor) and _causal_pattern(value, shape):
        return "causal"
    logger.debug("mask %s is not the causal pattern", mask.name)
    return "other"


def apply_causal_attention(gm: fx.GraphModule, names: Iterable[str]) -> int:
    """Rewrite the named attention nodes to ``attn_mask=None, is_causal=True``.

    The mask-producing nodes left without users are erased (only those: other dead nodes
    stay, so node names elsewhere in the graph are untouched). Deterministic, so that
    every unlift of the same program gives the same nodes. Returns the nodes erased.
    The caller recompiles ``gm``.
    """
    wanted = set(names)
    masks: list[fx.Node] = []
    for node in gm.graph.nodes:
        if node.name not in wanted:
            continue
        if node.op != "call_function" or node.target is not SDPA:
            raise ValueError(f"node {node.name!r} is not a scaled_dot_product_attention node")
        mask = _mask_arg(node)
        if isinstance(mask, fx.Node):
            masks.append(mask)
        dropout_p = node.args[4] if len(node.args) > 4 else node.kwargs.get("dropout_p", 0.0)
        node.args = (*node.args[:_MASK_POS], None, dropout_p, True)
        node.kwargs = {
            k: v for k, v in node.kwargs.items() if k not in ("attn_mask", "dropout_p", "is_causal")
        }
        wanted.discard(node.name)
    if wanted:
        raise ValueError(f"attention nodes {sorted(wanted)} are not in this graph")
    erased = 0
    candidates: dict[fx.Node, None] = {}
    for mask in masks:
        for n in _subgraph(mask):
            candidates[n] = None
    # Reverse graph order: users go before the nodes they read.
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in sorted(candidates, key=order.__getitem__, reverse=True):
        if n.op != "call_function":
            continue
        # Export checks the dtype/device of some mask intermediates; such a check is no
        # reason to keep computing a value nothing else reads.
        checks = [u for u in n.users if u.target is _METADATA_CHECK and not u.users]
        if len(checks) != len(n.users):
            continue
        for check in checks:
            gm.graph.erase_node(check)
        gm.graph.erase_node(n)
        erased += 1 + len(checks)
    return erased


def constant_lookup(
    gm: fx.GraphModule, buffers: Callable[[str], torch.Tensor | None]
) -> ConstantLookup:
    """Concrete CPU values of ``gm``'s ``get_attr`` targets.

    A target holding a real tensor (a lifted constant) is used as is; a meta tensor is
    looked up with ``buffers`` (the caller's model's buffer of that name). Parameters have
    no fixed value and give ``None``.
    """

    def lookup(target: str) -> torch.Tensor | None:
        value: Any = gm
        try:
            for part in target.split("."):
                value = getattr(value, part)
        except AttributeError:
            return None
        if not isinstance(value, torch.Tensor) or isinstance(value, torch.nn.Parameter):
            return None
        if value.device.type != "meta":
            return value.detach().to("cpu")
        real = buffers(target)
        if real is None or real.device.type == "meta":
            return None
        return real.detach().to("cpu", dtype=value.dtype)

    return lookup
