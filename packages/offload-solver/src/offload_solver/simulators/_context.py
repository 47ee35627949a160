"""What a simulation of one profile on one machine is told, costed once.

:class:`SimulationContext` turns a profile, a hardware profile and a cost model into
per-region and per-operation seconds and bytes (the step model's inputs, [Note: step
model] in ``_engine``), shared by every simulation a solve runs; :class:`RegionAssignment`
is what a simulation is told about one region.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from dataclasses import dataclass

from offload_solver.cost_model import CostModel
from offload_solver.hardware import HardwareProfile
from offload_solver.plan import (
    ActivationPlacement,
    ParamPlacement,
    Region,
    StatePlacement,
    StreamedStepCosts,
)
from offload_solver.profile import ModelProfile
from offload_solver.regions import (
    BLOCK_SEARCH_RANGE_BYTES,
    BLOCK_SEARCH_STEP_BYTES,
    RegionLayout,
    build_regions,
)
from offload_solver.simulators._activations import (
    StorageReads,
    activation_levels,
    approximate_boundary,
)
from offload_solver.simulators._timeline import KIND_GRAD_WIDEN

# [Note: issuing ahead]
# The host issues a pass's operations one after another, each costing it about
# ``op_overhead_s`` (Python, dispatcher, autograd recording, the launch); the device runs
# each operation once it is issued and the one before it is done (:func:`issued_starts`).
# With small kernels the device waits for the host and the pass takes the issue costs;
# with large ones the host runs ahead and the pass takes the kernels' time, operations
# that launch nothing (views, transposes, splits) costing the device nothing. A pass is
# priced so only in [Note: the backward beside the host]; every other pass prices each
# operation at the largest of its compute, its traffic and its issue cost, one after
# another, which charges views their issue cost even where the device is the bound.


# [Note: the backward beside the host]
# In a step with host-state regions the backward is issued beside work the probe behind
# ``op_overhead_s`` does not have: the regions' gradient hooks (per parameter, a copy down
# and its stream bookkeeping; per region, the overflow check's norms) and the host Adam's
# threads on every core, which slow the thread issuing the backward.
# ``CostModel.backward_issue_factor`` scales the backward's issue cost in such steps,
# and that backward is issued ahead of the device ([Note: issuing ahead]): priced per
# operation at the factor, a backward bound by its kernels would also pay the factor for
# views its kernels hide. A step whose regions all keep their state on the device keeps
# ``op_overhead_s``. The backward beside the host takes the longer of that pass and the
# pass priced alone (work beside it only slows the host; region by region the longer
# would count twice the views' issue that the loaded pass moves from one region to the
# next), so its price rises continuously from the factor 1, where the two agree. Not
# modelled: where in the backward the host steps run (the factor applies to the whole
# pass), and the forward beside the host.


def issued_starts(device_s: Sequence[float], issue_s: float) -> tuple[list[float], float]:
    """Start of each operation (device seconds ``device_s``, in the order they run) from
    the start of issuing, and the end of the last, when each is issued ``issue_s`` after
    the one before it and runs once issued and after the one before it ([Note: issuing
    ahead]). With ``issue_s`` 0 the operations run back to back."""
    starts: list[float] = []
    issued = done = 0.0
    for d in device_s:
        issued += issue_s
        start = max(done, issued)
        starts.append(start)
        done = start + d
    return starts, max(done, issued)


@dataclass(frozen=True)
class RegionAssignment:
    """What a simulation is told about one region (a plan's decision without the pool)."""

    placement: ParamPlacement = ParamPlacement.RESIDENT
    state: StatePlacement = StatePlacement.HOST
    prefetch_at: int | None = None
    """ASYNC only: the region whose backward start issues this region's backward prefetch."""


def check_speculative_params(value: int | None) -> int | None:
    """``value`` when it is a valid ``speculative_params`` (None, or a number of host-state
    parameters >= 0), else ValueError. Shared with offload_optim's ``AMPOptimizer``, which
    takes the same limit."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ValueError(f"speculative_params must be None or an int >= 0, got {value!r}")
    return value


class SimulationContext:
    """Per-region and per-operation costs of one profile on one machine, computed once.

    Build it with :meth:`build`; simulators and solvers share it across many simulations.
    """

    def __init__(
        self,
        profile: ModelProfile,
        hardware: HardwareProfile,
        layout: RegionLayout,
        *,
        host_step_after_backward: bool = False,
        speculative_step_cost: float = 1.0,
        micro_batches: int = 1,
        speculative_params: int | None = None,
        streamed: StreamedStepCosts | None = None,
        speculation_thread: bool = False,
        cost_model: CostModel | None = None,
    ):
        if not 1.0 <= speculative_step_cost < math.inf:
            raise ValueError(
                f"speculative_step_cost is {speculative_step_cost}; must be a finite ratio >= 1"
            )
        if isinstance(micro_batches, bool) or not isinstance(micro_batches, int):
            raise ValueError(f"micro_batches must be an int, got {micro_batches!r}")
        if micro_batches < 1:
            raise ValueError(f"micro_batches is {micro_batches}; an optimizer step needs >= 1")
        if streamed is not None and not isinstance(streamed, StreamedStepCosts):
            raise ValueError(f"streamed must be None or a StreamedStepCosts, got {streamed!r}")
        if cost_model is not None and not isinstance(cost_model, CostModel):
            raise ValueError(f"cost_model must be None or a CostModel, got {cost_model!r}")
        if not isinstance(speculation_thread, bool):
            raise ValueError(f"speculation_thread must be a bool, got {speculation_thread!r}")
        self.streamed = streamed
        """What the runtime moves and holds for a STREAMED region's device step (None: no
        region may be STREAMED). See [Note: streamed steps] in ``_engine``."""
        self.micro_batches = micro_batches
        """Forward and backward passes per optimizer step (gradient accumulation): see
        [Note: micro-batches] in ``_engine``."""
        self.profile = profile
        self.host_step_after_backward = host_step_after_backward
        """Host optimizer steps wait for the end of backward: what an optimizer does when
        the step needs a global answer first (the fp16 overflow check, computed on the
        device as backward runs). Regions whose gradients land after that step as they
        land, then the others in forward order. Otherwise each starts when its gradients
        land."""
        self.speculative_step_cost = speculative_step_cost
        """Cost of a host step taken in a gradient hook before backward ends, relative to a
        plain one: 1 when such steps are exact (bf16, fp32); an fp16 speculative step that
        also writes its undo data costs more (measure it with the optimizer's kernel)."""
        self.speculative_params = check_speculative_params(speculative_params)
        """Without ``host_step_after_backward``: how many trainable host-state parameters may step
        in their gradient hooks (None: all). Host-state regions qualify in the order their
        gradients land (the last in forward order first) until the first that would pass
        the limit; the others step after the last hook, as the runtime does for regions
        without speculative buffers (``PlanOptions.speculative_params``)."""
        self.speculation_thread = speculation_thread
        """Without ``host_step_after_backward``: the runtime runs the steps its gradient
        hooks take early on a thread of their own (``PlanOptions.speculation_thread``,
        which ``offload_runtime``'s planner sets for fp16 speculation), so the hooks, and
        ``step()`` after them, do not wait for them. See [Note: step model] in
        ``_engine``."""
        self.hardware = hardware
        """The machine's measurements."""
        self.cost_model = CostModel() if cost_model is None else cost_model
        """The fitted factors the simulation prices with (``CostModel()`` unless given)."""
        self.layout = layout
        self.regions: tuple[Region, ...] = layout.regions
        self.block_size_bytes = layout.block_size_bytes
        regions = self.regions
        self.num_regions = len(regions)
        self.size = [r.size_bytes for r in regions]
        self.numel = [r.numel for r in regions]
        self.trainable = [r.stepped_numel for r in regions]
        """Per region, the elements of its trainable parameters: everything optimizer-related
        (gradient copies, state bytes, steps, streamed state) scales with these; a region
        without any has no optimizer work at all."""
        self.grad_bytes = [r.stepped_size_bytes for r in regions]
        """Per region, the training-dtype bytes of its gradients (trainable parameters)."""
        self.op_start = [r.op_start for r in regions]
        self.op_end = [r.op_end for r in regions]
        self._cost_host_work()
        self._cost_streamed()
        self._cost_operations()

    def _cost_host_work(self) -> None:
        """Per region: its uploads, gradient copy and host optimizer work (the step model's
        HOST-state tasks, [Note: step model] in ``_engine``)."""
        profile, hw = self.profile, self.hardware
        # Only host-state regions are ever uploaded (see the note), so one list serves every
        # upload kind: the training-dtype copy, or what the runtime sends per element.
        per_elem = profile.host_upload_bytes_per_param
        self.upload_bytes = [n * per_elem for n in self.numel] if per_elem > 0 else list(self.size)
        """Per region, bytes one upload of its parameters moves host-to-device."""
        self.upload_s = [hw.h2d_time_s(b) for b in self.upload_bytes]
        self.grad_d2h_s = [
            hw.d2h_time_s(n * profile.host_grad_bytes_per_param) for n in self.trainable
        ]
        self.host_step_s = [n / hw.host_adam_params_per_s for n in self.trainable]
        self.copy_contention = (1.0 / hw.host_copy_contention - 1.0) / 2.0
        """Host seconds a second of one-directional pinned copy costs (see the note)."""
        self.stream_copy_contention = self.copy_contention * self.cost_model.stream_host_charge
        """The same for a STREAMED region's copies: ``CostModel.stream_host_charge`` of it
        (see [Note: streamed steps] in ``_engine``)."""
        # Host conversion passes of a host-state region (see the note); zero when the rate
        # is unknown, so the engine can skip them with one test.
        # They run as gradients land and right before uploads, so under copies: charged at
        # the contended rate (see the note).
        slow = 1.0 / hw.host_copy_contention
        widens = 0 < profile.host_grad_bytes_per_param < 4
        self.widen_s = [hw.host_convert_time_s(n) * slow if widens else 0.0 for n in self.trainable]
        # Uploading fp32 masters (narrowed on the device) leaves nothing to publish.
        self.publishes = hw.host_convert_elems_per_s > 0 and per_elem < 4
        """Whether host-state regions get a ``publish`` host task after their Adam step."""
        self.publish_s = [
            hw.host_convert_time_s(n) * slow if self.publishes else 0.0 for n in self.trainable
        ]
        self.grad_work = [((KIND_GRAD_WIDEN, w),) if w > 0.0 else () for w in self.widen_s]
        """Per region, the host tasks (kind, seconds) run as its gradients land."""
        add_s = [
            hw.host_convert_time_s(n) * slow if hw.host_convert_elems_per_s > 0 else 0.0
            for n in self.trainable
        ]
        self.accumulate_work = [
            ((KIND_GRAD_WIDEN, w + a),) if w + a > 0.0 else ()
            for w, a in zip(self.widen_s, add_s, strict=True)
        ]
        """Per region, the host tasks run as its gradients land in a micro-batch that only
        accumulates: widening (as above) and adding into the accumulator, one more pass
        at the conversion rate under copies."""
        self.host_work_s = [
            a + b + c
            for a, b, c in zip(self.widen_s, self.host_step_s, self.publish_s, strict=True)
        ]
        """Per region, all host-lane seconds of its optimizer work when its state is on
        the host: widening, Adam and publish."""
        self.device_step_s = [n / hw.device_adam_params_per_s for n in self.trainable]
        self.state_bytes = [n * profile.device_state_bytes_per_param for n in self.trainable]

    def _cost_streamed(self) -> None:
        """Per region, a STREAMED step's copies of its state ([Note: streamed steps] in
        ``_engine``); the device step is ``device_step_s``."""
        hw, streamed = self.hardware, self.streamed
        fraction = self.cost_model.stream_up_fraction
        up_pp = streamed.up_bytes_per_param if streamed is not None else 0.0
        down_pp = streamed.down_bytes_per_param if streamed is not None else 0.0
        self.stream_up_s = [hw.h2d_time_s(math.ceil(n * up_pp)) / fraction for n in self.trainable]
        """Per region, seconds of a STREAMED step's state copy up (0 without costs), at
        ``CostModel.stream_up_fraction`` of the H2D rate."""
        self.stream_down_s = [hw.d2h_time_s(math.ceil(n * down_pp)) for n in self.trainable]
        """Per region, seconds of a STREAMED step's state copy down (0 without costs)."""
        resident_pp = streamed.resident_down_bytes_per_param if streamed is not None else None
        self.stream_writes_resident = resident_pp is not None
        """Whether a RESIDENT streamed region's device step writes its parameters in place
        (``StreamedStepCosts.resident_down_bytes_per_param``): no post-step upload, and its
        forward waits for the device step only."""
        self.stream_down_resident_s = (
            self.stream_down_s
            if resident_pp is None
            else [hw.d2h_time_s(math.ceil(n * resident_pp)) for n in self.trainable]
        )
        """Per region, seconds of a RESIDENT streamed region's copy down."""
        self.stream_slot_bytes = streamed.slot_bytes if streamed is not None else 0
        """Device bytes of the ring of buffers held while streamed steps are in flight."""

    def _cost_operations(self) -> None:
        """Per operation, its activation levels; per region, its forward's and backward's
        operation offsets and seconds (the backward twice: as any pass, and beside
        host-state regions, [Note: the backward beside the host])."""
        hw, ops, regions = self.hardware, self.profile.operations, self.regions
        # Every operation takes at least its issue cost ([Note: issuing ahead]).
        fwd_op = [max(hw.operation_device_s(op), hw.op_overhead_s) for op in ops]
        bwd_dev = [hw.operation_device_s(op, backward=True) for op in ops]

        # Start offsets of each region's operations from the region's compute start:
        # forward in operation order, backward in reverse operation order.
        self.fwd_offsets: list[list[float]] = []
        self.fwd_s: list[float] = []
        for reg in regions:
            acc, offs = 0.0, []
            for j in range(reg.op_start, reg.op_end):
                offs.append(acc)
                acc += fwd_op[j]
            self.fwd_offsets.append(offs)
            self.fwd_s.append(acc)

        self.bwd_offsets, self.bwd_s = _backward_regions(
            regions, [max(d, hw.op_overhead_s) for d in bwd_dev]
        )
        """Per region, its backward operations' start offsets from the region's backward
        start, and its backward's seconds, in a step with every region's state on the
        device."""
        self.bwd_offsets_beside_host, self.bwd_s_beside_host = self.bwd_offsets, self.bwd_s
        """The same in a step with host-state regions: with each backward operation issued
        ahead at ``CostModel.backward_issue_factor`` times ``op_overhead_s`` where that
        makes the pass longer than the price above ([Note: the backward beside the
        host]); the same lists when that factor is 1."""
        factor = self.cost_model.backward_issue_factor
        if factor != 1.0:
            loaded_offsets, loaded_s = _backward_regions(
                regions, _backward_issued_ahead(bwd_dev, hw.op_overhead_s * factor)
            )
            if sum(loaded_s) > sum(self.bwd_s):
                self.bwd_offsets_beside_host, self.bwd_s_beside_host = loaded_offsets, loaded_s
        self.storage_reads = StorageReads.of(self.profile.operations, regions)
        """Which storages each region reads (None for a profile without reads), for the
        search that groups recomputed regions into runs."""
        self.approximate_boundary = approximate_boundary(self.profile.operations, regions, None)
        """Per region, its input as a profile without reads approximates it."""
        self._cost_activations((ActivationPlacement.KEEP,) * self.num_regions)

    def _cost_activations(self, activations: Sequence[ActivationPlacement]) -> None:
        """Per operation its activation levels, per region what its activation handling
        costs, for ``activations`` (one per region; [Note: activations] in
        ``_activations``)."""
        ops, regions = self.profile.operations, self.regions
        self.activations: tuple[ActivationPlacement, ...] = tuple(activations)
        """Per region, what happens to its saved activations (all KEEP unless made with
        :meth:`with_activations`)."""
        self.moves_activations = any(a is not ActivationPlacement.KEEP for a in activations)
        """Whether any region's activations are not simply kept (the peak is then read
        off the memory curve's walk)."""
        levels = activation_levels(ops, regions, self.hardware, self.activations)
        self.act = levels
        """The levels and per-region costs below, together."""
        self.saved_prefix = levels.saved_prefix
        """``saved_prefix[j]``: saved bytes held when operation ``j`` starts (those of
        operations before ``j``, with every region KEEP)."""
        self.saved_after = levels.saved_after
        """``saved_after[j]``: saved bytes held once operation ``j`` has run forward."""
        self.saved_prefix_bwd = levels.saved_prefix_bwd
        """``saved_prefix[j]`` as operation ``j``'s backward sees it (the same but in a
        run of recomputed regions; [Note: activations])."""
        self.recompute_s = [
            sum(self.fwd_s[levels.recompute_from[r] : r + 1]) if rec else 0.0
            for r, rec in enumerate(levels.recompute)
        ]
        """Per region, seconds of the recomputation that runs right before its backward."""
        chained_through = [
            r + 1 < self.num_regions
            and activations[r + 1] is ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
            for r in range(self.num_regions)
        ]
        self.pinned = [
            reg.pinned or through
            for reg, through in zip(self.regions, chained_through, strict=True)
        ]
        """Per region, whether its parameters must stay resident: it owns a parameter read
        outside its operations, or a later region of its recomputed run needs them when
        the run is recomputed (``check_activation_runs``)."""
        self.act_fwd = levels.act_fwd
        self.act_bwd = levels.act_bwd
        self.act_fwd_max = max(self.act_fwd)
        self.act_bwd_region_max = [
            max(self.act_bwd[reg.op_start : reg.op_end], default=0) for reg in regions
        ]
        # Sparse table for range maxima of backward activation levels.
        table = [self.act_bwd]
        width = 1
        while 2 * width <= len(ops):
            prev = table[-1]
            table.append([max(prev[i], prev[i + width]) for i in range(len(prev) - width)])
            width *= 2
        self._rmq = table

    def with_activations(self, activations: Sequence[ActivationPlacement]) -> SimulationContext:
        """This context with ``activations`` (one per region) instead of its own; every
        other cost is shared. Raises ``ValueError`` on a wrong length."""
        if len(activations) != self.num_regions:
            raise ValueError(
                f"activations has {len(activations)} entries; the layout has "
                f"{self.num_regions} regions"
            )
        for r, a in enumerate(activations):
            if not isinstance(a, ActivationPlacement):
                raise ValueError(f"activations[{r}] is {a!r}; use an ActivationPlacement")
        other = copy.copy(self)
        other._cost_activations(activations)
        return other

    @classmethod
    def build(
        cls,
        profile: ModelProfile,
        hardware: HardwareProfile,
        *,
        block_search_step_bytes: int = BLOCK_SEARCH_STEP_BYTES,
        block_search_range_bytes: int = BLOCK_SEARCH_RANGE_BYTES,
        host_step_after_backward: bool = False,
        speculative_step_cost: float = 1.0,
        micro_batches: int = 1,
        speculative_params: int | None = None,
        streamed: StreamedStepCosts | None = None,
        speculation_thread: bool = False,
        cost_model: CostModel | None = None,
    ) -> SimulationContext:
        """Linearise ``profile`` into regions (see ``offload_solver.regions``) and cost them
        on ``hardware`` with ``cost_model`` (``CostModel()`` when None)."""
        layout = build_regions(
            profile, step_bytes=block_search_step_bytes, range_bytes=block_search_range_bytes
        )
        return cls(
            profile,
            hardware,
            layout,
            host_step_after_backward=host_step_after_backward,
            speculative_step_cost=speculative_step_cost,
            micro_batches=micro_batches,
            speculative_params=speculative_params,
            streamed=streamed,
            speculation_thread=speculation_thread,
            cost_model=cost_model,
        )

    def act_bwd_max(self, lo: int, hi: int) -> int:
        """Largest backward activation level of operations ``lo..hi-1`` (``lo < hi``)."""
        k = (hi - lo).bit_length() - 1
        row = self._rmq[k]
        a, b = row[lo], row[hi - (1 << k)]
        return a if a >= b else b

    def validate(self, assignment: Sequence[RegionAssignment], *, allow_async: bool) -> None:
        """Raise ``ValueError`` naming the region when ``assignment`` cannot be simulated."""
        n = self.num_regions
        if len(assignment) != n:
            raise ValueError(
                f"assignment has {len(assignment)} entries; the layout has {n} regions"
            )
        for r, a in enumerate(assignment):
            if a.state is StatePlacement.STREAMED and self.streamed is None:
                raise ValueError(
                    f"region {r} is streamed, but the simulation has no StreamedStepCosts; "
                    "build the SimulationContext with streamed=StreamedStepCosts(...)"
                )
            if a.placement is not ParamPlacement.RESIDENT:
                if self.pinned[r]:
                    why = (
                        "it owns a parameter used outside its operations"
                        if self.regions[r].pinned
                        else "a later region of its recomputed run needs its parameters"
                    )
                    raise ValueError(
                        f"region {r} is pinned ({why}) and cannot be {a.placement.value}; "
                        "keep it resident"
                    )
                if a.state is StatePlacement.DEVICE:
                    raise ValueError(
                        f"region {r} is {a.placement.value} with device optimizer state; "
                        "device state is only allowed for resident regions"
                    )
            if a.placement is ParamPlacement.ASYNC:
                if not allow_async:
                    raise ValueError(
                        f"region {r} is async, which this simulator does not model; "
                        "use the 'async' simulator"
                    )
                p = a.prefetch_at
                if r == n - 1:
                    raise ValueError(
                        f"region {r} is the last region and cannot be prefetched in backward; "
                        "make it sync"
                    )
                if not isinstance(p, int) or isinstance(p, bool) or not r < p < n:
                    raise ValueError(
                        f"region {r} is async with prefetch_at={p!r}; it must be a later "
                        f"region index in {r + 1}..{n - 1}"
                    )
            elif a.prefetch_at is not None:
                raise ValueError(
                    f"region {r} is {a.placement.value} but has prefetch_at={a.prefetch_at}; "
                    "only async regions are prefetched"
                )


def _backward_issued_ahead(bwd_dev: list[float], issue_s: float) -> list[float]:
    """Per operation, backward seconds from its start to the next one's (in reverse
    operation order) when the device runs each for ``bwd_dev`` seconds, each costs the
    host ``issue_s`` to issue and the host issues ahead of the device ([Note: issuing
    ahead])."""
    # Operation starts over the whole pass, in reverse operation order; a region's
    # offsets from its first operation's.
    at_rev, end = issued_starts(bwd_dev[::-1], issue_s)
    at = at_rev[::-1]
    # The first operation of a pass also waits for its own issue.
    return [b - a for a, b in zip([*at[:-1], 0.0], [end, *at[:-1]], strict=True)]


def _backward_regions(
    regions: Sequence[Region], eff: Sequence[float]
) -> tuple[list[list[float]], list[float]]:
    """Per region, its backward operations' start offsets from its backward start (in
    reverse operation order) and its backward's seconds, from each operation's seconds
    ``eff``."""
    offsets: list[list[float]] = []
    spans: list[float] = []
    for reg in regions:
        acc, offs = 0.0, []
        for j in range(reg.op_end - 1, reg.op_start - 1, -1):
            offs.append(acc)
            acc += eff[j]
        offsets.append(offs)
        spans.append(acc)
    return offsets, spans


__all__ = [
    "RegionAssignment",
    "SimulationContext",
    "check_speculative_params",
    "issued_starts",
]
