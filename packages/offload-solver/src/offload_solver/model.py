"""The solver's data model: what a model costs, what a machine can do, and the plan.

Every record here is a frozen dataclass of plain numbers and strings, with units in the
field names (``_bytes``, ``_s``, ``_flop``), so that any framework can build them and the
solver never sees a framework object. Each top-level record has a JSON round trip through
``to_json`` / ``from_json`` carrying :data:`SCHEMA_VERSION`.

[Note: memory model]
The simulator accounts device memory as the sum of
- parameters in the training dtype (``Parameter.size_bytes``) of every region that is on
  the device at that moment (resident regions always, offloaded ones while in use);
- per-parameter optimizer bytes (``ModelProfile.device_state_bytes_per_param``: master
  weights, Adam moments and the full-precision gradient accumulator) of every region whose
  optimizer state the plan keeps on the device;
- gradients in the training dtype of host-state regions, from the end of that region's
  backward until their copy to the host completes;
- activations: for operation ``i`` in forward, the saved bytes of operations ``< i``,
  plus ``fwd_out_bytes`` and ``fwd_tmp_bytes`` of ``i``; in backward, the saved bytes of
  operations ``<= i`` not yet released, plus ``bwd_out_bytes`` and ``bwd_tmp_bytes`` of
  ``i``. After operation ``i``'s backward its ``saved_bytes`` are released.
A profiler fills ``fwd_tmp_bytes`` / ``bwd_tmp_bytes`` with whatever else is alive at that
point (inputs still needed by later operations, workspaces, incoming gradients), so that
the formula above gives the true live bytes.
"""

from __future__ import annotations

import itertools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from enum import Enum
from typing import Any, TypeVar

SCHEMA_VERSION = 1
"""Version of the JSON documents written by ``to_json``; readers reject any other."""

_T = TypeVar("_T")


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


class Stream(str, Enum):
    """Lanes of the simulated timeline."""

    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    HOST = "host"
    """The host CPU running the optimizer step of host-state regions."""


# --------------------------------------------------------------------------------------
# Model profile
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Parameter:
    """One named parameter of the model.

    Members of a tied group are each listed with the same ``numel`` / ``size_bytes``; the
    solver counts the group's storage once.
    """

    name: str
    numel: int
    """Number of elements."""
    size_bytes: int
    """Bytes in the training dtype on the device (``numel`` x element size)."""


@dataclass(frozen=True)
class Operation:
    """One operation of the forward pass, in execution order.

    ``name`` is unique within the profile; a tracer uses the graph node's name so that a
    plan can be mapped back onto the graph.
    """

    name: str
    param_names: tuple[str, ...] = ()
    """Parameters the operation reads directly (any member of a tied group may appear)."""
    fwd_out_bytes: int = 0
    """Bytes of the operation's outputs."""
    fwd_tmp_bytes: int = 0
    """Other bytes alive while it runs forward (see the memory model note)."""
    saved_bytes: int = 0
    """Bytes kept from its forward until its backward (storages counted once, parameter
    aliases left out)."""
    bwd_tmp_bytes: int = 0
    """Other bytes alive while its backward runs (incoming gradients, workspaces)."""
    bwd_out_bytes: int = 0
    """Bytes of the gradients its backward produces for its inputs."""
    fwd_flop: int = 0
    bwd_flop: int = 0
    attention: bool = False
    """A fused attention operation (scaled dot-product attention): priced at the
    hardware's attention rates where known (``HardwareProfile.attention_fwd_flop_per_s``),
    which can be well under the matrix-multiply rate."""

    @property
    def fwd_traffic_bytes(self) -> int:
        """Estimated device-memory bytes its forward reads and writes (see
        [Note: memory-bound operations])."""
        return FWD_TRAFFIC_FACTOR * self.fwd_out_bytes

    @property
    def bwd_traffic_bytes(self) -> int:
        """Estimated device-memory bytes its backward reads and writes."""
        return BWD_TRAFFIC_FACTOR * self.bwd_out_bytes


# [Note: memory-bound operations]
# An operation's time is the largest of its compute (FLOPs over the achieved matmul
# rate), its device-memory traffic over the device's memory bandwidth, and the cost of
# issuing it. Element-wise operations, layer norms and dropout have next to no FLOPs but
# move every byte of their activations, a sizeable share of a step that a FLOP count
# alone would miss. The profile records the bytes an operation
# allocates, not what it reads, so traffic is estimated from outputs: a forward reads
# inputs of about its output's size and writes the output (2x); a backward reads the
# incoming gradient and a saved input and writes the input's gradient (3x). Views
# allocate nothing and cost nothing; for matrix products the compute term dominates.
FWD_TRAFFIC_FACTOR = 2
BWD_TRAFFIC_FACTOR = 3


@dataclass(frozen=True)
class ModelProfile:
    """A model as the solver sees it: parameters, operations and tied groups."""

    name: str
    parameters: tuple[Parameter, ...]
    operations: tuple[Operation, ...]
    tied_groups: tuple[tuple[str, ...], ...] = ()
    """Groups of parameter names sharing one storage; the first member owns it."""
    device_state_bytes_per_param: int = 16
    """Device bytes per parameter element when a region's optimizer state lives on the
    device: fp32 master (4) + Adam moments (8) + fp32 gradient (4) for fp16/bf16 training."""
    host_grad_bytes_per_param: int = 2
    """Bytes per parameter element copied device-to-host as a gradient: the training dtype's
    size, or 4 for a runtime that widens gradients to fp32 on the device before the copy
    (the offload runtime's ``convert_on_device`` option)."""
    host_upload_bytes_per_param: int = 0
    """Bytes per parameter element that an upload of a host-state region's parameters
    moves host-to-device (sync upload, prefetch, and the post-step upload of a resident
    region). 0 means the parameters' own size (``Parameter.size_bytes``): the runtime
    uploads the training-dtype copy that the host published after its Adam step. 4 means
    the runtime uploads the fp32 master weights and narrows them on the device, so the
    host makes no publish pass (see [Note: step model] in
    ``offload_solver.simulators._engine``)."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        validate_profile(self)

    @property
    def parameter_map(self) -> dict[str, Parameter]:
        return {p.name: p for p in self.parameters}

    def canonical_names(self) -> dict[str, str]:
        """Map every parameter name to the owner of its storage (itself when untied)."""
        out = {p.name: p.name for p in self.parameters}
        for group in self.tied_groups:
            for member in group:
                out[member] = group[0]
        return out

    @property
    def total_param_bytes(self) -> int:
        """Parameter bytes in the training dtype, tied storage counted once."""
        canon = self.canonical_names()
        return sum(p.size_bytes for p in self.parameters if canon[p.name] == p.name)

    @property
    def total_param_numel(self) -> int:
        canon = self.canonical_names()
        return sum(p.numel for p in self.parameters if canon[p.name] == p.name)

    def to_json(self) -> str:
        return json.dumps(_to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ModelProfile:
        data = _load_document(text, "ModelProfile")
        try:
            return ModelProfile(
                name=_get(data, "name", str),
                parameters=tuple(
                    _record(Parameter, p, f"parameters[{i}]")
                    for i, p in enumerate(_get(data, "parameters", list))
                ),
                operations=tuple(
                    _record(Operation, o, f"operations[{i}]")
                    for i, o in enumerate(_get(data, "operations", list))
                ),
                tied_groups=tuple(
                    tuple(_str_list(g, f"tied_groups[{i}]"))
                    for i, g in enumerate(data.get("tied_groups", []))
                ),
                device_state_bytes_per_param=_get(
                    data, "device_state_bytes_per_param", int, default=16
                ),
                host_grad_bytes_per_param=_get(data, "host_grad_bytes_per_param", int, default=2),
                host_upload_bytes_per_param=_get(
                    data, "host_upload_bytes_per_param", int, default=0
                ),
            )
        except TypeError as exc:  # a field of the wrong JSON type deep in a record
            raise ValueError(f"malformed ModelProfile JSON: {exc}") from exc


def validate_profile(profile: ModelProfile) -> None:
    """Raise ``ValueError`` naming the field when the profile is inconsistent."""
    if profile.schema_version != SCHEMA_VERSION:
        raise ValueError(
            f"ModelProfile.schema_version is {profile.schema_version}; "
            f"this solver reads version {SCHEMA_VERSION}"
        )
    if not profile.operations:
        raise ValueError("ModelProfile.operations is empty: the model has no operations")
    names: set[str] = set()
    for p in profile.parameters:
        if p.name in names:
            raise ValueError(f"ModelProfile.parameters: duplicate parameter name {p.name!r}")
        names.add(p.name)
        if p.numel < 0 or p.size_bytes < 0:
            raise ValueError(f"Parameter {p.name!r}: numel and size_bytes must be >= 0")
    op_names: set[str] = set()
    for i, op in enumerate(profile.operations):
        if op.name in op_names:
            raise ValueError(f"ModelProfile.operations[{i}]: duplicate operation name {op.name!r}")
        op_names.add(op.name)
        for pname in op.param_names:
            if pname not in names:
                raise ValueError(
                    f"ModelProfile.operations[{i}] ({op.name!r}) uses unknown parameter "
                    f"{pname!r}; add it to ModelProfile.parameters"
                )
        for f in fields(Operation):
            value = getattr(op, f.name)
            if isinstance(value, int) and value < 0:
                raise ValueError(
                    f"ModelProfile.operations[{i}] ({op.name!r}).{f.name} is {value}; must be >= 0"
                )
    seen: set[str] = set()
    for gi, group in enumerate(profile.tied_groups):
        if len(group) < 2:
            raise ValueError(f"ModelProfile.tied_groups[{gi}] has fewer than two members")
        sizes = set()
        for member in group:
            if member not in names:
                raise ValueError(
                    f"ModelProfile.tied_groups[{gi}] names unknown parameter {member!r}"
                )
            if member in seen:
                raise ValueError(
                    f"ModelProfile.tied_groups: parameter {member!r} is in more than one group"
                )
            seen.add(member)
            sizes.add(profile.parameter_map[member].size_bytes)
        if len(sizes) != 1:
            raise ValueError(
                f"ModelProfile.tied_groups[{gi}] members have different sizes {sorted(sizes)}"
            )
    for field_name in (
        "device_state_bytes_per_param",
        "host_grad_bytes_per_param",
        "host_upload_bytes_per_param",
    ):
        value = getattr(profile, field_name)
        if value < 0:
            raise ValueError(
                f"ModelProfile.{field_name} is {value}; must be >= 0 bytes per element"
            )


# --------------------------------------------------------------------------------------
# Hardware profile
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BandwidthPoint:
    """A measured copy rate for one transfer size."""

    size_bytes: int
    bytes_per_s: float


def _interp_bandwidth(points: Sequence[BandwidthPoint], size_bytes: int) -> float:
    """Bandwidth at ``size_bytes``: linear in log(size) between points, flat outside."""
    if size_bytes <= points[0].size_bytes:
        return points[0].bytes_per_s
    if size_bytes >= points[-1].size_bytes:
        return points[-1].bytes_per_s
    lo, hi = 0, len(points) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if points[mid].size_bytes <= size_bytes:
            lo = mid
        else:
            hi = mid
    a, b = points[lo], points[hi]
    t = (math.log(size_bytes) - math.log(a.size_bytes)) / (
        math.log(b.size_bytes) - math.log(a.size_bytes)
    )
    return a.bytes_per_s + t * (b.bytes_per_s - a.bytes_per_s)


@dataclass(frozen=True)
class HardwareProfile:
    """What the machine can move and compute.

    Bandwidths are interpolated in log(size) between measured points and held flat below
    the smallest and beyond the largest measured size.
    """

    name: str
    h2d: tuple[BandwidthPoint, ...]
    """Pinned host-to-device copy rates, sorted by size."""
    d2h: tuple[BandwidthPoint, ...]
    """Pinned device-to-host copy rates, sorted by size."""
    compute_flop_per_s: float
    """Peak (or measured best) matrix-multiply rate of the device."""
    compute_efficiency: float
    """Fraction of ``compute_flop_per_s`` a training step achieves (0 < e <= 1)."""
    device_memory_bytes: int
    host_memory_bytes: int
    host_adam_params_per_s: float = 4.4e9
    """Host optimizer throughput, parameter elements per second (fused CPU Adam)."""
    device_adam_params_per_s: float = 50e9
    """Device optimizer throughput, parameter elements per second (fused CUDA Adam)."""
    op_overhead_s: float = 0.0
    """Host-side cost of issuing one operation (Python, dispatcher, kernel launch), seconds.
    An operation takes at least this long: small-batch steps are bound by it, not FLOPs."""
    host_convert_elems_per_s: float = 0.0
    """Rate of one dtype-converting copy between host tensors (fp16/bf16 <-> fp32), elements
    per second: what widening a region's gradients into its fp32 accumulator and publishing
    its fp32 master into the training-dtype copy cost on the host. 0 means unknown: the
    simulator then charges host-state regions the optimizer step alone."""
    device_memory_bytes_per_s: float = 0.0
    """Device memory bandwidth, bytes read plus written per second (a large on-device
    copy). Memory-bound operations take at least their estimated traffic over it; 0 means
    unknown: operations are then priced by FLOPs and issue cost alone."""
    host_copy_contention: float = 1.0
    """Fraction of its standalone rate fused host Adam keeps while pinned copies run in
    both directions at once (0 < c <= 1; 1 when not measured; ``offload_runtime``'s
    ``profile_hardware`` measures it): host memory serves both. The simulator charges each
    host-state region's step for its own copies and runs conversion passes at the
    contended rate ([Note: step model] in ``offload_solver.simulators._engine``)."""
    stream_up_fraction: float = 1.0
    """Fraction of the pinned host-to-device rate (``h2d``) that a STREAMED step's state
    copies up reach (0 < f <= 1; 1 when not known). They run while the host steps other
    regions and the ring's copies down run, which share host memory with them, so they
    can run well under the profiled rate (``python benchmarks/replay_bench.py ROWS
    --stream-up-fraction F`` fits the fraction to recorded benchmark rows)."""
    stream_host_charge: float = 1.0
    """Share (0 <= s <= 1) of the ``host_copy_contention`` charge that a STREAMED region's
    pinned copies of the step put on the host lane ([Note: streamed steps] in
    ``offload_solver.simulators._engine``). 1 (the default) charges them as a host-state
    region's own copies: all of the contention lands on the host. Where host Adam and the
    ring's copies share host memory both slow down, so a lower share with
    ``stream_up_fraction`` below 1 splits the contention between the two."""
    attention_fwd_flop_per_s: float = 0.0
    """Rate at which fused attention's forward runs (``Operation.attention``), its FLOPs
    as the profile counts them per second; 0 (unknown): the matrix-multiply rate
    (``compute_flop_per_s * compute_efficiency``), which fused attention can fall well
    short of (``offload_runtime.hardware.measure_attention_flop_per_s`` measures it)."""
    attention_bwd_flop_per_s: float = 0.0
    """The same for fused attention's backward."""
    backward_issue_factor: float = 1.0
    """How many times ``op_overhead_s`` each backward operation costs the host to issue in a
    step with host-state (HOST or STREAMED) regions, whose gradient hooks and host Adam
    threads run beside the backward, which is then simulated as issued ahead of the device
    where that takes longer than the backward priced alone ([Note: the backward beside
    the host] in ``offload_solver.simulators._engine``); 1 (the default): as in any other
    step. Fitted, not measured: ``python benchmarks/replay_bench.py --help`` replays
    recorded benchmark rows through the simulator at chosen factors."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        for lane in ("h2d", "d2h"):
            pts: tuple[BandwidthPoint, ...] = getattr(self, lane)
            if not pts:
                raise ValueError(f"HardwareProfile.{lane} needs at least one bandwidth point")
            if any(p.size_bytes <= 0 or p.bytes_per_s <= 0 for p in pts):
                raise ValueError(f"HardwareProfile.{lane}: sizes and rates must be > 0")
            if any(a.size_bytes >= b.size_bytes for a, b in itertools.pairwise(pts)):
                raise ValueError(f"HardwareProfile.{lane}: points must be sorted by size")
        if self.compute_flop_per_s <= 0:
            raise ValueError("HardwareProfile.compute_flop_per_s must be > 0")
        if not 0 < self.compute_efficiency <= 1:
            raise ValueError(
                f"HardwareProfile.compute_efficiency is {self.compute_efficiency}; "
                "must be in (0, 1]"
            )
        if self.host_adam_params_per_s <= 0 or self.device_adam_params_per_s <= 0:
            raise ValueError("HardwareProfile optimizer throughputs must be > 0")
        if not self.op_overhead_s >= 0:
            raise ValueError(
                f"HardwareProfile.op_overhead_s is {self.op_overhead_s}; must be >= 0 seconds"
            )
        if not 1 <= self.backward_issue_factor < math.inf:
            raise ValueError(
                f"HardwareProfile.backward_issue_factor is {self.backward_issue_factor}; "
                "must be a finite factor >= 1 (1: the backward issues as any pass does)"
            )
        if not 0 <= self.host_convert_elems_per_s < math.inf:
            raise ValueError(
                f"HardwareProfile.host_convert_elems_per_s is {self.host_convert_elems_per_s}; "
                "must be a finite rate >= 0 elements/s (0 when unknown)"
            )
        for rate_name in ("attention_fwd_flop_per_s", "attention_bwd_flop_per_s"):
            if not 0 <= getattr(self, rate_name) < math.inf:
                raise ValueError(
                    f"HardwareProfile.{rate_name} is {getattr(self, rate_name)}; must be a "
                    "finite rate >= 0 FLOP/s (0 when unknown)"
                )
        if not 0 <= self.device_memory_bytes_per_s < math.inf:
            raise ValueError(
                "HardwareProfile.device_memory_bytes_per_s is "
                f"{self.device_memory_bytes_per_s}; must be a finite rate >= 0 bytes/s "
                "(0 when unknown)"
            )
        if not 0 < self.host_copy_contention <= 1:
            raise ValueError(
                f"HardwareProfile.host_copy_contention is {self.host_copy_contention}; "
                "must be in (0, 1] (1 when not measured)"
            )
        if not 0 < self.stream_up_fraction <= 1:
            raise ValueError(
                f"HardwareProfile.stream_up_fraction is {self.stream_up_fraction}; "
                "must be in (0, 1] (1 when not known)"
            )
        if not 0 <= self.stream_host_charge <= 1:
            raise ValueError(
                f"HardwareProfile.stream_host_charge is {self.stream_host_charge}; "
                "must be in [0, 1] (1 charges the host in full)"
            )
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"HardwareProfile.schema_version is {self.schema_version}; "
                f"this solver reads version {SCHEMA_VERSION}"
            )

    def h2d_bytes_per_s(self, size_bytes: int) -> float:
        return _interp_bandwidth(self.h2d, size_bytes)

    def d2h_bytes_per_s(self, size_bytes: int) -> float:
        return _interp_bandwidth(self.d2h, size_bytes)

    def h2d_time_s(self, size_bytes: int) -> float:
        """Seconds to copy ``size_bytes`` from pinned host memory to the device."""
        return size_bytes / self.h2d_bytes_per_s(size_bytes) if size_bytes > 0 else 0.0

    def d2h_time_s(self, size_bytes: int) -> float:
        """Seconds to copy ``size_bytes`` from the device to pinned host memory."""
        return size_bytes / self.d2h_bytes_per_s(size_bytes) if size_bytes > 0 else 0.0

    def compute_time_s(self, flop: int) -> float:
        """Seconds of device compute for ``flop`` floating-point operations."""
        return flop / (self.compute_flop_per_s * self.compute_efficiency)

    def device_op_time_s(self, flop: int, traffic_bytes: int = 0) -> float:
        """Seconds the device runs one operation of ``flop`` FLOPs moving ``traffic_bytes``
        of device memory: the larger of its compute and its traffic (no issue cost)."""
        rate = self.device_memory_bytes_per_s
        memory_s = traffic_bytes / rate if rate > 0 else 0.0
        return max(self.compute_time_s(flop), memory_s)

    def operation_device_s(self, op: Operation, backward: bool = False) -> float:
        """Seconds the device runs ``op``'s forward (or backward): as
        :meth:`device_op_time_s`, with fused attention at its own rate where known."""
        flop = op.bwd_flop if backward else op.fwd_flop
        traffic = op.bwd_traffic_bytes if backward else op.fwd_traffic_bytes
        rate = self.attention_bwd_flop_per_s if backward else self.attention_fwd_flop_per_s
        if op.attention and rate > 0:
            return max(flop / rate, self.device_op_time_s(0, traffic))  # 0: traffic alone
        return self.device_op_time_s(flop, traffic)

    def op_time_s(self, flop: int, traffic_bytes: int = 0) -> float:
        """Seconds one operation of ``flop`` FLOPs moving ``traffic_bytes`` of device
        memory takes in a step: the largest of its compute, its memory traffic (when the
        device's memory bandwidth is known) and the cost of issuing it (the device then
        waits for the host). See [Note: memory-bound operations]."""
        return max(self.device_op_time_s(flop, traffic_bytes), self.op_overhead_s)

    def host_convert_time_s(self, numel: int) -> float:
        """Seconds of one host dtype-converting copy of ``numel`` elements (0 when the rate
        is unknown)."""
        rate = self.host_convert_elems_per_s
        return numel / rate if rate > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps(_to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        """Read a profile written by :meth:`to_json`. Keys this version does not know are
        ignored, as are fields that older versions wrote: ``"issue_ahead": true`` (a
        pricing no longer offered) warns once that it is ignored."""
        data = _load_document(text, "HardwareProfile")
        if data.get("issue_ahead") is True:
            warnings.warn(_ISSUE_AHEAD_IGNORED, UserWarning, stacklevel=2)
        try:
            return HardwareProfile(
                name=_get(data, "name", str),
                h2d=tuple(
                    _record(BandwidthPoint, p, f"h2d[{i}]")
                    for i, p in enumerate(_get(data, "h2d", list))
                ),
                d2h=tuple(
                    _record(BandwidthPoint, p, f"d2h[{i}]")
                    for i, p in enumerate(_get(data, "d2h", list))
                ),
                compute_flop_per_s=float(_get(data, "compute_flop_per_s", (int, float))),
                compute_efficiency=float(_get(data, "compute_efficiency", (int, float))),
                device_memory_bytes=_get(data, "device_memory_bytes", int),
                host_memory_bytes=_get(data, "host_memory_bytes", int),
                host_adam_params_per_s=float(
                    _get(data, "host_adam_params_per_s", (int, float), default=4.4e9)
                ),
                device_adam_params_per_s=float(
                    _get(data, "device_adam_params_per_s", (int, float), default=50e9)
                ),
                op_overhead_s=float(_get(data, "op_overhead_s", (int, float), default=0.0)),
                host_convert_elems_per_s=float(
                    _get(data, "host_convert_elems_per_s", (int, float), default=0.0)
                ),
                device_memory_bytes_per_s=float(
                    _get(data, "device_memory_bytes_per_s", (int, float), default=0.0)
                ),
                host_copy_contention=float(
                    _get(data, "host_copy_contention", (int, float), default=1.0)
                ),
                stream_up_fraction=float(
                    _get(data, "stream_up_fraction", (int, float), default=1.0)
                ),
                stream_host_charge=float(
                    _get(data, "stream_host_charge", (int, float), default=1.0)
                ),
                attention_fwd_flop_per_s=float(
                    _get(data, "attention_fwd_flop_per_s", (int, float), default=0.0)
                ),
                attention_bwd_flop_per_s=float(
                    _get(data, "attention_bwd_flop_per_s", (int, float), default=0.0)
                ),
                backward_issue_factor=float(
                    _get(data, "backward_issue_factor", (int, float), default=1.0)
                ),
            )
        except TypeError as exc:
            raise ValueError(f"malformed HardwareProfile JSON: {exc}") from exc


_ISSUE_AHEAD_IGNORED = (
    "HardwareProfile JSON sets 'issue_ahead': true, a pricing this solver no longer "
    "offers; the key is ignored and each operation is priced at the largest of its "
    "compute, its memory traffic and op_overhead_s. Remove the key from the file."
)
"""The warning :meth:`HardwareProfile.from_json` gives once for ``"issue_ahead": true``."""


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
    (``offload_optim``'s ``HybridAdam(stage_in_backward=True)``: one per slot of its
    ring); 0 (the default): none. The first streamed region's gradient hook in the
    backward sends the master weights and moments of the streamed regions' leading chunks
    up, in forward order, and the step then sends only the rest of each such chunk (its
    gradient). See [Note: streamed steps] in ``offload_solver.simulators._engine``."""
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


# --------------------------------------------------------------------------------------
# Plan
# --------------------------------------------------------------------------------------


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
    the next forward; see [Note: steady state] in ``offload_solver.simulators._engine``)."""
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
    streamed=)``); ``None`` when no region is STREAMED. Left out of the JSON when
    ``None``, so plans without STREAMED regions read as they did before it existed."""

    def to_json(self) -> str:
        data = _to_jsonable(self)
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
        data = _load_document(text, "Plan")
        try:
            regions = []
            for i, rp in enumerate(_get(data, "regions", list)):
                where = f"regions[{i}]"
                if not isinstance(rp, dict):
                    raise ValueError(f"Plan JSON: {where} must be an object")
                region = _record(Region, rp.get("region"), f"{where}.region")
                region = Region(**{**asdict(region), "param_names": tuple(region.param_names)})
                regions.append(
                    RegionPlan(
                        region=region,
                        placement=_enum(ParamPlacement, rp.get("placement"), f"{where}.placement"),
                        state=_enum(StatePlacement, rp.get("state"), f"{where}.state"),
                        prefetch_at=rp.get("prefetch_at"),
                        pool_offset_bytes=rp.get("pool_offset_bytes"),
                    )
                )
            timeline = []
            for i, iv in enumerate(_get(data, "timeline", list)):
                if not isinstance(iv, dict):
                    raise ValueError(f"Plan JSON: timeline[{i}] must be an object")
                timeline.append(
                    TimelineInterval(
                        stream=_enum(Stream, iv.get("stream"), f"timeline[{i}].stream"),
                        region=int(iv["region"]),
                        kind=str(iv["kind"]),
                        start_s=float(iv["start_s"]),
                        end_s=float(iv["end_s"]),
                    )
                )
            return Plan(
                solver=_get(data, "solver", str),
                budget_bytes=_get(data, "budget_bytes", int),
                regions=tuple(regions),
                predicted_peak_bytes=_get(data, "predicted_peak_bytes", int),
                predicted_step_time_s=float(_get(data, "predicted_step_time_s", (int, float))),
                timeline=tuple(timeline),
                memory_curve=tuple(
                    _record(MemorySample, m, f"memory_curve[{i}]")
                    for i, m in enumerate(_get(data, "memory_curve", list))
                ),
                pool_size_bytes=_get(data, "pool_size_bytes", int),
                device_bytes_in_use=_get(data, "device_bytes_in_use", int, default=0),
                model_name=_get(data, "model_name", str, default=""),
                hardware_name=_get(data, "hardware_name", str, default=""),
                solve_time_s=float(_get(data, "solve_time_s", (int, float), default=0.0)),
                num_simulations=_get(data, "num_simulations", int, default=0),
                streamed=(
                    None
                    if data.get("streamed") is None
                    else _record(StreamedStepCosts, data["streamed"], "streamed")
                ),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed Plan JSON: missing or mistyped field {exc}") from exc


# --------------------------------------------------------------------------------------
# JSON helpers
# --------------------------------------------------------------------------------------


def _to_jsonable(obj: object) -> Any:
    if isinstance(obj, Enum):
        return obj.value
    if hasattr(obj, "__dataclass_fields__"):
        return {f.name: _to_jsonable(getattr(obj, f.name)) for f in fields(obj)}  # type: ignore[arg-type]
    if isinstance(obj, (list, tuple)):
        return [_to_jsonable(x) for x in obj]
    return obj


def _load_document(text: str, kind: str) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{kind} JSON is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{kind} JSON must be an object, got {type(data).__name__}")
    version = data.get("schema_version")
    if version != SCHEMA_VERSION:
        raise ValueError(
            f"{kind} JSON has schema_version {version!r}; this solver reads version "
            f"{SCHEMA_VERSION}"
        )
    return data


_MISSING = object()


def _get(data: Mapping[str, Any], key: str, typ: Any, default: Any = _MISSING) -> Any:
    if key not in data:
        if default is _MISSING:
            raise ValueError(f"JSON field {key!r} is missing")
        return default
    value = data[key]
    if (isinstance(value, bool) and typ is not bool) or not isinstance(value, typ):
        raise ValueError(f"JSON field {key!r} has type {type(value).__name__}, expected {typ}")
    return value


def _str_list(value: object, where: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"JSON field {where} must be a list of strings")
    return value


def _record(cls: type[_T], value: object, where: str) -> _T:
    """Build dataclass ``cls`` from a JSON object, naming ``where`` in every error."""
    if not isinstance(value, dict):
        raise ValueError(f"JSON field {where} must be an object")
    names = {f.name: f for f in fields(cls)}  # type: ignore[arg-type]
    unknown = set(value) - set(names)
    if unknown:
        raise ValueError(f"JSON field {where} has unknown keys {sorted(unknown)}")
    kwargs: dict[str, Any] = {}
    for key, raw in value.items():
        kwargs[key] = tuple(raw) if isinstance(raw, list) else raw
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"JSON field {where}: {exc}") from exc


def _enum(cls: type[Enum], value: object, where: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)
        raise ValueError(f"JSON field {where} is {value!r}; expected one of {allowed}") from None


def parse_bytes(text: str) -> int:
    """Parse a size such as ``16GiB``, ``16GB``, ``512MiB`` or ``1000`` into bytes.

    ``GB``/``MB``/``KB`` are decimal (1e9...), ``GiB``/``MiB``/``KiB`` binary.
    """
    units = {
        "": 1,
        "b": 1,
        "kb": 10**3,
        "mb": 10**6,
        "gb": 10**9,
        "tb": 10**12,
        "kib": 2**10,
        "mib": 2**20,
        "gib": 2**30,
        "tib": 2**40,
    }
    s = text.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num) :]
    if unit not in units or not num:
        raise ValueError(f"cannot parse size {text!r}; write e.g. '16GiB', '16GB' or '512MiB'")
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; write e.g. '16GiB'") from None
    return int(value * units[unit])


__all__ = [
    "SCHEMA_VERSION",
    "BandwidthPoint",
    "HardwareProfile",
    "MemorySample",
    "ModelProfile",
    "Operation",
    "ParamPlacement",
    "Parameter",
    "Plan",
    "Region",
    "RegionPlan",
    "StatePlacement",
    "Stream",
    "StreamedStepCosts",
    "TimelineInterval",
    "parse_bytes",
    "validate_profile",
]
