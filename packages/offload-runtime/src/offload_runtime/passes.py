"""Graph passes that insert a plan's offload operations into a traced forward graph.

Each pass is a free function ``(GraphModule, Plan) -> GraphModule`` that edits the graph in
place, recompiles it, logs what it inserted and returns it. The inserted nodes call
module-level functions (a ``call_function`` target must be a plain function to generate
code) that find the module's :class:`OffloadController` through a registry key stored in
``gm.meta``, together with the graph's operation names (``gm.meta["offload_op_names"]``)
that the plan's region op ranges index into.

Backward needs no nodes: the controller's saved-tensor and gradient hooks drive it.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable
from typing import Any

from torch import fx

from offload_runtime.controller import OffloadController
from offload_solver import ActivationPlacement, ParamPlacement, Plan, StatePlacement

log = logging.getLogger(__name__)

META_OP_NAMES = "offload_op_names"
META_CONTROLLER = "offload_controller_key"

_CONTROLLERS: dict[int, weakref.ref[OffloadController]] = {}


def register_controller(controller: OffloadController) -> int:
    """Make ``controller`` reachable from inserted graph nodes; returns its key."""
    key = id(controller)
    _CONTROLLERS[key] = weakref.ref(controller, lambda _: _CONTROLLERS.pop(key, None))
    return key


def _controller(key: int) -> OffloadController:
    ref = _CONTROLLERS.get(key)
    controller = ref() if ref is not None else None
    if controller is None:
        raise RuntimeError(
            "this graph belongs to an OffloadModule that no longer exists; run it through "
            "its OffloadModule"
        )
    return controller


def offload_enter(key: int, region: int) -> None:
    """Before region ``region``'s forward: make its parameters usable, arm backward hooks."""
    _controller(key).begin_forward(region)


def offload_exit(key: int, region: int) -> None:
    """After region ``region``'s forward: disarm hooks and release an offloaded region."""
    _controller(key).end_forward(region)


def offload_prefetch(key: int, region: int) -> None:
    """Queue region ``region``'s upload on the h2d stream."""
    _controller(key).prefetch(region)


def offload_activations(key: int, region: int, program: int, *inputs: Any) -> None:
    """Before region ``region``'s first operation: open the frame that takes over what it
    saves, with the values it reads from outside (see [Note: recomputed regions] in
    activations.py)."""
    _controller(key).activations.begin_region(region, program, inputs)


# Inserted nodes have no users; mark them impure so dead-code elimination keeps them.
for _fn in (offload_enter, offload_exit, offload_prefetch, offload_activations):
    fx.node.has_side_effect(_fn)


def _op_nodes(gm: fx.GraphModule) -> dict[str, fx.Node]:
    return {n.name: n for n in gm.graph.nodes}


def _region_bounds(gm: fx.GraphModule, plan: Plan, r: int) -> tuple[fx.Node, fx.Node]:
    names: tuple[str, ...] = gm.meta[META_OP_NAMES]
    region = plan.regions[r].region
    nodes = _op_nodes(gm)
    try:
        return nodes[names[region.op_start]], nodes[names[region.op_end - 1]]
    except (KeyError, IndexError) as exc:
        raise ValueError(
            f"plan region {r} (operations {region.op_start}..{region.op_end - 1}) does not "
            f"match this graph ({len(names)} operations): was the plan made for another "
            "trace of the model?"
        ) from exc


def _has_marker(gm: fx.GraphModule, fn: object, region: int) -> bool:
    return any(
        n.op == "call_function" and n.target is fn and n.args[1] == region for n in gm.graph.nodes
    )


def _insert_enter_exit(gm: fx.GraphModule, plan: Plan, regions: Iterable[int]) -> list[int]:
    key: int = gm.meta[META_CONTROLLER]
    inserted = []
    for r in regions:
        if _has_marker(gm, offload_enter, r):
            continue
        first, last = _region_bounds(gm, plan, r)
        with gm.graph.inserting_before(first):
            gm.graph.call_function(offload_enter, (key, r))
        with gm.graph.inserting_after(last):
            gm.graph.call_function(offload_exit, (key, r))
        inserted.append(r)
    return inserted


def _first_op(gm: fx.GraphModule) -> fx.Node:
    for n in gm.graph.nodes:
        if n.op not in ("placeholder", "get_attr"):
            return n  # type: ignore[no-any-return]
    raise ValueError("graph has no operations")


def insert_sync_ops(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """SYNC regions: upload before first use, release after the region's forward.

    The backward re-upload happens in the region's saved-tensor unpack hook, armed by the
    inserted enter node.
    """
    regions = [rp.region.index for rp in plan.regions if rp.placement is ParamPlacement.SYNC]
    inserted = _insert_enter_exit(gm, plan, regions)
    gm.recompile()
    log.info("sync pass: upload/release around %d regions %s", len(inserted), inserted)
    return gm


def insert_async_ops(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """ASYNC regions: prefetch one region ahead on the h2d stream, wait before use.

    Region ``i``'s forward prefetch is queued when region ``i - 1``'s forward starts (at the
    start of the graph for region 0). Its backward prefetch is queued when the backward of
    region ``prefetch_at`` starts, so that region gets enter/exit nodes too.
    """
    key: int = gm.meta[META_CONTROLLER]
    asyn = [rp.region.index for rp in plan.regions if rp.placement is ParamPlacement.ASYNC]
    hosts = sorted(
        {
            rp.prefetch_at
            for rp in plan.regions
            if rp.placement is ParamPlacement.ASYNC and rp.prefetch_at is not None
        }
    )
    for i in asyn:
        anchor = _first_op(gm) if i == 0 else _region_bounds(gm, plan, i - 1)[0]
        with gm.graph.inserting_before(anchor):
            gm.graph.call_function(offload_prefetch, (key, i))
    inserted = _insert_enter_exit(gm, plan, [*asyn, *hosts])
    gm.recompile()
    log.info(
        "async pass: %d forward prefetches, wait/release around %d regions, backward "
        "prefetch triggers in regions %s",
        len(asyn),
        len(inserted),
        hosts,
    )
    return gm


def insert_state_ops(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Resident regions whose master lives on the host: before their forward, wait for the
    upload of the parameters that the last host optimizer step produced."""
    regions = [
        rp.region.index
        for rp in plan.regions
        if rp.placement is ParamPlacement.RESIDENT and rp.state is not StatePlacement.DEVICE
    ]
    inserted = _insert_enter_exit(gm, plan, regions)
    gm.recompile()
    log.info("state pass: updated-parameter waits before %d resident regions", len(inserted))
    return gm


def insert_activation_ops(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """Regions that do not keep their activations: the controller's saved-tensor hooks
    around their forward (enter/exit nodes), as around the forward of the region after a
    HOST region (its backward start brings the HOST region's tensors back), and a frame
    node right before the first operation of each HOST region and each run of recomputed
    regions, after its enter node, that opens the frame (for a run, with the values it
    reads from outside it; see the notes in activations.py)."""
    controller = _controller(gm.meta[META_CONTROLLER])
    acts = controller.activations
    hooked = [rp.region.index for rp in plan.regions if acts.hooked(rp.region.index)]
    _insert_enter_exit(gm, plan, hooked)
    framed = []
    markers = {offload_enter, offload_exit, offload_prefetch, offload_activations}
    for rp in plan.regions:
        r = rp.region.index
        if rp.activations in (
            ActivationPlacement.KEEP,
            ActivationPlacement.RECOMPUTE_WITH_PREVIOUS,
        ) or _has_marker(gm, offload_activations, r):
            # A region recomputed with the one before it saves into its run's frame.
            continue
        first, last = _region_bounds(gm, plan, r)
        # A HOST frame needs neither the region's operations nor their inputs.
        program = -1
        inputs: list[fx.Node] = []
        if rp.activations is ActivationPlacement.RECOMPUTE:
            # One program over the region's whole run ([Note: recomputed runs]).
            last = _region_bounds(gm, plan, acts.run_end[r])[1]
            program, inputs = acts.add_program(gm, r, first, last, markers)
        with gm.graph.inserting_before(first):
            gm.graph.call_function(
                offload_activations, (gm.meta[META_CONTROLLER], r, program, *inputs)
            )
        framed.append(r)
    gm.recompile()
    log.info("activation pass: frames before regions %s, saved-tensor hooks in %s", framed, hooked)
    return gm


def apply_plan(gm: fx.GraphModule, plan: Plan) -> fx.GraphModule:
    """All passes a plan needs, in order."""
    for pass_fn in (insert_sync_ops, insert_async_ops, insert_state_ops, insert_activation_ops):
        gm = pass_fn(gm, plan)
    return gm


def count_inserted(gm: fx.GraphModule) -> dict[str, int]:
    """How many offload nodes of each kind the graph holds (for logs and tests)."""
    out = {"enter": 0, "exit": 0, "prefetch": 0}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            if n.target is offload_enter:
                out["enter"] += 1
            elif n.target is offload_exit:
                out["exit"] += 1
            elif n.target is offload_prefetch:
                out["prefetch"] += 1
    return out


__all__ = [
    "apply_plan",
    "count_inserted",
    "insert_activation_ops",
    "insert_async_ops",
    "insert_state_ops",
    "insert_sync_ops",
    "offload_activations",
    "offload_enter",
    "offload_exit",
    "offload_prefetch",
    "register_controller",
]
