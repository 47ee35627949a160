"""OffloadModule: the traced, rewritten model that trains under the plan."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping
from typing import Any

import torch
from torch import fx

from offload_runtime.activations import log_activations
from offload_runtime.attr_reads import flatten_attribute_reads
from offload_runtime.config import OffloadConfig
from offload_runtime.controller import OffloadController
from offload_runtime.distributed import Sharding
from offload_runtime.inputs import InputSpec
from offload_runtime.passes import META_CONTROLLER, META_OP_NAMES, apply_plan, register_controller
from offload_runtime.storage import RegionStorage, build_storage
from offload_runtime.streams import make_streams
from offload_solver import BUDGET_SAFETY_FACTOR, HardwareProfile, ModelProfile, Plan

log = logging.getLogger(__name__)


def _set_attr(gm: torch.nn.Module, target: str, value: torch.Tensor, *, buffer: bool) -> None:
    owner_path, _, leaf = target.rpartition(".")
    owner = gm.get_submodule(owner_path) if owner_path else gm
    if buffer:
        owner._buffers[leaf] = value
    else:
        assert isinstance(value, torch.nn.Parameter)
        owner._parameters[leaf] = value


class OffloadModule:
    """A model whose parameters move between host and device as its plan says.

    Call it like the original model; run ``backward(loss)`` (or ``loss.backward()``);
    read full-precision gradients with :meth:`named_gradients`, or train it with an
    optimizer over :meth:`parameters` (the fp32 master weights). ``state_dict`` holds
    ordinary full-precision CPU tensors under the original parameter names.
    """

    def __init__(
        self,
        *,
        plan: Plan,
        graph_train: fx.GraphModule,
        graph_eval: fx.GraphModule,
        param_targets: Mapping[str, str],
        canonical: Mapping[str, str],
        buffers: Mapping[str, torch.Tensor],
        state: Mapping[str, torch.Tensor],
        device: torch.device,
        dtype: torch.dtype,
        op_names: tuple[str, ...],
        tied_groups: tuple[tuple[str, ...], ...] = (),
        host_worker: bool | None = None,
        config: OffloadConfig | None = None,
    ) -> None:
        if config is None:
            config = OffloadConfig(dtype=dtype)
        if config.dtype != dtype:
            raise ValueError(
                f"the module trains in {dtype} but its OffloadConfig says {config.dtype}; "
                "build it with one dtype"
            )
        self.config = config
        """The user's choices the module was planned with (the optimizer reads its host
        moments and accumulation steps here); ``OffloadConfig(dtype=dtype)`` for a module
        built from a plan made by hand."""
        self.plan = plan
        self.device = device
        self.dtype = dtype
        self.training = True
        self.profile: ModelProfile | None = None
        """The traced model profile the plan was made from, when built by the planner."""
        self.hardware: HardwareProfile | None = None
        """The hardware profile the plan was solved on, when built by the planner."""
        self.inputs: InputSpec | None = None
        """The input tensors the model was traced with, when built by the planner: a call
        with others is refused (:meth:`InputSpec.check_call`)."""
        self.opaque_modules: tuple[str, ...] = ()
        """Paths of the model's modules that torch.export could not capture, each run as
        one opaque operation whose forward is recomputed in backward (see [Note: opaque
        operations] in ``offload_trace/_opaque.py``), when built by the planner."""
        self._canonical = dict(canonical)
        shapes = {name: torch.Size(state[name].shape) for name in set(canonical.values())}
        # A parameter no operation of the training graph reads (export keeps an attribute
        # read without users for it) gets no gradient, as a frozen one: it
        # is laid out and stepped as frozen (no gradient link, no optimizer state, as
        # torch's AdamW skips a parameter whose .grad stays None), so that its region's
        # backward is complete without it and the region releases its pool slot.
        read = {
            canonical[param_targets[node.target]]
            for node in graph_train.graph.nodes
            if node.op == "get_attr" and node.target in param_targets and node.users
        }
        requires_grad = {
            name: bool(state[name].requires_grad) and (name in read or not read) for name in shapes
        }
        options = plan.options
        if options.fp16_io and dtype != torch.float16:
            raise ValueError(
                f"the plan steps host regions by fp16 I/O (PlanOptions.fp16_io), which reads "
                f"fp16 gradients, but the module trains in {dtype}: plan fp16 I/O for float16 "
                "training only"
            )
        convert_on_device = options.convert_on_device
        self.convert_on_device = convert_on_device
        """Host-state regions convert dtypes on the device (the plan's
        ``PlanOptions.convert_on_device``; see ``OffloadController``)."""
        self.storages, self.pool = build_storage(
            plan,
            shapes,
            tied_groups,
            requires_grad,
            device,
            dtype,
            convert_on_device=convert_on_device,
            host_master_dtype=dtype if config.bf16_master else torch.float32,
            moment_bytes=config.host_moment_bytes,
        )
        self._by_name: dict[str, RegionStorage] = {}
        for st in self.storages:
            for layout in st.layouts:
                self._by_name[layout.name] = st
        missing = sorted(set(shapes) - set(self._by_name))
        if missing:
            raise ValueError(f"the plan's regions do not cover parameters {missing[:5]}")
        for st in self.storages:
            st.load(state)
        self.streams = make_streams(device)
        # Batched device gradients keep each device-state region's training-dtype gradients
        # alive until backward ends: only where the plan leaves room for all of them.
        device_grad_bytes = sum(
            st.numel * dtype.itemsize
            for st in self.storages
            if not st.host_state and not st.offloaded
        )
        room = plan.budget_bytes * BUDGET_SAFETY_FACTOR - plan.predicted_peak_bytes
        self.controller = OffloadController(
            plan,
            self.storages,
            self.streams,
            host_worker=host_worker,
            batch_device_grads=device_grad_bytes <= room,
            convert_on_device=convert_on_device,
        )
        # fp16 I/O: a host-state region's fp16 gradient stays in its pinned staging buffer,
        # where the host step reads it ([Note: fp16 I/O steps] in offload_optim/stepping.py).
        # So too on a bf16-master rung: the step reads the bf16 gradient where it landed.
        self.sharding: Sharding | None = None
        """Which rank steps each region under data parallel (``distributed.py``); None with
        one process."""
        self.controller.keep_staged_grads = options.fp16_io or config.bf16_master
        key = register_controller(self.controller)
        # The trace ran floating buffers in the training dtype; the graph expects them so.
        self._buffers = {
            name: b.to(device, dtype if b.is_floating_point() else b.dtype)
            for name, b in buffers.items()
        }
        self.controller.activations.keep_storages(self._buffers.values())
        log_activations(plan, log)
        for gm in (graph_train, graph_eval):
            for target, original in param_targets.items():
                canon = self._canonical[original]
                _set_attr(gm, target, self._by_name[canon].params[canon], buffer=False)
            for name, buf in self._buffers.items():
                _set_attr(gm, name, buf, buffer=True)
            gm.meta[META_OP_NAMES] = op_names
            gm.meta[META_CONTROLLER] = key
            apply_plan(gm, plan)
            flatten_attribute_reads(gm)
        self._graph_train = graph_train
        self._graph_eval = graph_eval

    # ---- running --------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise RuntimeError("this OffloadModule was closed (its device memory is freed)")
        if self.inputs is not None:
            self.inputs.check_call(args, kwargs)
        gm = self._graph_train if self.training else self._graph_eval
        try:
            out = gm(*args, **kwargs)
        finally:
            self.controller.pop_all_hooks()
        if torch.is_grad_enabled():
            self.controller.watch_outputs(out)
        return out

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()``; gradients then reach the fp32 accumulators region by region."""
        loss.backward()  # type: ignore[no-untyped-call]

    def train(self, mode: bool = True) -> OffloadModule:
        self.training = mode
        return self

    def eval(self) -> OffloadModule:
        return self.train(False)

    # ---- parameters and gradients ---------------------------------------------------

    def named_parameters(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The fp32 master weights by original name (tied aliases listed once).

        Waits for optimizer steps still running on the host worker first (a host sync
        point only while they run), so that the masters read are the stepped ones.
        """
        self.controller.wait_host()
        for st in self.storages:
            for layout in st.layouts:
                yield layout.name, st.master_views[layout.name]

    def parameters(self) -> Iterator[torch.Tensor]:
        """The fp32 master weights, frozen ones included (as ``nn.Module.parameters``);
        ``HybridAdam`` keeps no state for frozen ones and never steps them."""
        for _, p in self.named_parameters():
            yield p

    def named_gradients(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full-precision gradients by original name, every tied alias included; frozen
        parameters (``requires_grad=False``) have none and are left out, and so are those
        of regions another data-parallel rank steps (``sharding``).

        Waits for host-side gradient work first (a host sync point).
        """
        self.controller.wait_host()
        for st in self.storages:
            st.materialize_grad()
            for layout in st.layouts:
                if layout.name not in st.grad_views or not layout.requires_grad:
                    continue  # frozen, or stepped by another rank: no gradient here
                for alias in layout.aliases:
                    yield alias, st.grad_views[layout.name]

    def zero_grad(self) -> None:
        """Zero the fp32 gradient accumulators (waits for pending host work).

        The buffers are marked stale rather than cleared: the next backward overwrites them.
        """
        self.controller.wait_host()
        for st in self.storages:
            st.grad_stale = True
            for name, master in st.master_views.items():
                if name not in st.frozen and name in st.grad_views:
                    master.grad = st.grad_views[name]

    def named_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from self._buffers.items()

    # ---- checkpoints ----------------------------------------------------------------

    def state_dict(self) -> dict[str, torch.Tensor]:
        """fp32 CPU copies of every parameter (all tied names) and every buffer."""
        self.controller.wait_host()
        out: dict[str, torch.Tensor] = {}
        for st in self.storages:
            for layout in st.layouts:
                value = st.master_views[layout.name].detach().to("cpu", copy=True)
                for alias in layout.aliases:
                    out[alias] = value
        for name, buf in self._buffers.items():
            out[name] = buf.detach().to("cpu", copy=True)
        return out

    def load_state_dict(self, state: Mapping[str, torch.Tensor], strict: bool = True) -> None:
        """Load parameters (any tied name) and buffers; publishes the new weights."""
        self.controller.wait_host()
        if self.streams.is_cuda:
            torch.cuda.synchronize(self.device)  # uploads may still read the host copies
        by_canon: dict[str, torch.Tensor] = {}
        unknown = []
        for name, value in state.items():
            if name in self._canonical:
                by_canon[self._canonical[name]] = value
            elif name in self._buffers:
                with torch.no_grad():
                    self._buffers[name].copy_(value)
            else:
                unknown.append(name)
        missing = sorted(set(self._by_name) - set(by_canon))
        if strict and (unknown or missing):
            raise ValueError(
                f"load_state_dict: unexpected keys {sorted(unknown)[:5]}, missing keys "
                f"{missing[:5]}; pass strict=False to load a subset"
            )
        for st in self.storages:
            subset = {
                layout.name: by_canon[layout.name]
                for layout in st.layouts
                if layout.name in by_canon
            }
            if len(subset) == len(st.layouts):
                st.load(subset)
            elif subset:
                with torch.no_grad():
                    for name, value in subset.items():
                        st.master_views[name].copy_(value)
                    st.publish_now()

    # ---- introspection --------------------------------------------------------------

    @property
    def graph_module(self) -> fx.GraphModule:
        """The rewritten graph run in training mode."""
        return self._graph_train

    def close(self) -> None:
        """Stop the host worker thread and free the module's device memory.

        Waits for queued host work first, and re-raises its first error after freeing. The
        module cannot run afterwards (its parameters are empty); save ``state_dict()``
        before closing to keep the weights. Closing twice is harmless.
        """
        try:
            self.controller.close()
        finally:
            self._free_device_memory()

    def _free_device_memory(self) -> None:
        if self.closed:
            return
        self.closed = True
        with torch.no_grad():
            empty = torch.empty(0, dtype=self.dtype, device=self.device)
            for st in self.storages:
                for param in st.params.values():
                    param.grad = None
                    param.data = empty
                st.device_params = empty
            self.pool = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    closed = False
    """Set by :meth:`close`: the device buffers are gone."""
