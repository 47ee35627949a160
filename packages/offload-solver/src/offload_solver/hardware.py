"""What a machine can move and compute, as measured (``HardwareProfile``), and a default one.

A profile holds measurements of one machine only: copy rates by size, compute rates,
optimizer and conversion rates, the cost of issuing an operation. What the simulator
assumes beyond them, fitted to benchmark rows rather than measured by a probe, is the cost
model (:class:`~offload_solver.cost_model.CostModel`).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from offload_solver._json import (
    SCHEMA_VERSION,
    check_numbers,
    get_field,
    load_document,
    record,
    to_jsonable,
)
from offload_solver.cost_model import COST_MODEL_FIELDS
from offload_solver.host_rates import (
    DEFAULT_HOST_STEP_TIMES,
    HOST_KERNELS,
    HOST_STATES,
    HostStepRate,
    default_host_step_rates,
)
from offload_solver.profile import Operation

GiB = 2**30


@dataclass(frozen=True)
class BandwidthPoint:
    """A measured copy rate for one transfer size."""

    size_bytes: int
    bytes_per_s: float

    def __post_init__(self) -> None:
        check_numbers(self, "BandwidthPoint")


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
    """Fraction of ``compute_flop_per_s`` a training step achieves (0 < e <= 1): a
    measurement of this machine at a model's matrix shapes (``offload_runtime``'s
    ``profile_hardware(matmul_shapes=...)`` times them and takes their FLOP-weighted rate
    over the peak), or an assumed fraction where no shapes were timed."""
    device_memory_bytes: int
    host_memory_bytes: int
    host_adam_params_per_s: float = 4.4e9
    """Host optimizer throughput, parameter elements per second: torch's fused CPU Adam
    with fp32 moments, the step the simulator charges host-state regions (a planner that
    runs another kernel plans with that kernel's rate here, :meth:`host_step_params_per_s`)."""
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
    host_memory_bytes_per_s: float = 0.0
    """Host memory (DRAM) stream bandwidth, bytes read plus written per second (a large
    host-to-host copy; write-allocate traffic not counted, as STREAM's copy does not count
    it); 0 means unknown. A host Adam step moves
    ``offload_solver.host_rates.HOST_STATE_BYTES`` per parameter on its rung of host-state
    precision, so it takes at least that traffic over this rate
    (:meth:`host_memory_time_s`): a lower bound a benchmark sets a step against. The
    simulator prices host steps by their measured rates, not by this."""
    host_copy_contention: float = 1.0
    """Fraction of its standalone rate fused host Adam keeps while pinned copies run in
    both directions at once (0 < c <= 1; 1 when not measured; ``offload_runtime``'s
    ``profile_hardware`` measures it): host memory serves both. The simulator charges each
    host-state region's step for its own copies and runs conversion passes at the
    contended rate ([Note: step model] in ``offload_solver.simulators._engine``)."""
    attention_fwd_flop_per_s: float = 0.0
    """Rate at which fused attention's forward runs (``Operation.attention``), its FLOPs
    as the profile counts them per second; 0 (unknown): the matrix-multiply rate
    (``compute_flop_per_s * compute_efficiency``), which fused attention can fall well
    short of (``offload_runtime.hardware.measure_attention_flop_per_s`` measures it)."""
    attention_bwd_flop_per_s: float = 0.0
    """The same for fused attention's backward."""
    host_step_rates: tuple[HostStepRate, ...] = ()
    """The measured rate of each configuration of the host Adam step the optimizer can run
    on this machine (kernel, host-state rung, fp16 I/O, speculative; see
    ``offload_solver.host_rates``), at most one each; empty where none was measured.
    :meth:`host_step_params_per_s` reads them."""
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        check_numbers(self, "HardwareProfile")
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
        if not 0 <= self.host_memory_bytes_per_s < math.inf:
            raise ValueError(
                "HardwareProfile.host_memory_bytes_per_s is "
                f"{self.host_memory_bytes_per_s}; must be a finite rate >= 0 bytes/s "
                "(0 when unknown)"
            )
        if not 0 < self.host_copy_contention <= 1:
            raise ValueError(
                f"HardwareProfile.host_copy_contention is {self.host_copy_contention}; "
                "must be in (0, 1] (1 when not measured)"
            )
        keys = [rate.key for rate in self.host_step_rates]
        if len(set(keys)) != len(keys):
            raise ValueError(
                "HardwareProfile.host_step_rates has two rates of one configuration "
                "(kernel, state, fp16_io, speculative); keep one each"
            )
        if self.schema_version != SCHEMA_VERSION:
            raise ValueError(
                f"HardwareProfile.schema_version is {self.schema_version}; "
                f"this solver reads version {SCHEMA_VERSION}"
            )

    def host_step_params_per_s(
        self, kernel: str, state: str, fp16_io: bool = False, speculative: bool = False
    ) -> float:
        """Parameters per second of the host Adam step in this configuration (``kernel``
        in ``HOST_KERNELS``, ``state`` in ``HOST_STATES``): torch's fused fp32 plain
        step at :attr:`host_adam_params_per_s`, the profile's reference rate; another
        configuration at its rate in :attr:`host_step_rates` where measured, else at
        :attr:`host_adam_params_per_s` over its documented time ratio
        (``offload_solver.host_rates.DEFAULT_HOST_STEP_TIMES``)."""
        key = (kernel, state, fp16_io, speculative)
        if key not in DEFAULT_HOST_STEP_TIMES:
            raise ValueError(
                f"no host step {key}: kernel in {HOST_KERNELS}, state in {HOST_STATES}, "
                "fp16_io only with the single_pass kernel"
            )
        if key != ("torch", "fp32", False, False):
            for rate in self.host_step_rates:
                if rate.key == key:
                    return rate.params_per_s
        return self.host_adam_params_per_s / DEFAULT_HOST_STEP_TIMES[key]

    def shared_host(self, ranks: int) -> HardwareProfile:
        """This profile as one of ``ranks`` data-parallel processes sharing the host sees
        it: dtype conversions and host memory bandwidth at ``1 / ranks`` of their rates
        (every rank casts every region's new weights and brings its own gradients down,
        on the same cores and DRAM) and ``1 / ranks`` of the host memory. Host Adam rates
        stay whole: each rank steps ``1 / ranks`` of the host state (it is sharded by
        region) on ``1 / ranks`` of the cores, which takes as long as one process
        stepping all of it on the whole host, the time the plan simulates. Copy rates and
        the device are the rank's own. Raises ``ValueError`` unless ``ranks >= 1``."""
        if not isinstance(ranks, int) or isinstance(ranks, bool) or ranks < 1:
            raise ValueError(f"ranks is {ranks!r}; must be an int >= 1")
        if ranks == 1:
            return self
        return dataclasses.replace(
            self,
            name=f"{self.name} (host shared by {ranks} ranks)",
            host_memory_bytes=self.host_memory_bytes // ranks,
            host_convert_elems_per_s=self.host_convert_elems_per_s / ranks,
            host_memory_bytes_per_s=self.host_memory_bytes_per_s / ranks,
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

    def host_memory_time_s(self, traffic_bytes: int) -> float:
        """Seconds host memory takes to move ``traffic_bytes`` (read plus written) at
        :attr:`host_memory_bytes_per_s`; 0 when the bandwidth is unknown."""
        rate = self.host_memory_bytes_per_s
        return traffic_bytes / rate if rate > 0 else 0.0

    def to_json(self) -> str:
        return json.dumps(to_jsonable(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> HardwareProfile:
        """Read a profile written by :meth:`to_json`. Keys this version does not know are
        ignored, as are fields that older versions wrote: ``"issue_ahead": true`` (a
        pricing no longer offered) warns once that it is ignored, and so do the cost
        model's factors (``backward_issue_factor``, ``stream_up_fraction``,
        ``stream_host_charge``) that a profile held before :class:`CostModel` held them,
        where one is not 1 (the value they had when not set):
        :meth:`CostModel.from_hardware_json` reads them from the same document."""
        data = load_document(text, "HardwareProfile")
        if data.get("issue_ahead") is True:
            warnings.warn(_ISSUE_AHEAD_IGNORED, UserWarning, stacklevel=2)
        carried = {k: data[k] for k in COST_MODEL_FIELDS if k in data and data[k] != 1.0}
        if carried:
            warnings.warn(fitted_factors_ignored(carried), UserWarning, stacklevel=2)
        try:
            return HardwareProfile(
                name=get_field(data, "name", str),
                h2d=tuple(
                    record(BandwidthPoint, p, f"h2d[{i}]")
                    for i, p in enumerate(get_field(data, "h2d", list))
                ),
                d2h=tuple(
                    record(BandwidthPoint, p, f"d2h[{i}]")
                    for i, p in enumerate(get_field(data, "d2h", list))
                ),
                compute_flop_per_s=float(get_field(data, "compute_flop_per_s", (int, float))),
                compute_efficiency=float(get_field(data, "compute_efficiency", (int, float))),
                device_memory_bytes=get_field(data, "device_memory_bytes", int),
                host_memory_bytes=get_field(data, "host_memory_bytes", int),
                host_adam_params_per_s=float(
                    get_field(data, "host_adam_params_per_s", (int, float), default=4.4e9)
                ),
                device_adam_params_per_s=float(
                    get_field(data, "device_adam_params_per_s", (int, float), default=50e9)
                ),
                op_overhead_s=float(get_field(data, "op_overhead_s", (int, float), default=0.0)),
                host_convert_elems_per_s=float(
                    get_field(data, "host_convert_elems_per_s", (int, float), default=0.0)
                ),
                device_memory_bytes_per_s=float(
                    get_field(data, "device_memory_bytes_per_s", (int, float), default=0.0)
                ),
                host_memory_bytes_per_s=float(
                    get_field(data, "host_memory_bytes_per_s", (int, float), default=0.0)
                ),
                host_copy_contention=float(
                    get_field(data, "host_copy_contention", (int, float), default=1.0)
                ),
                attention_fwd_flop_per_s=float(
                    get_field(data, "attention_fwd_flop_per_s", (int, float), default=0.0)
                ),
                attention_bwd_flop_per_s=float(
                    get_field(data, "attention_bwd_flop_per_s", (int, float), default=0.0)
                ),
                host_step_rates=tuple(
                    record(HostStepRate, r, f"host_step_rates[{i}]")
                    for i, r in enumerate(get_field(data, "host_step_rates", list, default=[]))
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


def fitted_factors_ignored(carried: Mapping[str, object]) -> str:
    """The warning :meth:`HardwareProfile.from_json` gives for a document that carries the
    cost model's factors ``carried`` (name: value)."""
    told = ", ".join(f"{k}={v!r}" for k, v in carried.items())
    return (
        f"HardwareProfile JSON carries {told}: fitted factors of the cost model, which a "
        "HardwareProfile no longer holds; they are ignored here. To plan with them, read "
        "them with CostModel.from_hardware_json(text) and pass solve(..., cost_model=), or "
        "write them to a CostModel JSON for offload-solve --cost-model; then remove them "
        "from this file."
    )


def default_hardware() -> HardwareProfile:
    """A PCIe Gen5 x16 H200-like machine, for planning without measuring; a run on real
    hardware plans with ``offload_runtime.profile_hardware``'s measurements instead.

    - Pinned copies: 55 GB/s from 16 MB up in both directions, 42 GB/s (H2D) and 48 GB/s
      (D2H) at 1 MB; below 1 MB copies are latency-bound (the 4 KiB and 64 KiB points
      assume about 8 us and 10 us per copy).
    - fp16 matrix multiply peak 740 TFLOP/s with efficiency 0.3: a training step mixes
      small matrix products with memory-bound operations, so most of the peak is out of
      reach.
    - 140 GiB device memory, 128 GiB host memory.
    - Host Adam 4.4e9 parameters/s (fused CPU Adam); device Adam 50e9/s; the other host
      kernels' rates derived from it by their documented ratios
      (:func:`~offload_solver.host_rates.default_host_step_rates`).
    - Host fp16 <-> fp32 conversion 11e9 elements/s.
    - No per-operation issue cost (``op_overhead_s`` 0): it depends on the host's Python
      speed, so only a measured profile has one.
    - Device memory 4.2e12 bytes/s read plus written: memory-bound operations take at
      least their traffic over it.
    - Host memory 150e9 bytes/s read plus written: a little above the 123 GB/s that fused
      host Adam at 4.4e9 parameters/s moves (28 bytes a parameter,
      ``offload_solver.host_rates.HOST_STATE_BYTES["fp32"]``), since that step is bound
      by host memory traffic.
    - Fused host Adam keeps 0.55 of its standalone rate while pinned copies run both ways
      at once (``host_copy_contention``).
    """
    return HardwareProfile(
        name="default-h200-pcie5",
        h2d=(
            BandwidthPoint(4 * 2**10, 0.5e9),
            BandwidthPoint(64 * 2**10, 6.5e9),
            BandwidthPoint(10**6, 42e9),
            BandwidthPoint(16 * 10**6, 54e9),
            BandwidthPoint(256 * 10**6, 55e9),
            BandwidthPoint(10**9, 55e9),
        ),
        d2h=(
            BandwidthPoint(4 * 2**10, 0.5e9),
            BandwidthPoint(64 * 2**10, 6.5e9),
            BandwidthPoint(10**6, 48e9),
            BandwidthPoint(16 * 10**6, 54e9),
            BandwidthPoint(256 * 10**6, 55e9),
            BandwidthPoint(10**9, 54e9),
        ),
        compute_flop_per_s=740e12,
        compute_efficiency=0.3,
        device_memory_bytes=140 * GiB,
        host_memory_bytes=128 * GiB,
        host_adam_params_per_s=4.4e9,
        device_adam_params_per_s=50e9,
        host_convert_elems_per_s=11e9,
        device_memory_bytes_per_s=4.2e12,
        host_memory_bytes_per_s=150e9,
        host_copy_contention=0.55,
        host_step_rates=default_host_step_rates(4.4e9),
    )


__all__ = ["BandwidthPoint", "HardwareProfile", "HostStepRate", "default_hardware"]
