"""The solver's answer (``Plan``): per region where its parameters and optimizer state
live, with the predicted peak, step time, timeline and memory curve, and its JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import Enum

from offload_solver._json import (
    SCHEMA_VERSION,
    enum_value,
    get_field,
    load_document,
    record,
    to_jsonable,
)
from offload_solver.cost_model import CostModel
from offload_solver.plan_options import PlanOptions


class ParamPlacement(str, Enum):
    """Where a region's parameters (training dtype) live between uses."""

    RESIDENT = "resident"
    """Always on the device."""
    SYNC = "sync"
    """On the host; uploaded on the compute stream just before use, in forward and backward."""
    ASYNC = "async"
    """On the host; prefetched on the host-to-device stream ahead of use."""


class StatePlacement(str, Enum):
    """Where a region's master weights and optimizer state live, and where it steps."""

    DEVICE = "device"
    """On the device (RESIDENT regions only); stepped on the device."""
    HOST = "host"
    """In pinned host memory; stepped by the host CPU."""
    STREAMED = "streamed"
    """In pinned host memory, as for HOST, but stepped on the device: after backward the
    runtime copies the region's state (and gradient) up into a ring of device buffers,
    steps it there and copies the result back down (:class:`StreamedStepCosts`; see
    [Note: streamed steps] in ``offload_solver.simulators._engine``). Any parameter
    placement."""


class ActivationPlacement(str, Enum):
    """What happens to the activations a region's forward saves for its backward."""

    KEEP = "keep"
    """On the device from the region's forward to its backward (plain training)."""
    RECOMPUTE = "recompute"
    """Dropped after the forward; the region's forward runs again from its inputs just
    before its backward, with the random-number state it first ran with, so the result
    is exact."""
    HOST = "host"
    """Copied to pinned host memory after the forward (device-to-host stream) and
    brought back ahead of the region's backward (host-to-device stream)."""
    RECOMPUTE_WITH_PREVIOUS = "recompute_with_previous"
    """Dropped after the forward, as RECOMPUTE, but recomputed together with the region
    before it, which is RECOMPUTE or this too: such a run of regions holds only the
    values its operations read from before its first region, and its forward runs again,
    from the first region on, just before the backward of its last region. Every region
    of a run but the last must keep its parameters RESIDENT (:func:`check_activation_runs`)."""


def check_activation_runs(
    activations: Sequence[ActivationPlacement], placements: Sequence[ParamPlacement]
) -> None:
    """Raise ``ValueError`` naming the region where a RECOMPUTE_WITH_PREVIOUS region does
    not follow a RECOMPUTE or RECOMPUTE_WITH_PREVIOUS one whose parameters are RESIDENT:
    the run is recomputed at its last region's backward, when the parameters of every
    region of it must be on the device."""
    chained = ActivationPlacement.RECOMPUTE_WITH_PREVIOUS
    for r, mode in enumerate(activations):
        if mode is not chained:
            continue
        if r == 0 or activations[r - 1] not in (ActivationPlacement.RECOMPUTE, chained):
            raise ValueError(
                f"region {r} is recompute_with_previous, but region {r - 1} is not "
                "recomputed; chain a region only onto a recompute or "
                "recompute_with_previous region"
            )
        if placements[r - 1] is not ParamPlacement.RESIDENT:
            raise ValueError(
                f"region {r} is recompute_with_previous, but region {r - 1}'s parameters "
                f"are {placements[r - 1].value}: every region of a recomputed run but the "
                "last must be resident"
            )


class Stream(str, Enum):
    """Lanes of the simulated timeline."""

    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"
    """The host CPU running the optimizer step of host-state regions."""


def _bytes_in(value: object, below: float) -> bool:
    """Whether ``value`` is a number of bytes (an int or float, not a bool) in
    ``(0, below)``."""
    return not isinstance(value, bool) and isinstance(value, (int, float)) and 0 < value < below


@dataclass(frozen=True)
class StreamedStepCosts:
    """What the runtime moves and holds to step a STREAMED region on the device.

    For example, fp16 training with an fp32 master and bf16 moments: 10 bytes per
    parameter up (4 master + 2 x 2 moments + 2 fp16 gradient) and 10 down (4 master + 2 x
    2 moments + 2 fp16 parameters).
    """

    up_bytes_per_param: float
    """Bytes per parameter element copied host-to-device before the device step."""
    down_bytes_per_param: float
    """Bytes per parameter element copied device-to-host after the device step."""
    slot_bytes: int
    """Device bytes of the ring of buffers the runtime holds while a step's streamed
    regions are in flight (every slot together)."""
    resident_down_bytes_per_param: float | None = None
    """``None``: a RESIDENT streamed region's new parameters come down with its state
    (``down_bytes_per_param``) and go up again after it (its post-step upload). A number:
    the device step writes them in place on the device, its copy down is this many bytes
    per parameter element (the state only), it has no post-step upload, and its next
    forward waits on the device for the device step alone, not for the copy down (fp32
    state and fp16 parameters: 12 bytes down instead of 14, and 2 fewer up)."""
    staged_chunks: int = 0
    """How many chunks of state the runtime sends up in the backward, ahead of the step
    (``PlanOptions.stage_in_backward``: one per slot of the optimizer's ring); 0 (the
    default): none. The first streamed region's gradient hook in the backward sends the
    master weights and moments of the streamed regions' leading chunks up, in forward
    order, and the step then sends only the rest of each such chunk (its gradient). See
    [Note: streamed steps] in ``offload_solver.simulators._engine``."""
    staged_chunk_numel: int = 0
    """Parameter elements per staged chunk: each streamed region is cut into chunks of at
    most this many (the ring's chunk). Needed when ``staged_chunks`` is set."""
    staged_bytes_per_param: float = 0.0
    """Bytes per parameter element a staged chunk sends up in the backward (the master
    weights and moments: 12 with fp32 state, 8 with bf16 moments); the step sends the
    rest of ``up_bytes_per_param``. Needed, below ``up_bytes_per_param``, when
    ``staged_chunks`` is set."""

    def __post_init__(self) -> None:
        names = ["up_bytes_per_param", "down_bytes_per_param"]
        if self.resident_down_bytes_per_param is not None:
            names.append("resident_down_bytes_per_param")
        for name in names:
            value = getattr(self, name)
            if not _bytes_in(value, math.inf):
                raise ValueError(
                    f"StreamedStepCosts.{name} is {value!r}; must be a finite number of "
                    "bytes per parameter element > 0"
                )
        if isinstance(self.slot_bytes, bool) or not isinstance(self.slot_bytes, int):
            raise ValueError(
                f"StreamedStepCosts.slot_bytes is {self.slot_bytes!r}; must be an int "
                "number of device bytes > 0"
            )
        if self.slot_bytes <= 0:
            raise ValueError(
                f"StreamedStepCosts.slot_bytes is {self.slot_bytes}; the ring of device "
                "buffers needs > 0 bytes"
            )
        for name in ("staged_chunks", "staged_chunk_numel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"StreamedStepCosts.{name} is {value!r}; must be an int >= 0")
        if self.staged_chunks:
            if self.staged_chunk_numel < 1:
                raise ValueError(
                    f"StreamedStepCosts.staged_chunks is {self.staged_chunks} but "
                    f"staged_chunk_numel is {self.staged_chunk_numel}; staged chunks need "
                    ">= 1 parameter element each"
                )
            pp = self.staged_bytes_per_param
            if not _bytes_in(pp, self.up_bytes_per_param):
                raise ValueError(
                    f"StreamedStepCosts.staged_bytes_per_param is {pp!r}; staged chunks "
                    "send up a number of bytes per parameter element > 0 and below "
                    f"up_bytes_per_param ({self.up_bytes_per_param}), the step the rest"
                )


@dataclass(frozen=True)
class Region:
    """A contiguous run of operations and the parameters whose storage it owns.

    A region owns the storage of every parameter first used by one of its operations
    (a tied group is owned by the region of its first use). ``pinned`` regions own a
    parameter that is also used outside the region's operations; the solvers never
    offload them.
    """

    index: int
    op_start: int
    """Index of the first operation (into ``ModelProfile.operations``)."""
    op_end: int
    """One past the last operation."""
    param_names: tuple[str, ...]
    """Canonical names of the parameters whose storage the region owns, in first-use order."""
    numel: int
    size_bytes: int
    """Parameter bytes in the training dtype (the region's flat device buffer)."""
    pinned: bool = False
    trainable_numel: int | None = None
    """Elements of its trainable parameters (``Parameter.trainable``): the ones with
    gradients, optimizer state and optimizer steps. ``None``: all ``numel`` (a region
    recorded without it); :attr:`stepped_numel` reads it either way."""
    trainable_size_bytes: int | None = None
    """Training-dtype bytes of its trainable parameters (``None``: all ``size_bytes``)."""

    @property
    def stepped_numel(self) -> int:
        """Elements the optimizer steps: its trainable ones."""
        return self.numel if self.trainable_numel is None else self.trainable_numel

    @property
    def stepped_size_bytes(self) -> int:
        """Training-dtype bytes of its gradients: its trainable parameters'."""
        return self.size_bytes if self.trainable_size_bytes is None else self.trainable_size_bytes


@dataclass(frozen=True)
class RegionPlan:
    """The plan's decision for one region."""

    region: Region
    placement: ParamPlacement
    state: StatePlacement
    prefetch_at: int | None = None
    """ASYNC only: index of the region whose backward start issues this region's backward
    prefetch (a later region in forward order). ``None`` for the other placements."""
    pool_offset_bytes: int | None = None
    """Offloaded regions: byte offset of the region's buffer in the device pool."""
    activations: ActivationPlacement = ActivationPlacement.KEEP
    """What happens to the activations the region's forward saves for its backward."""


@dataclass(frozen=True)
class TimelineInterval:
    """One busy interval of one stream in the simulated step."""

    stream: Stream
    region: int
    kind: str
    """What runs: ``fwd``, ``bwd``, ``upload``, ``prefetch``, ``grad_offload``,
    ``grad_widen``, ``host_step``, ``publish``, ``device_step``, ``param_upload`` (see
    [Note: step model] in ``offload_solver.simulators._engine``), and for STREAMED
    regions ``stream_up``, ``stream_step``, ``stream_down``, ``stream_contention`` and
    ``stream_stage`` ([Note: streamed steps]). Reading a plan keeps any other kind as
    written."""
    start_s: float
    end_s: float


@dataclass(frozen=True)
class MemorySample:
    """Device bytes in use from ``time_s`` until the next sample."""

    time_s: float
    bytes: int


@dataclass(frozen=True)
class Plan:
    """The solver's answer, ready for a runtime to execute."""

    solver: str
    budget_bytes: int
    """The budget the user asked for (the solver plans against 0.95 of it)."""
    regions: tuple[RegionPlan, ...]
    predicted_peak_bytes: int
    predicted_step_time_s: float
    """Seconds per training step once steps repeat (the host steps of one step run under
    the next forward; see [Note: steady state] in ``offload_solver.simulators._steady``)."""
    timeline: tuple[TimelineInterval, ...]
    """One step started on an idle machine (the cold step): its span can differ from
    ``predicted_step_time_s``."""
    memory_curve: tuple[MemorySample, ...]
    pool_size_bytes: int
    """Device bytes of the pool that holds offloaded regions while they are in use."""
    device_bytes_in_use: int = 0
    """Device bytes the plan took as allocated outside it for the whole step (``solve``'s
    ``device_bytes_in_use``); ``predicted_peak_bytes`` and ``memory_curve`` include them."""
    model_name: str = ""
    hardware_name: str = ""
    solve_time_s: float = 0.0
    num_simulations: int = 0
    schema_version: int = SCHEMA_VERSION
    streamed: StreamedStepCosts | None = None
    """The costs the plan's STREAMED regions were planned with (``solve(...,
    streamed=)``); ``None`` when no region is STREAMED, and then left out of the JSON."""
    cost_model: CostModel = field(default_factory=CostModel)
    """The cost model's factors the plan was made with (``solve(..., cost_model=)``). A plan
    document without them (one written before plans recorded them) reads with
    ``CostModel()``."""
    options: PlanOptions = field(default_factory=PlanOptions)
    """The speed-only choices the plan was made with, which the runtime and the optimizer
    execute: ``solve`` records those it was given, the runtime's planner the rest. A plan
    document without them reads with ``PlanOptions()``."""

    def __post_init__(self) -> None:
        check_activation_runs(
            [rp.activations for rp in self.regions], [rp.placement for rp in self.regions]
        )

    def to_json(self) -> str:
        data = to_jsonable(self)
        if self.streamed is None:
            del data["streamed"]
        else:
            streamed = data["streamed"]
            if self.streamed.resident_down_bytes_per_param is None:
                del streamed["resident_down_bytes_per_param"]  # its default: left out
            if not self.streamed.staged_chunks:  # nothing staged: left out likewise
                for name in ("staged_chunks", "staged_chunk_numel", "staged_bytes_per_param"):
                    del streamed[name]
        return json.dumps(data, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        data = load_document(text, "Plan")
        try:
            regions = []
            for i, rp in enumerate(get_field(data, "regions", list)):
                where = f"regions[{i}]"
                if not isinstance(rp, dict):
                    raise ValueError(f"Plan JSON: {where} must be an object")
                region = record(Region, rp.get("region"), f"{where}.region")
                region = Region(**{**asdict(region), "param_names": tuple(region.param_names)})
                regions.append(
                    RegionPlan(
                        region=region,
                        placement=enum_value(
                            ParamPlacement, rp.get("placement"), f"{where}.placement"
                        ),
                        state=enum_value(StatePlacement, rp.get("state"), f"{where}.state"),
                        prefetch_at=rp.get("prefetch_at"),
                        pool_offset_bytes=rp.get("pool_offset_bytes"),
                        activations=enum_value(
                            ActivationPlacement,
                            rp.get("activations", ActivationPlacement.KEEP.value),
                            f"{where}.activations",
                        ),
                    )
                )
            timeline = []
            for i, iv in enumerate(get_field(data, "timeline", list)):
                if not isinstance(iv, dict):
                    raise ValueError(f"Plan JSON: timeline[{i}] must be an object")
                timeline.append(
                    TimelineInterval(
                        stream=enum_value(Stream, iv.get("stream"), f"timeline[{i}].stream"),
                        region=int(iv["region"]),
                        kind=str(iv["kind"]),
                        start_s=float(iv["start_s"]),
                        end_s=float(iv["end_s"]),
                    )
                )
            return Plan(
                solver=get_field(data, "solver", str),
                budget_bytes=get_field(data, "budget_bytes", int),
                regions=tuple(regions),
                predicted_peak_bytes=get_field(data, "predicted_peak_bytes", int),
                predicted_step_time_s=float(get_field(data, "predicted_step_time_s", (int, float))),
                timeline=tuple(timeline),
                memory_curve=tuple(
                    record(MemorySample, m, f"memory_curve[{i}]")
                    for i, m in enumerate(get_field(data, "memory_curve", list))
                ),
                pool_size_bytes=get_field(data, "pool_size_bytes", int),
                device_bytes_in_use=get_field(data, "device_bytes_in_use", int, default=0),
                model_name=get_field(data, "model_name", str, default=""),
                hardware_name=get_field(data, "hardware_name", str, default=""),
                solve_time_s=float(get_field(data, "solve_time_s", (int, float), default=0.0)),
                num_simulations=get_field(data, "num_simulations", int, default=0),
                streamed=(
                    None
                    if data.get("streamed") is None
                    else record(StreamedStepCosts, data["streamed"], "streamed")
                ),
                cost_model=(
                    CostModel()
                    if data.get("cost_model") is None
                    else record(CostModel, data["cost_model"], "cost_model")
                ),
                options=(
                    PlanOptions()
                    if data.get("options") is None
                    else record(PlanOptions, data["options"], "options")
                ),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed Plan JSON: missing or mistyped field {exc}") from exc


__all__ = [
    "ActivationPlacement",
    "MemorySample",
    "ParamPlacement",
    "Plan",
    "PlanOptions",
    "Region",
    "RegionPlan",
    "StatePlacement",
    "Stream",
    "StreamedStepCosts",
    "TimelineInterval",
    "check_activation_runs",
]
