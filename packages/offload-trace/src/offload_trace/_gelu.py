"""Graph pass: the tanh GELU written out in element-wise operations becomes one ``gelu``.

[Note: fused tanh GELU]
GPT-2's activation (``transformers.activations.NewGELUActivation``, ``gelu_new``) is
written in Python as ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x ** 3)))``, so
the exported graph holds eight element-wise operations per MLP, each of which the host
issues, the device runs over the whole ``(tokens, 4 * hidden)`` activation, and autograd
records:

    mul(x, 0.5); pow(x, 3); mul(., 0.044715); add(x, .); mul(., sqrt(2 / pi)); tanh;
    add(., 1); mul(half_x, .)

``aten.gelu(x, approximate="tanh")`` is the same formula in one kernel (computed in
float32 inside, rounded once), one backward node, and it saves only ``x`` for backward,
where the written-out form also saves the ``tanh`` output and both factors of the last
product: three more activations of ``(tokens, 4 * hidden)`` per layer (15 GB for gpt2_xl
at 8 x 1024 in fp16). The pass matches exactly that chain of nodes (either operand order
in each product and sum, constants within 1e-6 of the formula's) where every inner node
has no other user, and replaces it; anything else is left alone. Results differ from the
written-out form by rounding only (fp16: the fused kernel rounds once, where the chain
rounds after each of its eight operations).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx

aten = torch.ops.aten

GELU = aten.gelu.default
_MUL = aten.mul.Tensor
_ADD = aten.add.Tensor
_POW = aten.pow.Tensor_Scalar
_TANH = aten.tanh.default
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class _Chain:
    """One written-out tanh GELU: its input, its output and the nodes between."""

    x: fx.Node
    out: fx.Node
    inner: tuple[fx.Node, ...]


def _near(value: Any, target: float) -> bool:
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and math.isclose(float(value), target, rel_tol=1e-6)
    )


def _binary(node: Any, target: Any) -> tuple[Any, Any] | None:
    """``node``'s two operands when it is a plain ``target`` call (an add with alpha 1)."""
    if not isinstance(node, fx.Node) or node.op != "call_function" or node.target is not target:
        return None
    if len(node.args) != 2 or any(k != "alpha" for k in node.kwargs):
        return None
    if node.kwargs.get("alpha", 1) != 1:
        return None
    return node.args[0], node.args[1]


def _split(operands: tuple[Any, Any] | None, constant: float) -> fx.Node | None:
    """The node operand of a (node, constant) pair in either order, constant matched."""
    if operands is None:
        return None
    a, b = operands
    if isinstance(a, fx.Node) and _near(b, constant):
        return a
    if isinstance(b, fx.Node) and _near(a, constant):
        return b
    return None


def _sole_user(node: fx.Node) -> fx.Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _chain_at(tanh: fx.Node) -> _Chain | None:
    """The written-out GELU around ``tanh`` (an ``aten.tanh`` node), or None."""
    scaled = tanh.args[0] if len(tanh.args) == 1 and not tanh.kwargs else None
    inner_sum = _split(_binary(scaled, _MUL), _SQRT_2_OVER_PI)
    operands = _binary(inner_sum, _ADD)
    if operands is None:
        return None
    # x + 0.044715 * pow(x, 3), the sum's operands in either order.
    x = cubic = cube = None
    for a, b in (operands, operands[::-1]):
        term = _split(_binary(b, _MUL), 0.044715)
        if (
            isinstance(a, fx.Node)
            and isinstance(b, fx.Node)
            and isinstance(term, fx.Node)
            and term.op == "call_function"
            and term.target is _POW
            and len(term.args) == 2
            and term.args[0] is a
            and _near(term.args[1], 3.0)
        ):
            x, cubic, cube = a, b, term
            break
    if x is None or cubic is None or cube is None:
        return None
    one_plus = _sole_user(tanh)
    if _split(_binary(one_plus, _ADD), 1.0) is not tanh:
        return None
    assert one_plus is not None
    out = _sole_user(one_plus)
    operands = _binary(out, _MUL)
    if out is None or operands is None:
        return None
    if one_plus not in operands:
        return None
    half = operands[0] if operands[1] is one_plus else operands[1]
    if _split(_binary(half, _MUL), 0.5) is not x:
        return None
    assert isinstance(half, fx.Node) and isinstance(scaled, fx.Node)
    assert isinstance(inner_sum, fx.Node)
    inner = (half, cube, cubic, inner_sum, scaled, tanh, one_plus)
    if any(_sole_user(n) is None for n in inner):
        return None  # an inner value is used elsewhere: it must stay
    return _Chain(x, out, inner)


def _chains(gm: fx.GraphModule) -> list[_Chain]:
    """Every written-out tanh GELU in ``gm``, in graph order."""
    tanhs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target is _TANH]
    return [chain for chain in map(_chain_at, tanhs) if chain is not None]


def apply_tanh_gelu(gm: fx.GraphModule, names: Iterable[str]) -> int:
    """Replace each named written-out tanh GELU (by its output node's name, as
    :func:`fuse_tanh_gelu` gives them) by one ``aten.gelu(x, approximate="tanh")`` node.
    Deterministic, so that every unlift of the same program gives the same nodes. Returns
    the nodes erased; the caller recompiles ``gm``.

    Raises:
        ValueError: a name is not the output of a written-out tanh GELU in ``gm``.
    """
    wanted = set(names)
    if not wanted:
        return 0
    chains = [chain for chain in _chains(gm) if chain.out.name in wanted]
    missing = wanted - {c.out.name for c in chains}
    if missing:
        raise ValueError(f"nodes {sorted(missing)} are not written-out tanh GELUs in this graph")
    return fuse_chains(gm, chains)


def fuse_tanh_gelu(gm: fx.GraphModule) -> tuple[tuple[str, ...], int]:
    """Replace every written-out tanh GELU in ``gm`` (see [Note: fused tanh GELU]; one walk
    of the graph): the names of their output nodes, in graph order, and the nodes erased.
    The caller recompiles ``gm``."""
    chains = _chains(gm)
    names = tuple(chain.out.name for chain in chains)
    return names, fuse_chains(gm, chains)


def fuse_chains(gm: fx.GraphModule, chains: Iterable[_Chain]) -> int:
    """Replace each of ``chains`` by one ``aten.gelu(x, approximate="tanh")`` node; the
    nodes erased."""
    erased = 0
    for chain in chains:
        with gm.graph.inserting_before(chain.out):
            fused = gm.graph.call_function(GELU, (chain.x,), {"approximate": "tanh"})
        fused.meta = dict(chain.out.meta)
        chain.out.replace_all_uses_with(fused)
        for node in (chain.out, *reversed(chain.inner)):
            gm.graph.erase_node(node)
            erased += 1
    return erased
