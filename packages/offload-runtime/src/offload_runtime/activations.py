"""What happens to the tensors a region's forward saves for its backward.

The plan gives each region an :class:`ActivationPlacement`. KEEP leaves saved tensors to
autograd, as plain training does. RECOMPUTE and HOST take them over through the
controller's saved-tensor hooks: the controller pushes its hooks while such a region's
forward runs and passes every tensor packed there to :meth:`SavedActivations.pack`, and
every packed value unpacked in backward to :meth:`SavedActivations.unpack`.

Parameters (any view of a region's device parameters) and the module's buffers are never
taken over: the module holds them anyway, and the controller already uploads an offloaded
region's parameters again before its backward unpacks them.

[Note: recomputed regions]
Mechanism: saved-tensor hooks over the region's op range of the one traced graph, the
scheme of torch.utils.checkpoint with ``use_reentrant=False, preserve_rng_state=True``.
The graph is not split per region: its offload nodes and op-range indices stay as they
are, and the controller's hooks (the upload before a region's backward, the counts of
frozen parameters) keep seeing the region's saves, which the hooks of a nested
``checkpoint`` call would hide from them.

Forward: a node the graph pass puts right before region ``r``'s first operation
(``offload_activations``) opens a *frame* that records the values the region's operations
read from outside it (its inputs, parameters read by ``get_attr`` included), the CPU and
device random-number states and the autocast setting. Each tensor the region then saves,
other than a parameter or buffer, is dropped: autograd keeps a :class:`_Handle` (the
frame and the tensor's position among the region's saves) instead.

Backward: the controller's unpack hook first runs ``pre_backward`` for the region (so an
offloaded region's parameters are uploaded again), then hands the handle here. The first
handle unpacked runs the region's fx nodes again (an ``Interpreter`` over the op range)
from detached copies of the inputs that require grad as the originals did, under the
recorded random-number states (restored afterwards, so the generators end where plain
training leaves them) and autocast setting, with grad enabled and hooks that keep the
tensors saved at the dropped positions. Each recomputed tensor is handed to the backward
once and forgotten, so they are freed as the backward proceeds; a second backward through
a retained graph recomputes again. The frame lives as long as autograd holds a handle to
it. A recomputation that saves a different number of tensors than the forward did is an
error; a region with an operation that may write in place into one of its inputs is
refused when the graph pass registers it (a recomputation would read the changed value).

[Note: recomputed runs]
A RECOMPUTE region followed by RECOMPUTE_WITH_PREVIOUS regions is one *run*: the graph
pass registers one program over the op range from the run's first region to its last and
puts one frame node before the first, which records the values the whole run reads from
outside it. The later regions' saves land in that frame, counted on in forward order, so
the first unpack (in the last region's backward) recomputes the whole run once and every
region of it then takes its own tensors. The plan keeps the parameters of every region of
a run but the last resident (``offload_solver.check_activation_runs``); the controller
starts the last region's backward (its upload) before the run is recomputed, whichever
region's tensor is unpacked first.

[Note: activations in host memory]
Region ``r`` with HOST keeps the tensors it saves in its frame during the forward (one
copy per tensor object, however often it is saved). When its forward ends, the frame
copies them to (pinned, on CUDA) host memory on the d2h stream, after the compute work
queued so far, and drops the device tensors. The copy back is issued on the h2d stream
when the backward of region ``r + 1`` (the next in forward order, whose backward comes
just before ``r``'s) starts, or at ``r``'s first unpack at the latest; each unpack makes
the compute stream wait for that copy's event. A device copy is dropped after its last
unpack; the host copies live as long as the frame. On the CPU the copies are host to
host and the events no-ops.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import fx
from torch._C._autograd import (
    _pop_saved_tensors_default_hooks,
    _push_saved_tensors_default_hooks,
)

from offload_runtime.storage import RegionStorage
from offload_runtime.streams import Event, StreamSet
from offload_solver import ActivationPlacement, Plan


class _Program:
    """Region ``region``'s operations in one graph: the nodes from ``first`` to ``last``
    (marker nodes skipped) and the outside nodes they read, in the order their values are
    passed to :meth:`SavedActivations.begin_region`."""

    def __init__(
        self, gm: fx.GraphModule, region: int, first: fx.Node, last: fx.Node, skip: set[Any]
    ) -> None:
        self.region = region
        self.body: list[fx.Node] = []
        node = first
        while True:
            if not (node.op == "call_function" and node.target in skip):
                self.body.append(node)
            if node is last:
                break
            node = node.next
        inside = set(self.body)
        inputs: dict[fx.Node, None] = {}
        for node in self.body:
            for arg in node.all_input_nodes:
                if arg not in inside:
                    inputs[arg] = None
        self.inputs = list(inputs)
        for node in self.body:
            schema = getattr(node.target, "_schema", None)
            if (
                schema is not None
                and schema.is_mutable
                and set(node.all_input_nodes) & inputs.keys()
            ):
                raise ValueError(
                    f"region {region} cannot be recomputed: its operation {node.name} "
                    f"({node.target}) may write into a value the region reads from outside, "
                    "which a recomputation would read changed; keep its activations instead"
                )
        # Values a recomputation can drop after each body node: those it reads for the
        # last time there, and its own result when nothing later in the region reads it
        # (what a recomputation needs are the saved tensors, which its hooks hold).
        final_use: dict[fx.Node, fx.Node] = {}
        for node in self.body:
            final_use[node] = node
            for arg in node.all_input_nodes:
                final_use[arg] = node
        self.drop_after: list[list[fx.Node]] = [[] for _ in self.body]
        position = {node: i for i, node in enumerate(self.body)}
        for value, user in final_use.items():
            self.drop_after[position[user]].append(value)
        self.interpreter = fx.Interpreter(gm, garbage_collect_values=False)


class _Frame:
    """One forward of one RECOMPUTE or HOST region (see the notes in the module doc)."""

    def __init__(self, region: int, mode: ActivationPlacement) -> None:
        self.region = region
        self.mode = mode
        self.saves = 0
        """Tensors packed so far (recompute: every save, kept or dropped, in order)."""
        # RECOMPUTE
        self.program: _Program | None = None
        self.inputs: tuple[Any, ...] = ()
        self.rng: tuple[torch.Tensor, torch.Tensor | None] | None = None
        self.autocast: torch.dtype | None = None
        """The device's autocast dtype where the forward ran under autocast."""
        self.dropped: set[int] = set()
        self.recomputed: dict[int, torch.Tensor] = {}
        # HOST
        self.index_of: dict[int, int] = {}  # id(tensor) -> position, during the forward
        self.device: list[torch.Tensor | None] = []
        self.host: list[torch.Tensor] = []
        self.uses: list[int] = []
        self.down: Event | None = None
        self.up: Event | None = None
        self.fetched = False


class _Handle:
    """What autograd holds in place of a saved tensor that a frame took over."""

    __slots__ = ("frame", "index")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index


class SavedActivations:
    """Executes the plan's activation placements (see the notes in the module doc)."""

    def __init__(self, plan: Plan, storages: Sequence[RegionStorage], streams: StreamSet) -> None:
        self.modes = [ActivationPlacement.KEEP] * len(storages)
        for rp in plan.regions:
            self.modes[rp.region.index] = rp.activations
        self.run_end: dict[int, int] = {}
        """Per recomputed region, the last region of its run (itself unless regions are
        recomputed with it; see [Note: recomputed runs])."""
        start = -1
        for r, mode in enumerate(self.modes):
            if mode is ActivationPlacement.RECOMPUTE:
                start = r
            elif mode is not ActivationPlacement.RECOMPUTE_WITH_PREVIOUS:
                continue
            for q in range(start, r + 1):
                self.run_end[q] = r
        self.streams = streams
        self.device = streams.device
        self._fixed: set[int] = {
            st.device_params.untyped_storage().data_ptr() for st in storages if st.numel
        }
        self._programs: list[_Program] = []
        self._open: dict[int, _Frame] = {}
        # HOST frames offloaded and not yet fetched, per region.
        self._on_host: dict[int, list[weakref.ref[_Frame]]] = {}
        # Frames of recent forwards, for held_tensors().
        self._recent: list[weakref.ref[_Frame]] = []
        self.stats = {"recomputes": 0, "host_copies_down": 0, "host_copies_up": 0}

    @property
    def active(self) -> bool:
        return any(m is not ActivationPlacement.KEEP for m in self.modes)

    def hooked(self, r: int) -> bool:
        """Whether region ``r``'s forward needs the controller's saved-tensor hooks: it
        takes over its saved tensors, or its backward start fetches region ``r - 1``'s."""
        if self.modes[r] is not ActivationPlacement.KEEP:
            return True
        return r > 0 and self.modes[r - 1] is ActivationPlacement.HOST

    def keep_storages(self, tensors: Iterable[torch.Tensor]) -> None:
        """Never take over tensors that share storage with ``tensors`` (the module's
        buffers): something else holds them for the whole step."""
        self._fixed.update(t.untyped_storage().data_ptr() for t in tensors)

    def fixed(self, t: torch.Tensor) -> bool:
        """Whether saved tensor ``t`` is left to autograd in every placement: a parameter
        or buffer (or a view of one), or not a strided tensor of the module's device."""
        if t.layout is not torch.strided or t.device != self.device:
            return True
        return t.untyped_storage().data_ptr() in self._fixed

    def add_program(
        self, gm: fx.GraphModule, region: int, first: fx.Node, last: fx.Node, skip: set[Any]
    ) -> tuple[int, list[fx.Node]]:
        """Register region ``region``'s op range ``first..last`` of ``gm`` (nodes whose
        target is in ``skip`` are markers, not operations); returns the program's id and
        the outside nodes whose values the frame node must pass."""
        program = _Program(gm, region, first, last, skip)
        self._programs.append(program)
        return len(self._programs) - 1, program.inputs

    # ---- forward ------------------------------------------------------------------------

    def begin_region(self, r: int, program: int, inputs: tuple[Any, ...]) -> None:
        """Open region ``r``'s frame before its first operation (graph node)."""
        if not torch.is_grad_enabled():
            return
        frame = _Frame(r, self.modes[r])
        if frame.mode is ActivationPlacement.RECOMPUTE:
            frame.program = self._programs[program]
            frame.inputs = inputs
            cuda = torch.cuda.get_rng_state(self.device) if self.streams.is_cuda else None
            frame.rng = (torch.get_rng_state(), cuda)
            kind = self.device.type
            if torch.is_autocast_enabled(kind):
                frame.autocast = torch.get_autocast_dtype(kind)
            # The regions recomputed with this one save into the same frame.
            for q in range(r + 1, self.run_end[r] + 1):
                self._open[q] = frame
        self._open[r] = frame
        self._recent = [ref for ref in self._recent if ref() is not None]
        self._recent.append(weakref.ref(frame))

    def pack(self, r: int, t: torch.Tensor) -> Any:
        frame = self._open.get(r)
        if frame is None:
            return t
        index = frame.saves
        if frame.mode is ActivationPlacement.RECOMPUTE:
            frame.saves += 1
            if self.fixed(t):
                return t
            frame.dropped.add(index)
            return _Handle(frame, index)
        if self.fixed(t):
            return t
        known = frame.index_of.get(id(t))
        if known is None:
            known = frame.index_of[id(t)] = index
            frame.saves += 1
            frame.device.append(t)
            frame.uses.append(0)
        frame.uses[known] += 1
        return _Handle(frame, known)

    def end_forward(self, r: int) -> None:
        """After region ``r``'s last operation: close its frame; a HOST frame's tensors
        go to host memory."""
        frame = self._open.pop(r, None)
        if frame is None or frame.mode is not ActivationPlacement.HOST:
            return
        frame.index_of.clear()
        if not frame.device:
            return
        streams = self.streams
        d2h = streams.d2h
        d2h.wait(streams.compute.record())
        with d2h.context(), torch.no_grad():
            for t in frame.device:
                assert t is not None
                host = torch.empty_like(t, device="cpu", pin_memory=streams.is_cuda)
                host.copy_(t, non_blocking=True)
                frame.host.append(host)
                if streams.is_cuda:
                    t.record_stream(d2h.cuda)  # type: ignore[arg-type]
            frame.down = d2h.record()
        frame.device = [None] * len(frame.host)
        self.stats["host_copies_down"] += len(frame.host)
        self._on_host.setdefault(r, []).append(weakref.ref(frame))

    def close_frames(self) -> None:
        """After a forward: forget frames a forward that raised left open, so that no
        later save lands in them."""
        self._open.clear()

    # ---- backward -----------------------------------------------------------------------

    def before_backward(self, r: int) -> None:
        """Region ``r``'s backward starts: bring back the host tensors of region ``r - 1``
        (whose backward comes next) and of ``r`` itself, if not yet on their way."""
        for q in (r - 1, r):
            for ref in self._on_host.pop(q, ()):
                frame = ref()
                if frame is not None and not frame.fetched:
                    self._fetch(frame, range(len(frame.host)))

    def _fetch(self, frame: _Frame, indices: Iterable[int]) -> None:
        h2d = self.streams.h2d
        h2d.wait(frame.down)
        with h2d.context(), torch.no_grad():
            for i in indices:
                host = frame.host[i]
                dev = torch.empty_like(host, device=self.device)
                dev.copy_(host, non_blocking=True)
                frame.device[i] = dev
                self.stats["host_copies_up"] += 1
            frame.up = h2d.record()
        frame.fetched = True

    def unpack(self, packed: Any) -> torch.Tensor:
        if not isinstance(packed, _Handle):
            return packed  # type: ignore[no-any-return]
        frame, i = packed.frame, packed.index
        if frame.mode is ActivationPlacement.RECOMPUTE:
            if i not in frame.recomputed:
                self._recompute(frame)
            return frame.recomputed.pop(i)
        if not frame.fetched or frame.device[i] is None:
            # Not brought back ahead (or consumed by an earlier backward of a retained
            # graph): fetch it now.
            self._fetch(frame, [i])
        self.streams.compute.wait(frame.up)
        t = frame.device[i]
        assert t is not None
        if self.streams.is_cuda:
            t.record_stream(self.streams.compute.cuda)  # type: ignore[arg-type]
        frame.uses[i] -= 1
        if frame.uses[i] <= 0:
            frame.device[i] = None
        return t

    def _recompute(self, frame: _Frame) -> None:
        program = frame.program
        assert program is not None and frame.rng is not None
        env: dict[fx.Node, Any] = {}
        for node, value in zip(program.inputs, frame.inputs, strict=True):
            if isinstance(value, torch.Tensor):
                value = value.detach().requires_grad_(value.requires_grad)
            env[node] = value
        position = 0
        wanted = frame.dropped

        def keep(t: torch.Tensor) -> None:
            nonlocal position
            if position in wanted:
                frame.recomputed[position] = t
            position += 1

        def never(_: None) -> torch.Tensor:
            raise RuntimeError("a recomputation's own graph is never run backward")

        cpu_state, cuda_state = frame.rng
        devices = [self.device] if cuda_state is not None else []
        interpreter = program.interpreter
        kind = self.device.type
        cast = torch.autocast(kind, frame.autocast or torch.float32, frame.autocast is not None)
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), cast:
            torch.set_rng_state(cpu_state)
            if cuda_state is not None:
                torch.cuda.set_rng_state(cuda_state, self.device)
            _push_saved_tensors_default_hooks(keep, never)
            try:
                interpreter.env = env
                for node, drop in zip(program.body, program.drop_after, strict=True):
                    env[node] = interpreter.run_node(node)
                    for value in drop:
                        del env[value]
            finally:
                _pop_saved_tensors_default_hooks()
                interpreter.env = {}
        if position != frame.saves:
            raise RuntimeError(
                f"recomputing region {frame.region} saved {position} tensors where its "
                f"forward saved {frame.saves}: the region's operations are not "
                "deterministic in what they save, so it cannot be recomputed"
            )
        self.stats["recomputes"] += 1

    # ---- introspection ------------------------------------------------------------------

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(device, host) tensors that frames of live autograd graphs hold now: a
        RECOMPUTE frame's tensor inputs (not parameters or buffers) and recomputed
        tensors not yet used, a HOST
        frame's device tensors (during its forward, or brought back) and host copies."""
        device: list[torch.Tensor] = []
        host: list[torch.Tensor] = []
        for ref in self._recent:
            frame = ref()
            if frame is None:
                continue
            device += [v for v in frame.inputs if isinstance(v, torch.Tensor) and not self.fixed(v)]
            device += frame.recomputed.values()
            device += [t for t in frame.device if t is not None]
            host += frame.host
        return device, host


def log_activations(plan: Plan, log: logging.Logger) -> None:
    """One INFO line per region whose activations are not kept on the device, and a
    summary line."""
    counts = dict.fromkeys(ActivationPlacement, 0)
    for rp in plan.regions:
        counts[rp.activations] += 1
        if rp.activations is ActivationPlacement.RECOMPUTE:
            log.info(
                "activations: region %d drops what its forward saves and recomputes it "
                "before its backward",
                rp.region.index,
            )
        elif rp.activations is ActivationPlacement.RECOMPUTE_WITH_PREVIOUS:
            log.info(
                "activations: region %d drops what its forward saves; it is recomputed "
                "with region %d, from the inputs of their run",
                rp.region.index,
                rp.region.index - 1,
            )
        elif rp.activations is ActivationPlacement.HOST:
            log.info(
                "activations: region %d moves what its forward saves to host memory and "
                "back before its backward",
                rp.region.index,
            )
    log.info(
        "activations: %d regions keep them on the device, %d recompute them in %d runs, "
        "%d hold them in host memory",
        counts[ActivationPlacement.KEEP],
        counts[ActivationPlacement.RECOMPUTE] + counts[ActivationPlacement.RECOMPUTE_WITH_PREVIOUS],
        counts[ActivationPlacement.RECOMPUTE],
        counts[ActivationPlacement.HOST],
    )
