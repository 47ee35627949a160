"""Opaque operations: a module that ``torch.export`` cannot capture runs as one operation.

[Note: opaque operations]
Some modules cannot be captured as a graph: Python that reads tensor values (Hugging Face
layer drop, ``if torch.rand([]) < self.layerdrop``; ``.item()``), or operations the
exporter does not support. When export fails inside such a module (the innermost module
being run when it failed, never the root), the tracer replaces that module's forward in
the meta twin by one call of the custom operation ``offload_trace::opaque`` and exports
again (``_export.py``):

    opaque(key, training, inputs, state) -> outputs

- ``key`` names an :class:`OpaqueEntry` in a registry: the module itself (the twin's
  submodule, whose parameters are meta tensors, used as a template), the structure of its
  arguments with every non-tensor leaf kept as a constant, the structure, shapes and
  dtypes of its outputs, and the estimated costs below. One entry per distinct call
  signature (argument structure, tensor shapes and dtypes, simple constants).
- ``inputs`` are the tensor leaves of the pytree-flattened ``(args, kwargs)``;
  ``state`` the module's parameters and buffers (duplicates once). The graph reads the
  state through ``get_attr`` nodes like any other operation, so the planner's regions
  upload it before the operation and may offload it after: the whole module is one
  operation's worth of parameters, all in one region.
- ``training`` is the module's mode; evaluation graphs flip it (``_rewrite.to_eval``).

Recorded before export: the module's forward is run on meta tensors of the recorded input
shapes under a dispatch mode that answers ``aten._local_scalar_dense`` (what ``bool()``
and ``.item()`` of a tensor dispatch to) with a placeholder, ``False`` / ``0``, so shapes
are inferred without data. A layer-drop draw then keeps every layer: the cost is the
module's most expensive path. Factory calls without a device go to meta, and the
random-number state is restored afterwards, so tracing draws nothing. Shapes must be
static (``dynamic_batch=True`` with an opaque module is refused) and must not depend on
values; non-tensor arguments are constants fixed at trace time (a device constant on meta
becomes the device of the operation's tensors).

Running it (the real kernel): the module's forward runs under ``no_grad`` through
``torch.func.functional_call`` with the real state tensors in place of the template's.
Autograd is recomputation, as in activation checkpointing: the forward saves only its
inputs and parameters (``ctx.save_for_backward``, so the runtime's saved-tensor hooks
re-upload an offloaded region before its backward reads them), holds its buffers, and
keeps the CPU and device random-number states taken just before it ran. The backward
restores those states, reruns the forward with gradients enabled, takes
``torch.autograd.grad`` with respect to the inputs and parameters that need one (``None``
where unused: a dropped layer's parameters get no gradient, as in eager training) and
restores the random-number states it found, so the stream of draws is the one eager
training makes. Buffers are copied, as they are at backward, for the rerun, so a buffer
the module updates in place (batch-norm statistics) is updated once. On the meta device
the backward returns empty gradients of the right shapes without rerunning anything (the
cost run, ``_costs.py``).

Costs the meta cost run cannot see, estimated from the meta runs above
(:class:`~offload_trace._costs.ExtraCost`):

- forward FLOPs: ``torch.utils.flop_counter``'s formulas over the ATen calls of the
  no-grad meta forward; backward FLOPs: twice that (the gradients) plus that again (the
  recomputed forward);
- forward transient bytes: the peak of live bytes the no-grad meta forward allocates
  (outputs included; inputs and state excluded);
- backward transient bytes: the peak of live bytes a meta forward with gradients enabled
  and its backward allocate (input gradients included, parameter gradients dropped as
  they are accumulated, as the memory model accounts them per region).

The cost of all this: the module's forward runs twice per training step, and its
parameters form one region (its activations inside are not kept: only its inputs are).

Lifetime: the registry holds its entries weakly, by a process-unique key. The
:class:`~offload_trace.TracedModel` that traced them holds them, and so does every graph
module :meth:`~offload_trace.TracedModel.module_for` returns (in ``gm.meta``), so an
entry lives as long as a graph that calls it and is freed with the last of them.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from offload_trace._costs import ExtraCost, Liveness, storage_key, tensors_in
from offload_trace.errors import TraceError

META_KEY = "offload_trace_opaque"
"""``gm.meta`` key under which a graph module keeps the entries its opaque nodes call."""

_TENSOR = object()
"""Stands for a tensor leaf in a recorded flat argument or output list."""

_SIMPLE_CONSTANTS = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    torch.dtype,
    torch.device,
    torch.layout,
    torch.memory_format,
)
"""Constants a call signature compares by value; other objects are compared by type."""

_ENTRIES: weakref.WeakValueDictionary[str, OpaqueEntry] = weakref.WeakValueDictionary()
_KEYS = itertools.count()


class TensorSpec(NamedTuple):
    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True, eq=False)
class OpaqueEntry:
    """What the opaque operation needs to run one module for one call signature."""

    key: str
    path: str
    """The module's path in the model (``named_modules``)."""
    class_name: str
    template: nn.Module
    """The module on meta: its code runs with the real state swapped in."""
    signature: tuple[Any, ...]
    """Argument structure, tensor shapes and dtypes, simple constants (:func:`signature`)."""
    in_spec: pytree.TreeSpec
    in_leaves: tuple[Any, ...]
    """Flat ``(args, kwargs)`` leaves; ``_TENSOR`` where the operation's inputs go."""
    state_names: tuple[str, ...]
    """Names in ``template`` of the state tensors, parameters first, then buffers."""
    num_params: int
    out_spec: pytree.TreeSpec
    out_leaves: tuple[Any, ...]
    """Flat output leaves; ``_TENSOR`` where the operation's outputs go."""
    out_tensors: tuple[TensorSpec, ...]
    cost: ExtraCost
    meta_device_leaves: tuple[int, ...] = field(default=(), repr=False)
    """Positions in ``in_leaves`` of device constants that name the meta device."""

    def __deepcopy__(self, memo: dict[int, Any]) -> OpaqueEntry:
        # Shared, not copied: a deep-copied graph calls the same registered entry.
        return self

    @property
    def label(self) -> str:
        return f"{self.path} ({self.class_name})"

    def call_arguments(
        self, inputs: Sequence[torch.Tensor], device: torch.device | None
    ) -> tuple[tuple[Any, ...], dict[str, Any]]:
        """The module's ``(args, kwargs)`` with ``inputs`` at the tensor leaves."""
        given = iter(inputs)
        leaves = [next(given) if leaf is _TENSOR else leaf for leaf in self.in_leaves]
        if device is not None:
            for i in self.meta_device_leaves:
                leaves[i] = device if isinstance(leaves[i], torch.device) else str(device)
        args, kwargs = pytree.tree_unflatten(leaves, self.in_spec)
        return tuple(args), dict(kwargs)

    def unflatten_outputs(self, outputs: Sequence[torch.Tensor]) -> Any:
        given = iter(outputs)
        leaves = [next(given) if leaf is _TENSOR else leaf for leaf in self.out_leaves]
        return pytree.tree_unflatten(leaves, self.out_spec)

    def run(
        self, training: bool, inputs: Sequence[torch.Tensor], state: Sequence[torch.Tensor]
    ) -> list[torch.Tensor]:
        """Run the module's own forward on ``inputs`` with ``state`` swapped in; its
        tensor outputs, checked against the recorded structure and shapes."""
        template = self.template
        if template.training != training:
            template.train(training)
        devices = [t.device for t in (*inputs, *state)]
        args, kwargs = self.call_arguments(inputs, devices[0] if devices else None)
        out = torch.func.functional_call(
            template, dict(zip(self.state_names, state, strict=True)), args, kwargs
        )
        leaves, spec = pytree.tree_flatten(out)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        shapes = tuple(TensorSpec(tuple(t.shape), t.dtype) for t in tensors)
        if spec != self.out_spec or shapes != self.out_tensors:
            raise RuntimeError(
                f"module {self.label} ran as an opaque operation and returned outputs of "
                f"another structure or shape than at trace time (shapes {list(shapes)}, "
                f"traced {list(self.out_tensors)}): its outputs' shapes depend on tensor "
                "values, which offload-trace cannot plan for; make them fixed"
            )
        return tensors


def lookup(key: str) -> OpaqueEntry:
    entry = _ENTRIES.get(key)
    if entry is None:
        raise RuntimeError(
            f"opaque operation {key!r} belongs to a traced model that no longer exists; "
            "run the graph from TracedModel.module_for (or the OffloadModule built from it)"
        )
    return entry


# ---- the operation ---------------------------------------------------------------------


class _RngStates(NamedTuple):
    cpu: torch.Tensor
    devices: tuple[tuple[torch.device, torch.Tensor], ...]


def _rng_states(devices: Iterable[torch.device]) -> _RngStates:
    """The CPU's random-number state and that of each of ``devices`` other than the CPU."""
    wanted = dict.fromkeys(d for d in devices if d.type not in ("cpu", "meta"))
    return _RngStates(
        torch.get_rng_state(),
        tuple((d, torch.get_device_module(d.type).get_rng_state(d)) for d in wanted),
    )


def _set_rng_states(states: _RngStates) -> None:
    torch.set_rng_state(states.cpu)
    for device, state in states.devices:
        torch.get_device_module(device.type).set_rng_state(state, device)


@contextmanager
def _replayed_rng(states: _RngStates) -> Iterator[None]:
    """Run with ``states`` as the random-number states; restore the current ones after."""
    now = _rng_states(d for d, _ in states.devices)
    _set_rng_states(states)
    try:
        yield
    finally:
        _set_rng_states(now)


class _Stash(threading.local):
    # The random-number states taken by the kernel just before the module ran, for the
    # setup_context call that autograd makes right after the kernel returns (the kernel
    # runs below autograd and cannot reach the autograd context).
    rng: _RngStates | None = None


_STASH = _Stash()


@torch.library.custom_op("offload_trace::opaque", mutates_args=())
def _opaque(
    key: str, training: bool, inputs: list[torch.Tensor], state: list[torch.Tensor]
) -> list[torch.Tensor]:
    entry = lookup(key)
    _STASH.rng = _rng_states(t.device for t in (*inputs, *state))
    with torch.no_grad():
        outputs = entry.run(training, inputs, state)
    return _unaliased(outputs, [*inputs, *state])


def _unaliased(outputs: list[torch.Tensor], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """``outputs`` with any tensor sharing storage with an input or an earlier output
    copied: a custom operation's outputs must be fresh tensors."""
    seen = {t.untyped_storage().data_ptr() for t in inputs if t.numel()}
    out = []
    for t in outputs:
        ptr = t.untyped_storage().data_ptr()
        if t.numel() and ptr in seen:
            t = t.clone()
            ptr = t.untyped_storage().data_ptr()
        seen.add(ptr)
        out.append(t)
    return out


@_opaque.register_fake
def _opaque_fake(
    key: str, training: bool, inputs: list[torch.Tensor], state: list[torch.Tensor]
) -> list[torch.Tensor]:
    # Also the meta kernel: the cost run sees the outputs allocated, nothing else.
    entry = lookup(key)
    device = next((t.device for t in (*inputs, *state)), torch.device("meta"))
    return [torch.empty(s.shape, dtype=s.dtype, device=device) for s in entry.out_tensors]


def _setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
    key, training, ins, state = inputs
    params = lookup(key).num_params
    ctx.key = key
    ctx.training = training
    ctx.num_inputs = len(ins)
    ctx.rng, _STASH.rng = _STASH.rng, None
    ctx.save_for_backward(*ins, *state[:params])
    # Buffers are held, not saved: a later forward may update them in place (batch-norm
    # statistics), which a saved tensor's version check would refuse at backward.
    ctx.buffers = [b.detach() for b in state[params:]]


def _backward(
    ctx: Any, grads: list[torch.Tensor | None]
) -> tuple[None, None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    saved: tuple[torch.Tensor, ...] = (*ctx.saved_tensors, *ctx.buffers)
    _, _, needs_inputs, needs_state = ctx.needs_input_grad
    needs: list[bool] = [*needs_inputs, *needs_state]
    n = ctx.num_inputs
    if any(t.device.type == "meta" for t in saved):
        # The cost run: rerunning data-dependent Python on meta is neither possible nor
        # needed; the gradients' bytes are what it measures.
        empty = [
            torch.empty_like(t) if need else None for t, need in zip(saved, needs, strict=True)
        ]
        return None, None, empty[:n], empty[n:]
    entry = lookup(ctx.key)
    if ctx.rng is None:
        raise RuntimeError(
            f"opaque operation of {entry.label}: no random-number state was taken when its "
            "forward ran; call it through the traced graph"
        )
    detached = [_detached(t, need) for t, need in zip(saved, needs, strict=True)]
    for i in range(n + entry.num_params, len(detached)):
        detached[i] = detached[i].clone()  # buffers: an in-place update happens once
    with _replayed_rng(ctx.rng), torch.enable_grad():
        outputs = entry.run(ctx.training, detached[:n], detached[n:])
    pairs = [
        (o, g) for o, g in zip(outputs, grads, strict=True) if g is not None and o.requires_grad
    ]
    targets = [t for t in detached if t.requires_grad]
    result: list[torch.Tensor | None] = [None] * len(detached)
    if pairs and targets:
        got = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
            )
        )
        result = [next(got) if t.requires_grad else None for t in detached]
    return None, None, result[:n], result[n:]


def _detached(t: torch.Tensor, need: bool) -> torch.Tensor:
    d = t.detach()
    return d.requires_grad_(need) if need and (d.is_floating_point() or d.is_complex()) else d


_opaque.register_autograd(_backward, setup_context=_setup_context)

OPAQUE_OP: Any = torch.ops.offload_trace.opaque.default
"""The graph target of an opaque operation."""


def is_opaque(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target is OPAQUE_OP


def entries_of(gm: torch.fx.GraphModule) -> list[OpaqueEntry]:
    """The entries ``gm``'s opaque nodes call (nested graphs included), in graph order."""
    keys = [
        str(n.args[0])
        for m in gm.modules()
        if isinstance(m, torch.fx.GraphModule)
        for n in m.graph.nodes
        if is_opaque(n)
    ]
    return [lookup(k) for k in dict.fromkeys(keys)]


# ---- recording an entry ----------------------------------------------------------------


def signature(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, ...]:
    """What must agree for two calls of a module to share an entry: the argument
    structure, each tensor's shape and dtype, each simple constant's value and each
    other object's type."""
    leaves, spec = pytree.tree_flatten((args, kwargs))
    described: list[Any] = []
    for leaf in leaves:
        if isinstance(leaf, torch.Tensor):
            described.append(("tensor", tuple(leaf.shape), leaf.dtype))
        elif isinstance(leaf, _SIMPLE_CONSTANTS):
            described.append((type(leaf).__name__, repr(leaf)))
        else:
            described.append(("object", type(leaf)))
    return (spec, tuple(described))


def _placeholder(dtype: torch.dtype) -> bool | int | float | complex:
    if dtype == torch.bool:
        return False
    if dtype.is_complex:
        return 0j
    return 0.0 if dtype.is_floating_point else 0


class _MetaRunMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Runs a module on meta: answers value reads with a placeholder, counts FLOPs and the
    peak of live bytes that the run allocates (storages in ``ignored`` left out)."""

    def __init__(self, ignored: set[int]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.live = Liveness(ignored)
        self.peak_bytes = 0
        self.flop = 0
        self.count_flop = True

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            return _placeholder(args[0].dtype)
        out = func(*args, **kwargs)
        if self.count_flop:
            formula = flop_registry.get(func._overloadpacket)
            if formula is not None:
                self.flop += int(formula(*args, **kwargs, out_val=out))
        grew = False
        for t in tensors_in(out):
            got = storage_key(t)
            if got is None or got[0] in self.live.ignored or self.live.is_live(got[0]):
                continue
            self.live.add(got[0], got[1], 0)
            grew = True
        if grew:
            self.live.sweep(list(self.live.entries))
            self.peak_bytes = max(self.peak_bytes, self.live.live_bytes)
        return out

    def ignore(self, tensors: Sequence[torch.Tensor]) -> None:
        for t in tensors:
            got = storage_key(t)
            if got is not None:
                self.live.ignored.add(got[0])


def _meta_like(spec: TensorSpec, requires_grad: bool) -> torch.Tensor:
    t = torch.empty(spec.shape, dtype=spec.dtype, device="meta")
    if requires_grad and (spec.dtype.is_floating_point or spec.dtype.is_complex):
        t.requires_grad_(True)
    return t


@dataclass
class _MetaRun:
    outputs: Any
    flop: int
    fwd_peak_bytes: int
    bwd_peak_bytes: int


def _run_on_meta(
    module: nn.Module,
    leaves: list[Any],
    specs: dict[int, TensorSpec],
    in_spec: pytree.TreeSpec,
) -> _MetaRun:
    """Run ``module`` on meta inputs of the recorded shapes: once without gradients
    (outputs, FLOPs, forward peak), once forward and backward with them (backward peak)."""
    state = [*module.parameters(), *module.buffers()]

    def arguments(requires_grad: bool) -> tuple[list[torch.Tensor], tuple[Any, ...], Any]:
        flat = list(leaves)
        made = []
        for i, spec in specs.items():
            flat[i] = _meta_like(spec, requires_grad)
            made.append(flat[i])
        args, kwargs = pytree.tree_unflatten(flat, in_spec)
        return made, tuple(args), kwargs

    params = [p for p in module.parameters() if p.requires_grad]
    # The meta run must not draw from the caller's generators; factory calls without a
    # device (``torch.rand([])``) land on meta, where their values are placeholders.
    with torch.random.fork_rng(devices=[]), torch.device("meta"):
        made, args, kwargs = arguments(False)
        mode = _MetaRunMode(set())
        mode.ignore([*state, *made])
        with mode, torch.no_grad():
            outputs = module(*args, **kwargs)
        forward = mode
        made, args, kwargs = arguments(True)
        mode = _MetaRunMode(set())
        mode.count_flop = False
        mode.ignore([*state, *made])
        # Parameter gradients are accounted per region: drop each as it is accumulated.
        handles = [
            p.register_post_accumulate_grad_hook(_drop_grad)  # type: ignore[no-untyped-call]
            for p in params
        ]
        try:
            with mode, torch.enable_grad():
                out = module(*args, **kwargs)
            roots = [t for t in tensors_in(_flat(out)) if t.requires_grad]
            grads = [torch.empty_like(t) for t in roots]
            mode.ignore(grads)
            if roots:
                with mode:
                    torch.autograd.backward(roots, grads)
            del out, roots, grads
        finally:
            for h in handles:
                h.remove()
            for p in params:
                p.grad = None
    return _MetaRun(outputs, forward.flop, forward.peak_bytes, mode.peak_bytes)


def _flat(value: Any) -> list[Any]:
    return list(pytree.tree_leaves(value))


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def record_entry(
    path: str, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> OpaqueEntry:
    """Record an entry for calling ``module`` (at ``path`` in the model) with ``args`` and
    ``kwargs`` (fake or meta tensors of static shapes) and register it.

    Raises:
        TraceError: a shape is symbolic, or the module cannot run on meta tensors.
    """
    label = f"{path} ({type(module).__name__})"
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    specs: dict[int, TensorSpec] = {}
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if any(isinstance(s, torch.SymInt) for s in leaf.shape):
                raise TraceError(
                    f"module {label} must run as an opaque operation, which needs static "
                    "shapes, but its inputs have a symbolic batch size: trace with "
                    "dynamic_batch=False"
                )
            specs[i] = TensorSpec(tuple(int(s) for s in leaf.shape), leaf.dtype)
    constants = tuple(_TENSOR if i in specs else leaf for i, leaf in enumerate(leaves))
    try:
        ran = _run_on_meta(module, list(constants), specs, in_spec)
    except Exception as exc:
        first = str(exc).strip().splitlines()
        raise TraceError(
            f"module {label} cannot be captured by torch.export, and running it on the "
            "meta device to record its outputs' shapes failed too "
            f"({type(exc).__name__}: {first[0] if first else ''}); its outputs' shapes may "
            "depend on tensor values. Rewrite that code with torch.where / torch.cond, or "
            "keep it outside the model"
        ) from exc
    out_leaves, out_spec = pytree.tree_flatten(ran.outputs)
    out_tensors = tuple(
        TensorSpec(tuple(t.shape), t.dtype) for t in out_leaves if isinstance(t, torch.Tensor)
    )
    params = [n for n, _ in module.named_parameters()]
    buffers = [n for n, _ in module.named_buffers()]
    flop = ran.flop
    entry = OpaqueEntry(
        key=f"{path}#{next(_KEYS)}",
        path=path,
        class_name=type(module).__name__,
        template=module,
        signature=signature(args, kwargs),
        in_spec=in_spec,
        in_leaves=constants,
        state_names=(*params, *buffers),
        num_params=len(params),
        out_spec=out_spec,
        out_leaves=tuple(_TENSOR if isinstance(t, torch.Tensor) else t for t in out_leaves),
        out_tensors=out_tensors,
        cost=ExtraCost(
            fwd_flop=flop,
            bwd_flop=3 * flop,
            fwd_transient_bytes=ran.fwd_peak_bytes,
            bwd_transient_bytes=ran.bwd_peak_bytes,
        ),
        meta_device_leaves=tuple(
            i
            for i, leaf in enumerate(constants)
            if (isinstance(leaf, torch.device) and leaf.type == "meta")
            or (isinstance(leaf, str) and leaf == "meta")
        ),
    )
    _ENTRIES[entry.key] = entry
    return entry


def state_tensors(module: nn.Module, entry: OpaqueEntry) -> list[torch.Tensor]:
    """``module``'s state tensors in ``entry``'s order, as they are now (while export
    runs, the fake tensors it swapped in)."""
    out = []
    for name in entry.state_names:
        owner_path, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_path) if owner_path else module
        value = getattr(owner, leaf)
        assert isinstance(value, torch.Tensor), name
        out.append(value)
    return out


def opaque_forward(
    module: nn.Module,
    entries: list[OpaqueEntry],
    on_unknown: Callable[[tuple[Any, ...], dict[str, Any]], None],
) -> Callable[..., Any]:
    """A forward for ``module`` that calls the opaque operation of the entry matching its
    arguments' signature; for a call matching none, ``on_unknown(args, kwargs)`` (which
    must raise)."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        sig = signature(args, kwargs)
        entry = next((e for e in entries if e.signature == sig), None)
        if entry is None:
            on_unknown(args, kwargs)
            raise AssertionError("on_unknown returned")
        inputs = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        outputs = OPAQUE_OP(entry.key, module.training, inputs, state_tensors(module, entry))
        return entry.unflatten_outputs(outputs)

    return forward
