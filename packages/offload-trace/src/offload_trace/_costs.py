"""Measuring per-operation bytes and FLOPs by running the traced graph on the meta device.

[Note: cost run]
The graph module is run once forward and once backward on meta tensors. Meta tensors have
no data but do have storages with sizes and lifetimes, so the run reproduces exactly which
bytes would be alive at every point of a real step (the caching allocator's rounding and
kernel workspaces aside):

- A ``TorchDispatchMode`` sees every tensor each ATen call returns. A storage seen for
  the first time is an allocation; a weak reference to it tells when it is freed.
  Parameters, buffers and constants live outside the activation budget and are ignored.
- Forward runs in an ``fx.Interpreter`` (which drops each value after its last use, as
  the real program does) under ``saved_tensors_hooks``: each saved tensor is attributed
  to the graph node being executed, storages counted once, parameter aliases left out.
- The autograd nodes a graph node creates are found by walking its outputs' ``grad_fn``
  graph; a pre-hook on each tells the backward pass which graph node is being
  differentiated. Backward then runs on meta, and allocations, frees and FLOPs are
  attributed the same way. Parameter gradients are dropped as soon as they are
  accumulated, because the memory model accounts them per region.
- FLOPs use ``torch.utils.flop_counter``'s formulas for each ATen call.
- Operations whose real kernel saves less than the meta decomposition are replaced by
  stand-ins (see [Note: kernel models] in ``_kernels.py``).
- Operations whose work the meta run cannot see (an opaque module's one operation, whose
  meta kernel only allocates its outputs) bring an :class:`ExtraCost`: FLOPs and
  transient bytes estimated beforehand, added to what the run measures (see [Note:
  opaque operations] in ``_opaque.py``).

The numbers are then expressed in the solver's memory model (see [Note: memory model] in
``offload_solver.profile``): ``fwd_tmp_bytes`` / ``bwd_tmp_bytes`` take whatever is alive
beyond the saved bytes and the operation's own outputs, so that the formula gives the live
bytes measured here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch.multiprocessing.reductions import StorageWeakRef as _StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

from offload_trace._kernels import KernelModel, kernel_models

CALL_OPS = ("call_function", "call_method", "call_module")


class _WeakStorage:
    """A weak reference to a storage that says when the storage has been freed."""

    __slots__ = ("_ref",)

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self._ref = _StorageWeakRef(storage)  # type: ignore[no-untyped-call]

    def expired(self) -> bool:
        return bool(self._ref.expired())  # type: ignore[no-untyped-call]


_UNSAVED = -1
"""Pool of storages made in forward and not (yet) saved for backward."""
_BACKWARD = -2
"""Pool of storages made during backward (gradients and temporaries)."""


@dataclass(frozen=True)
class OpCost:
    """Costs of one graph operation, in bytes and FLOPs (see [Note: cost run])."""

    name: str
    fwd_out_bytes: int
    """Bytes of storages the operation allocates that are still alive when it returns."""
    fwd_tmp_bytes: int
    """Other bytes alive at its forward peak, beyond earlier saved bytes and its outputs."""
    saved_bytes: int
    """Bytes it keeps for backward, storages counted once, parameters left out."""
    bwd_out_bytes: int
    """Bytes its backward allocates that outlive it (the gradients of its inputs)."""
    bwd_tmp_bytes: int
    """Other bytes alive at its backward peak, beyond saved bytes of earlier operations
    and ``bwd_out_bytes``."""
    fwd_flop: int
    bwd_flop: int
    fwd_peak_bytes: int
    """Activation bytes alive at the peak of its forward (the memory model's left side)."""
    bwd_peak_bytes: int
    """Activation bytes alive at the peak of its backward."""
    out_storage_bytes: tuple[int, ...] = ()
    """Bytes of each storage counted in ``fwd_out_bytes``, in order. Numbered across the
    operations in forward order, these are the storages ``reads`` names."""
    reads: tuple[int, ...] = ()
    """The activation storages (numbers as above) among its forward's inputs; parameters,
    buffers and the model's inputs are not numbered."""


@dataclass(frozen=True)
class ExtraCost:
    """Work of one operation that the meta run cannot see, estimated elsewhere."""

    fwd_flop: int
    bwd_flop: int
    fwd_transient_bytes: int
    """Activation bytes the operation's forward allocates at its peak (its outputs
    included), on top of whatever is alive when it starts."""
    bwd_transient_bytes: int
    """Activation bytes its backward allocates at its peak (input gradients included,
    parameter gradients left out), on top of whatever is alive when it starts."""


def storage_key(t: torch.Tensor) -> tuple[int, torch.UntypedStorage] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse / nested tensors have none
        return None
    return storage._cdata, storage


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


class Liveness:
    """Live storages, grouped in pools so a sweep only visits those that may have died."""

    def __init__(self, ignored_keys: set[int]) -> None:
        self.ignored = ignored_keys
        self.entries: dict[int, tuple[_WeakStorage, int, int]] = {}
        self.pools: dict[int, set[int]] = {_UNSAVED: set(), _BACKWARD: set()}
        self.live_bytes = 0

    def is_live(self, key: int) -> bool:
        entry = self.entries.get(key)
        if entry is None:
            return False
        if entry[0].expired():
            self._drop(key)
            return False
        return True

    def _drop(self, key: int) -> None:
        _ref, nbytes, pool = self.entries.pop(key)
        self.pools[pool].discard(key)
        self.live_bytes -= nbytes

    def add(self, key: int, storage: torch.UntypedStorage, pool: int) -> int:
        nbytes = int(storage.nbytes())
        self.entries[key] = (_WeakStorage(storage), nbytes, pool)
        self.pools.setdefault(pool, set()).add(key)
        self.live_bytes += nbytes
        return nbytes

    def move(self, key: int, pool: int) -> int:
        ref, nbytes, old = self.entries[key]
        self.pools[old].discard(key)
        self.pools.setdefault(pool, set()).add(key)
        self.entries[key] = (ref, nbytes, pool)
        return nbytes

    def pool_of(self, key: int) -> int:
        return self.entries[key][2]

    def sweep(self, keys: Any) -> None:
        for key in list(keys):
            entry = self.entries.get(key)
            if entry is not None and entry[0].expired():
                self._drop(key)

    def sweep_pool(self, pool: int) -> None:
        self.sweep(self.pools.get(pool, ()))

    def alive_sizes(self, keys: list[int]) -> list[tuple[int, int]]:
        """(key, bytes) of each of ``keys`` still alive, in order."""
        out = []
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and not entry[0].expired():
                out.append((key, entry[1]))
        return out

    def alive_bytes(self, keys: list[int]) -> int:
        total = 0
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and not entry[0].expired():
                total += entry[1]
        return total


class _CostRun:
    """State of one forward + backward cost run (see [Note: cost run])."""

    def __init__(
        self, num_ops: int, ignored_keys: set[int], extra: Mapping[int, ExtraCost]
    ) -> None:
        self.live = Liveness(ignored_keys)
        self.extra = extra
        self.n = num_ops
        self.backward = False
        self.cur = -1
        self.new_keys: list[int] = []
        self.fwd_out = [0] * num_ops
        self.fwd_peak = [0] * num_ops
        self.saved = [0] * num_ops
        self.fwd_flop = [0] * num_ops
        self.bwd_flop = [0] * num_ops
        self.bwd_out = [0] * num_ops
        self.bwd_peak = [-1] * num_ops
        self.bwd_level_after = [-1] * num_ops
        self.last_bwd_op = -1
        # Storages numbered in the order forward operations return them (see OpCost).
        self.numbers: dict[int, int] = {}
        self.next_number = 0
        self.out_storages: list[list[int]] = [[] for _ in range(num_ops)]
        self.reads: list[list[int]] = [[] for _ in range(num_ops)]

    # -- allocation tracking (called from the dispatch mode) -------------------------

    def on_op(self, func: Any, args: Any, kwargs: Any, out: Any) -> None:
        pool = _BACKWARD if self.backward else _UNSAVED
        grew = False
        for t in tensors_in(out):
            got = storage_key(t)
            if got is None:
                continue
            key, storage = got
            if key in self.live.ignored or self.live.is_live(key):
                continue
            self.live.add(key, storage, pool)
            self.new_keys.append(key)
            grew = True
        if grew and self.cur >= 0:
            self.live.sweep(self.new_keys)
            peaks = self.bwd_peak if self.backward else self.fwd_peak
            peaks[self.cur] = max(peaks[self.cur], self.live.live_bytes)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.add_flop(int(formula(*args, **kwargs, out_val=out)))

    def add_flop(self, flop: int) -> None:
        if self.cur < 0:
            return
        (self.bwd_flop if self.backward else self.fwd_flop)[self.cur] += flop

    # -- forward ---------------------------------------------------------------------

    def begin_forward_op(self, i: int) -> None:
        # Only storages not saved for backward can die during forward.
        self.live.sweep_pool(_UNSAVED)
        self.cur = i
        self.new_keys = []
        self.fwd_peak[i] = self.live.live_bytes
        extra = self.extra.get(i)
        if extra is not None:
            self.fwd_peak[i] += extra.fwd_transient_bytes

    def note_reads(self, i: int, values: Any) -> None:
        """Op ``i`` is about to run forward on ``values``: record the numbered activation
        storages among them (a storage key seen again after its storage died names the
        new one, numbered when it was made)."""
        seen = self.reads[i]
        for t in tensors_in(values):
            got = storage_key(t)
            if got is None or got[0] not in self.numbers or not self.live.is_live(got[0]):
                continue
            number = self.numbers[got[0]]
            if number not in seen:
                seen.append(number)

    def end_forward_op(self, i: int) -> None:
        self.live.sweep(self.new_keys)
        sizes = self.live.alive_sizes(self.new_keys)
        for key, nbytes in sizes:
            self.numbers[key] = self.next_number
            self.next_number += 1
            self.out_storages[i].append(nbytes)
        self.fwd_out[i] = sum(nbytes for _, nbytes in sizes)
        self.fwd_peak[i] = max(self.fwd_peak[i], self.live.live_bytes)
        self.cur = -1
        self.new_keys = []

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        got = storage_key(t)
        if got is None or self.cur < 0:
            return t
        key, storage = got
        if key in self.live.ignored:
            return t  # a parameter, buffer or constant: not an activation
        if self.live.is_live(key):
            if self.live.pool_of(key) == _UNSAVED:
                self.saved[self.cur] += self.live.move(key, self.cur)
        else:
            # A storage the dispatch mode never saw being made (e.g. created outside the
            # run): it is held from now on, so count it.
            self.saved[self.cur] += self.live.add(key, storage, self.cur)
        return t

    # -- backward --------------------------------------------------------------------

    def begin_backward_node(self, i: int) -> None:
        self._close_backward_node()
        self.cur = i
        self.new_keys = []
        extra = self.extra.get(i)
        transient = extra.bwd_transient_bytes if extra is not None else 0
        self.bwd_peak[i] = max(self.bwd_peak[i], self.live.live_bytes + transient)

    def _close_backward_node(self) -> None:
        # Frees since the previous node: its saved tensors, consumed gradients, and
        # forward leftovers (outputs) once released.
        if self.last_bwd_op >= 0:
            self.live.sweep_pool(self.last_bwd_op)
        self.live.sweep_pool(_BACKWARD)
        self.live.sweep_pool(_UNSAVED)
        if self.cur >= 0:
            self.bwd_out[self.cur] += self.live.alive_bytes(self.new_keys)
            self.bwd_level_after[self.cur] = self.live.live_bytes
            self.last_bwd_op = self.cur
        self.cur = -1
        self.new_keys = []

    def finish_backward(self) -> None:
        self._close_backward_node()


class _CostMode(TorchDispatchMode):  # type: ignore[no-untyped-call]
    def __init__(self, run: _CostRun) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.run = run

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.run.on_op(func, args, kwargs, out)
        return out


class _CostInterpreter(fx.Interpreter):
    def __init__(
        self,
        gm: fx.GraphModule,
        run: _CostRun,
        index: dict[fx.Node, int],
        models: dict[Any, KernelModel],
    ) -> None:
        super().__init__(gm)
        self.run_state = run
        self.index = index
        self.models = models
        self.known_nodes: dict[Any, int] = {}

    def run_node(self, n: fx.Node) -> Any:
        i = self.index.get(n)
        if i is None:
            return super().run_node(n)
        self.run_state.note_reads(i, [self.env.get(a) for a in n.all_input_nodes])
        self.run_state.begin_forward_op(i)
        out = super().run_node(n)
        self.run_state.end_forward_op(i)
        self._claim_autograd_nodes(out, i)
        return out

    def call_function(self, target: Any, args: Any, kwargs: Any) -> Any:
        model = self.models.get(target)
        if model is not None:
            out = model(tuple(args), dict(kwargs), self.run_state)
            if out is not NotImplemented:
                return out
        return super().call_function(target, args, kwargs)

    def _claim_autograd_nodes(self, out: Any, i: int) -> None:
        """Attribute to op ``i`` every autograd node its outputs reach that is new."""
        stack = [t.grad_fn for t in tensors_in(out) if t.grad_fn is not None]
        run = self.run_state
        while stack:
            node = stack.pop()
            if node is None or node in self.known_nodes:
                continue
            self.known_nodes[node] = i
            if type(node).__name__ == "AccumulateGrad":
                continue
            node.register_prehook(_prehook(run, i))
            stack.extend(nxt for nxt, _ in node.next_functions if nxt is not None)


def _prehook(run: _CostRun, i: int) -> Any:
    def hook(_grad_outputs: Any) -> None:
        run.begin_backward_node(i)

    return hook


def measure_costs(
    gm: fx.GraphModule,
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, torch.Tensor],
    op_nodes: list[fx.Node],
    device_type: str,
    extra: Mapping[int, ExtraCost] | None = None,
) -> list[OpCost]:
    """Run ``gm`` forward and backward on meta and return the cost of each op node.

    ``gm``'s parameters and buffers must be meta tensors; ``args`` / ``kwargs`` are meta
    inputs in the structure ``gm`` was traced with. ``extra``: by op index, work the meta
    run cannot see, added to what it measures.
    """
    index = {n: i for i, n in enumerate(op_nodes)}
    ignored: set[int] = set()
    params: list[torch.nn.Parameter] = []
    for t in [*gm.parameters(), *gm.buffers()]:
        got = storage_key(t)
        if got is not None:
            ignored.add(got[0])
        if isinstance(t, torch.nn.Parameter):
            params.append(t)
    for n in gm.graph.nodes:
        if n.op == "get_attr":
            value = _fetch_attr(gm, n.target)
            if isinstance(value, torch.Tensor):
                got = storage_key(value)
                if got is not None:
                    ignored.add(got[0])
    run = _CostRun(len(op_nodes), ignored, extra or {})
    for t in [*args, *kwargs.values()]:
        got = storage_key(t)
        if got is not None and got[0] not in ignored:
            # User inputs are alive for the whole step; tracked so that saving one counts.
            run.live.add(got[0], got[1], _UNSAVED)
    # Parameter gradients are accounted per region by the solver: drop them at once.
    handles = [
        p.register_post_accumulate_grad_hook(_drop_grad)  # type: ignore[no-untyped-call]
        for p in params
        if p.requires_grad
    ]
    interp = _CostInterpreter(gm, run, index, kernel_models(device_type))
    try:
        with _CostMode(run):
            with (
                torch.autograd.graph.saved_tensors_hooks(run.pack, _unpack),
                torch.enable_grad(),
            ):
                outputs = interp.run(*_flat_inputs(gm, args, kwargs))
            interp.env.clear()
            roots = [t for t in tensors_in(outputs) if t.requires_grad and t.is_floating_point()]
            del outputs
            if roots:
                run.backward = True
                grads = [torch.empty_like(t) for t in roots]
                torch.autograd.backward(roots, grads)
                run.finish_backward()
            del roots
    finally:
        for h in handles:
            h.remove()
        for p in params:
            p.grad = None
    return _to_op_costs(run, op_nodes)


def _flat_inputs(
    gm: fx.GraphModule, args: tuple[torch.Tensor, ...], kwargs: dict[str, torch.Tensor]
) -> list[Any]:
    """The graph's placeholder values for a call ``gm(*args, **kwargs)``."""
    in_spec = getattr(gm, "_in_spec", None)
    if in_spec is None:
        return [*args, *kwargs.values()]
    return list(fx._pytree.tree_flatten_spec((list(args), kwargs), in_spec))


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


def _unpack(t: torch.Tensor) -> torch.Tensor:
    return t


def _fetch_attr(gm: fx.GraphModule, target: str) -> Any:
    obj: Any = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _to_op_costs(run: _CostRun, op_nodes: list[fx.Node]) -> list[OpCost]:
    """Express the measured live bytes in the solver's memory model."""
    n = len(op_nodes)
    saved_before = [0] * (n + 1)
    for i in range(n):
        saved_before[i + 1] = saved_before[i] + run.saved[i]
    # An operation whose backward never ran (no gradient flows through it) sees whatever
    # the latest backward left alive: carry that level down in backward order.
    level = 0
    bwd_peak = [0] * n
    for i in reversed(range(n)):
        if run.bwd_peak[i] >= 0:
            bwd_peak[i] = run.bwd_peak[i]
            level = run.bwd_level_after[i] if run.bwd_level_after[i] >= 0 else level
        else:
            bwd_peak[i] = level
    costs = []
    for i, node in enumerate(op_nodes):
        fwd_tmp = run.fwd_peak[i] - saved_before[i] - run.fwd_out[i]
        bwd_tmp = bwd_peak[i] - saved_before[i + 1] - run.bwd_out[i]
        extra = run.extra.get(i)
        fwd_flop, bwd_flop = run.fwd_flop[i], run.bwd_flop[i]
        if extra is not None:
            fwd_flop += extra.fwd_flop
            # No backward FLOPs where no gradient flowed through the operation.
            bwd_flop += extra.bwd_flop if run.bwd_peak[i] >= 0 else 0
        costs.append(
            OpCost(
                name=node.name,
                fwd_out_bytes=run.fwd_out[i],
                fwd_tmp_bytes=max(0, fwd_tmp),
                saved_bytes=run.saved[i],
                bwd_out_bytes=run.bwd_out[i],
                bwd_tmp_bytes=max(0, bwd_tmp),
                fwd_flop=fwd_flop,
                bwd_flop=bwd_flop,
                fwd_peak_bytes=run.fwd_peak[i],
                bwd_peak_bytes=bwd_peak[i],
                out_storage_bytes=tuple(run.out_storages[i]),
                reads=tuple(run.reads[i]),
            )
        )
    return costs
