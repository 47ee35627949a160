"""Measure what this machine can move and compute, as an ``offload_solver.HardwareProfile``.

The reference implementation looked the GPU's name up in a table of four devices and crashed
on every other one. Here the numbers the solver needs are measured on the device itself:

- pinned host-to-device and device-to-host copy rates, swept over transfer sizes from
  1 KiB to 1 GiB (powers of 4), because small copies pay a fixed latency that large ones
  do not;
- the best rate of large square matrix products in the training dtype (the peak), and the
  rate on the model's own matrix-product shapes relative to it (the efficiency);
- fused Adam throughput over fp32 tensors on the host and on the device;
- the host's rate of fp16/bf16 <-> fp32 copies (gradient widening and weight publishing);
- how much of its fused Adam rate the host keeps while pinned copies run both ways (they
  share host memory with it);
- the host-side cost of issuing one operation of a GPT-2-like graph, forward and backward.

A CUDA profile takes a few seconds and is cached as JSON per device, dtype and set of
matrix shapes (see [Note: hardware cache]). On the CPU no measurement is made:
:func:`default_cpu_profile` returns documented constants so that CPU tests are
deterministic.

[Note: hardware cache]
Profiles live in :func:`default_cache_dir` (``$OFFLOAD_CACHE_DIR``, else
``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload``), one ``HardwareProfile.to_json``
document per file:

- ``hardware-<format>-<identity key>-<dtype>.json``: the device-level measurements (copy
  sweep, peak matmul rate, Adam rates, host conversion rate, per-operation issue cost) with
  :data:`DEFAULT_COMPUTE_EFFICIENCY`;
- ``hardware-<format>-<identity key>-<dtype>-mm<digest>.json``: the same with the
  efficiency measured on one set of matrix shapes. A new model only costs the matmul
  timing (about a second for a few shapes), not a new copy sweep and the host probes (a
  few seconds, more in a process that has not built a torch optimizer yet: that lazily
  imports ``torch._dynamo``).

The identity key (:attr:`DeviceIdentity.cache_key`) names the GPU model, its UUID (or PCI
bus id) and the torch version, so a different card, or a torch upgrade that may change the
kernels, gets a fresh profile. ``<format>`` (:data:`_CACHE_FORMAT`) changes when a
profile gains a measurement, so that older files, which lack it, are measured again
rather than read with the field's "unknown" default, and when a probe changes what it
measures. ``force=True`` or
``OFFLOAD_REPROFILE=1`` re-measures and overwrites; an unreadable file is re-measured with
a warning.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import os
import platform
import re
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from offload_runtime.attr_reads import flatten_attribute_reads
from offload_solver import BandwidthPoint, HardwareProfile

__all__ = [
    "DEFAULT_COMPUTE_EFFICIENCY",
    "HOST_ADAM_READS_SPREAD",
    "DeviceIdentity",
    "MatmulShape",
    "available_host_memory_bytes",
    "default_cache_dir",
    "default_cpu_profile",
    "device_identity",
    "host_adam_median",
    "measure_attention_flop_per_s",
    "measure_copy_bandwidth",
    "measure_device_adam_params_per_s",
    "measure_device_memory_bytes_per_s",
    "measure_hardware",
    "measure_host_adam_params_per_s",
    "measure_host_convert_elems_per_s",
    "measure_host_copy_contention",
    "measure_matmul_efficiency",
    "measure_op_overhead_s",
    "measure_peak_matmul_flop_per_s",
    "profile_hardware",
    "total_host_memory_bytes",
]

MatmulShape = tuple[int, int, int]
"""``(m, k, n)`` of one matrix product ``[m, k] @ [k, n]`` (a linear layer: ``m`` tokens,
``k`` input features, ``n`` output features)."""

DEFAULT_COMPUTE_EFFICIENCY = 0.5
"""Fraction of the peak matmul rate assumed for a training step when no matrix shapes are
given. A guess, not a measurement: small products (few tokens) run well under the peak,
and products large enough to fill the device run near it. Pass ``matmul_shapes`` to
measure it for the model at hand."""

SWEEP_SIZES_BYTES: tuple[int, ...] = tuple(1024 * 4**i for i in range(11))
"""Copy sizes of the bandwidth sweep: 1 KiB, 4 KiB, ..., 1 GiB."""

_SUPPORTED_DTYPES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}
_REPROFILE_ENV = "OFFLOAD_REPROFILE"
_CACHE_FORMAT = "p5"
"""Version of what a cached profile measures, part of its file name. It changes whenever a
probe is added or changes what it measures, so that files of another version are not
read but measured again."""
_CACHE_ENV = "OFFLOAD_CACHE_DIR"

# Bounds that keep a whole CUDA profile to a few seconds.
_SMALL_COPY_TARGET_BYTES = 64 * 2**20
"""Small copies are issued back to back until about this many bytes move per repetition, so
that the timer's resolution (about 0.5 us) is not what is measured."""
_MAX_COPIES_PER_REP = 64
_PEAK_SQUARE_SIDES = (4096, 8192)
_MAX_DISTINCT_SHAPES = 32
_SHAPE_REP_TARGET_S = 2e-3
_MAX_SHAPE_ITERS = 200
_HOST_ADAM_NUMEL = 32 * 2**20
_DEVICE_ADAM_NUMEL = 64 * 2**20
_DEVICE_COPY_BYTES = 2**30
_ADAM_CHUNK_NUMEL = 8 * 2**20
_HOST_CONVERT_NUMEL = 32 * 2**20
_CONTENTION_COPY_BYTES = 256 * 2**20
_COPY_RATE_HIGH_GUESS = 100e9
"""Bytes/s: above any pinned copy's rate over PCIe Gen5 x16 (about 55 GB/s measured), so
that the copies queued under a host Adam step, sized with it, outlast the step."""
_ISSUE_COST_HIDDEN = 64
"""Hidden size of the per-operation issue-cost graph: small enough that no kernel of it
takes longer to run than to issue."""
"""Adam is timed over several tensors, as a model's parameter list is, not one."""
_LAUNCH_S = 20e-6
"""Generous host cost of issuing one copy; used to size the spin that hides issue time."""


# --------------------------------------------------------------------------------------
# Device identity
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DeviceIdentity:
    """Which device a profile belongs to.

    Filled from NVML (``pynvml``) when it is installed and finds the device, from torch
    otherwise (``source`` says which), and from the operating system for the CPU.
    """

    device_type: Literal["cuda", "cpu"]
    index: int | None
    """CUDA device index as torch numbers it (after ``CUDA_VISIBLE_DEVICES``); ``None`` on CPU."""
    name: str
    """Marketing name, e.g. ``NVIDIA H200``, or the CPU model name."""
    uuid: str | None
    """NVML UUID (``GPU-...``) or torch's UUID of the device; ``None`` when unknown or CPU."""
    pci_bus_id: str | None
    total_memory_bytes: int
    """Device memory (host memory for the CPU)."""
    driver_version: str | None
    """NVIDIA driver version (NVML only)."""
    cuda_version: str | None
    """CUDA version torch was built with (``torch.version.cuda``)."""
    torch_version: str
    source: Literal["nvml", "torch", "host"]

    @property
    def cache_key(self) -> str:
        """A file-name-safe key naming the device model, this very device and the torch version.

        Only letters, digits, ``.``, ``_`` and ``-`` appear in it.
        """
        instance = self.uuid or self.pci_bus_id or f"{self.device_type}{self.index or 0}"
        parts = (self.name, instance, f"torch{self.torch_version}")
        return "-".join(_slug(p) for p in parts)


def _slug(text: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9._]+", "_", text).strip("_.")
    return slug or "unknown"


def device_identity(device: torch.device | str | None = None) -> DeviceIdentity:
    """Identify ``device`` (default: the current CUDA device, else the CPU).

    Raises ``RuntimeError`` when a CUDA device is named and CUDA is not available, and
    ``ValueError`` for a device type other than ``cuda`` / ``cpu`` or an index out of range.
    """
    dev = _resolve_device(device)
    if dev.type == "cpu":
        return DeviceIdentity(
            device_type="cpu",
            index=None,
            name=_cpu_model_name(),
            uuid=None,
            pci_bus_id=None,
            total_memory_bytes=total_host_memory_bytes(),
            driver_version=None,
            cuda_version=None,
            torch_version=str(torch.__version__),
            source="host",
        )
    assert dev.index is not None  # _resolve_device always fills the CUDA index
    props = torch.cuda.get_device_properties(dev.index)
    torch_uuid = _torch_uuid(props)
    torch_pci = _torch_pci_bus_id(props)
    nvml = _nvml_identity(torch_uuid, torch_pci)
    if nvml is not None:
        name, uuid, pci, total, driver = nvml
        return DeviceIdentity(
            device_type="cuda",
            index=dev.index,
            name=name,
            uuid=uuid,
            pci_bus_id=pci,
            total_memory_bytes=total,
            driver_version=driver,
            cuda_version=torch.version.cuda,
            torch_version=str(torch.__version__),
            source="nvml",
        )
    return DeviceIdentity(
        device_type="cuda",
        index=dev.index,
        name=str(props.name),
        uuid=torch_uuid,
        pci_bus_id=torch_pci,
        total_memory_bytes=int(props.total_memory),
        driver_version=None,
        cuda_version=torch.version.cuda,
        torch_version=str(torch.__version__),
        source="torch",
    )


def _torch_uuid(props: object) -> str | None:
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = str(raw).strip()
    return text or None


def _torch_pci_bus_id(props: object) -> str | None:
    """NVML's ``domain:bus:device.function`` spelling from torch's integer PCI fields."""
    parts = [getattr(props, f"pci_{f}_id", None) for f in ("domain", "bus", "device")]
    if not all(isinstance(p, int) for p in parts):
        return None
    domain, bus, dev = parts
    return f"{domain:08X}:{bus:02X}:{dev:02X}.0"


def _nvml_identity(
    torch_uuid: str | None, torch_pci: str | None
) -> tuple[str, str, str | None, int, str | None] | None:
    """``(name, uuid, pci_bus_id, total_memory_bytes, driver_version)`` from NVML, or ``None``.

    The device is looked up by UUID (then PCI bus id), never by index: NVML numbers every
    GPU of the machine while torch numbers only the visible ones, in its own order.
    """
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except (pynvml.NVMLError, OSError, AttributeError):
        return None
    try:
        handle = _nvml_handle(pynvml, torch_uuid, torch_pci)
        if handle is None:
            return None
        name = _text(pynvml.nvmlDeviceGetName(handle))
        uuid = _text(pynvml.nvmlDeviceGetUUID(handle))
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        try:
            pci: str | None = _text(pynvml.nvmlDeviceGetPciInfo(handle).busId)
        except pynvml.NVMLError:
            pci = torch_pci
        try:
            driver: str | None = _text(pynvml.nvmlSystemGetDriverVersion())
        except pynvml.NVMLError:
            driver = None
        return name, uuid, pci, total, driver
    except (pynvml.NVMLError, AttributeError):
        return None
    finally:
        with contextlib.suppress(pynvml.NVMLError):
            pynvml.nvmlShutdown()


def _nvml_handle(pynvml: Any, torch_uuid: str | None, torch_pci: str | None) -> object | None:
    """NVML's handle of the device torch calls ``torch_uuid`` (then ``torch_pci``), or
    ``None``; NVML must be initialised."""
    candidates: list[tuple[Callable[[str], object], str]] = []
    if torch_uuid:
        prefixed = torch_uuid if torch_uuid.startswith(("GPU-", "MIG-")) else f"GPU-{torch_uuid}"
        candidates += [(pynvml.nvmlDeviceGetHandleByUUID, prefixed)]
    if torch_pci:
        candidates += [(pynvml.nvmlDeviceGetHandleByPciBusId, torch_pci)]
    for lookup, key in candidates:
        try:
            return lookup(key)
        except pynvml.NVMLError:
            continue
    return None


def nvml_handle(pynvml: Any, device: int) -> object | None:
    """NVML's handle of torch's CUDA device ``device`` (NVML initialised by the caller),
    found by UUID, then PCI bus id, never by index: NVML numbers every GPU of the machine
    while torch numbers only the visible ones. ``None`` when NVML does not know it."""
    props = torch.cuda.get_device_properties(device)
    return _nvml_handle(pynvml, _torch_uuid(props), _torch_pci_bus_id(props))


def _text(value: object) -> str:
    """NVML strings are ``bytes`` in old ``pynvml`` releases and ``str`` in new ones."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _cpu_model_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "cpu"


# --------------------------------------------------------------------------------------
# Host memory
# --------------------------------------------------------------------------------------


def total_host_memory_bytes() -> int:
    """Physical host memory in bytes, lowered to the cgroup memory limit when one is set.

    Pinned (page-locked) host memory counts against that limit, so it is the one that
    matters for pinned master weights. Returns 0 when the platform reports neither.
    """
    physical = _sysconf_bytes("SC_PHYS_PAGES")
    limit = _cgroup_limit_bytes()
    if limit is not None and (physical == 0 or limit < physical):
        return limit
    return physical


def available_host_memory_bytes() -> int:
    """Host memory in bytes that can be allocated now without swapping (``MemAvailable``).

    Falls back to the free pages the OS reports, then to :func:`total_host_memory_bytes`.
    """
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024  # the file counts KiB
                total = total_host_memory_bytes()
                return min(available, total) if total else available
    free = _sysconf_bytes("SC_AVPHYS_PAGES")
    return free or total_host_memory_bytes()


def _sysconf_bytes(pages_name: str) -> int:
    try:
        return int(os.sysconf(pages_name)) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 0


def _cgroup_limit_bytes() -> int | None:
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        with contextlib.suppress(OSError, ValueError):
            value = int(Path(path).read_text().strip())  # "max" (no limit) raises ValueError
            # cgroup v1 reports "no limit" as a huge page-rounded number.
            if 0 < value < 2**60:
                return value
    return None


# --------------------------------------------------------------------------------------
# The default CPU profile
# --------------------------------------------------------------------------------------


def default_cpu_profile() -> HardwareProfile:
    """The profile used when the "device" is the CPU: constants, not a measurement.

    On the CPU the runtime's uploads and offloads are copies between two host tensors, and
    a profile only has to let the solver and simulator run. These numbers are the same on
    every machine so that plans, and the CPU tests built on them, are deterministic:

    - copies: 10 GB/s both ways at every size (points at 1 KiB and 1 GiB);
    - compute: 100 GFLOP/s at efficiency 0.5;
    - memory: 16 GiB "device", 64 GiB host (not this machine's; use
      :func:`available_host_memory_bytes` for that);
    - Adam: 1e9 parameters/s on host and "device".
    """
    flat = (BandwidthPoint(size_bytes=2**10, bytes_per_s=10e9), BandwidthPoint(2**30, 10e9))
    return HardwareProfile(
        name="cpu-default (constants, not measured)",
        h2d=flat,
        d2h=flat,
        compute_flop_per_s=100e9,
        compute_efficiency=0.5,
        device_memory_bytes=16 * 2**30,
        host_memory_bytes=64 * 2**30,
        host_adam_params_per_s=1e9,
        device_adam_params_per_s=1e9,
    )


# --------------------------------------------------------------------------------------
# Entry point: load from the cache or measure
# --------------------------------------------------------------------------------------


def default_cache_dir() -> Path:
    """``$OFFLOAD_CACHE_DIR``, else ``$XDG_CACHE_HOME/offload``, else ``~/.cache/offload``."""
    explicit = os.environ.get(_CACHE_ENV, "").strip()
    if explicit:
        return Path(explicit).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME", "").strip()
    if xdg:
        return Path(xdg).expanduser() / "offload"
    return Path.home() / ".cache" / "offload"


def profile_hardware(
    device: torch.device | str | None = None,
    *,
    force: bool = False,
    cache_dir: Path | None = None,
    dtype: torch.dtype = torch.float16,
    matmul_shapes: Sequence[MatmulShape] = (),
    progress: bool = True,
) -> HardwareProfile:
    """The hardware profile of ``device``, from the cache when present, else measured.

    Args:
        device: a CUDA device, ``"cpu"``, or ``None`` for the current CUDA device when CUDA
            is available and the CPU otherwise. The CPU gets :func:`default_cpu_profile`
            (not measured, not cached).
        force: re-measure even when a cached profile exists (as does the environment
            variable ``OFFLOAD_REPROFILE=1``), and overwrite the cache.
        cache_dir: folder of the cache files; default :func:`default_cache_dir`.
        dtype: training dtype of the matrix products (float16, bfloat16 or float32).
        matmul_shapes: the model's matrix products as ``(m, k, n)``, repeats counting once
            each time they occur. Each is timed with the two products of its backward pass,
            and ``compute_efficiency`` is their FLOP-weighted rate over the peak. Empty:
            :data:`DEFAULT_COMPUTE_EFFICIENCY`.
        progress: print one line per phase to stderr.

    Raises:
        RuntimeError: a CUDA device is named and CUDA is not available.
        ValueError: an unsupported device type or dtype, or a malformed shape.
    """
    dtype_name = _dtype_name(dtype)
    shapes = _count_shapes(matmul_shapes)
    dev = _resolve_device(device)
    if dev.type == "cpu":
        return default_cpu_profile()

    say = _Progress(enabled=progress)
    identity = device_identity(dev)
    folder = cache_dir if cache_dir is not None else default_cache_dir()
    stem = f"hardware-{_CACHE_FORMAT}-{identity.cache_key}-{dtype_name}"
    base_path = folder / f"{stem}.json"
    shapes_path = folder / f"{stem}-mm{_shapes_digest(shapes)}.json" if shapes else None
    remeasure = force or _env_flag(_REPROFILE_ENV)

    base: HardwareProfile | None = None
    if not remeasure:
        if shapes_path is not None:
            cached = _load_cached(shapes_path)
            if cached is not None:
                say(f"loaded {cached.name} from {shapes_path}")
                return cached
        base = _load_cached(base_path)
        if base is not None:
            say(f"loaded {base.name} from {base_path}")

    if base is None:
        started = time.perf_counter()
        say(f"profiling {identity.name} ({dev}, {dtype_name}); this takes a few seconds")
        base = measure_hardware(dev, dtype=dtype, identity=identity, progress=progress)
        say(f"profiled in {time.perf_counter() - started:.1f} s")
        _store(base_path, base, say)
    if not shapes:
        return base

    efficiency = measure_matmul_efficiency(
        dev, matmul_shapes, peak_flop_per_s=base.compute_flop_per_s, dtype=dtype, progress=progress
    )
    profile = dataclasses.replace(base, compute_efficiency=efficiency)
    assert shapes_path is not None
    _store(shapes_path, profile, say)
    return profile


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ValueError(
            f"device {device!r} is not a device torch understands; pass 'cuda', 'cuda:N', "
            "'cpu' or None"
        ) from exc
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise ValueError(
            f"device {device!r}: hardware profiling supports CUDA devices and the CPU; pass "
            "'cuda', 'cuda:N', 'cpu' or None"
        )
    if not torch.cuda.is_available():
        raise RuntimeError(
            f"device {device!r} was requested but CUDA is not available (torch "
            f"{torch.__version__}, built for CUDA {torch.version.cuda}); pass device='cpu' "
            "(or None) for the default CPU profile, or run on a machine with an NVIDIA GPU "
            "and a CUDA build of torch"
        )
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    count = torch.cuda.device_count()
    if not 0 <= index < count:
        raise ValueError(
            f"device {device!r}: CUDA device index {index} is out of range; this process "
            f"sees {count} device(s), indices 0..{count - 1}"
        )
    return torch.device("cuda", index)


def _dtype_name(dtype: torch.dtype) -> str:
    try:
        return _SUPPORTED_DTYPES[dtype]
    except KeyError:
        allowed = ", ".join(f"torch.{n}" for n in _SUPPORTED_DTYPES.values())
        raise ValueError(f"dtype {dtype} is not supported for profiling; use {allowed}") from None


def _count_shapes(shapes: Sequence[MatmulShape]) -> tuple[tuple[MatmulShape, int], ...]:
    """Distinct shapes with how often each occurs, sorted so the order given does not matter."""
    counts: Counter[MatmulShape] = Counter()
    for i, shape in enumerate(shapes):
        ok = (
            isinstance(shape, (tuple, list))
            and len(shape) == 3
            and all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in shape)
        )
        if not ok:
            raise ValueError(
                f"matmul_shapes[{i}] is {shape!r}; each shape must be (m, k, n) with three "
                "positive ints"
            )
        m, k, n = shape
        counts[(m, k, n)] += 1
    return tuple(sorted(counts.items()))


def _shapes_digest(shapes: tuple[tuple[MatmulShape, int], ...]) -> str:
    text = json.dumps([[list(s), c] for s, c in shapes])
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in {"1", "true", "yes", "on"}


def _load_cached(path: Path) -> HardwareProfile | None:
    """The profile in ``path``; ``None`` (after a warning, if the file exists) when unusable."""
    if not path.exists():
        return None
    try:
        return HardwareProfile.from_json(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError, KeyError) as exc:
        # ValueError covers bad JSON, a wrong schema version and undecodable bytes.
        warnings.warn(
            f"hardware profile cache {path} is unusable ({exc}); re-measuring and overwriting it",
            stacklevel=3,
        )
        return None


def _store(path: Path, profile: HardwareProfile, say: _Progress) -> None:
    """Write ``profile`` atomically: a reader never sees half a file, even with two writers."""
    tmp_name: str | None = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(
            "w", encoding="utf-8", dir=path.parent, prefix=path.name, suffix=".tmp", delete=False
        ) as tmp:
            tmp_name = tmp.name
            tmp.write(profile.to_json())
        Path(tmp_name).replace(path)
        tmp_name = None
        say(f"cached at {path}")
    except OSError as exc:
        warnings.warn(
            f"could not write the hardware profile cache {path} ({exc}); the device will be "
            f"profiled again next time. Set {_CACHE_ENV} to a writable folder to keep it.",
            stacklevel=3,
        )
    finally:
        if tmp_name is not None:
            with contextlib.suppress(OSError):
                Path(tmp_name).unlink()


class _Progress:
    """One short line per phase on stderr, or nothing."""

    def __init__(self, *, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[offload] hardware: {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------
# Measurements
# --------------------------------------------------------------------------------------


def measure_hardware(
    device: torch.device,
    *,
    dtype: torch.dtype = torch.float16,
    identity: DeviceIdentity | None = None,
    progress: bool = False,
) -> HardwareProfile:
    """Measure a CUDA device now, without the cache; ``compute_efficiency`` is the default.

    Copies, peak matmul, both Adam rates, host copy contention, device memory and
    conversion rates, and the per-operation issue cost; the host Adam rate and the issue
    cost are each the median of three reads (first, midway and last;
    :func:`host_adam_median`). A few seconds on a current GPU.
    """
    dev = _resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_hardware needs a CUDA device, got {device!r}")
    dtype_name = _dtype_name(dtype)
    ident = identity if identity is not None else device_identity(dev)
    say = _Progress(enabled=progress)
    with torch.cuda.device(dev):
        try:
            # The issue cost is read three times (first, midway and last) and the median
            # kept: single reads on one machine spread widely, and a launch-bound plan's
            # step scales with it. The median drops one disturbed read without leaning low
            # or high.
            overheads = [measure_op_overhead_s(dev, dtype=dtype)]
            h2d, d2h = measure_copy_bandwidth(dev)
            say(
                f"copies {_fmt_size(h2d[0].size_bytes)}..{_fmt_size(h2d[-1].size_bytes)}: "
                f"H2D {h2d[-1].bytes_per_s / 1e9:.1f} GB/s, D2H {d2h[-1].bytes_per_s / 1e9:.1f}"
                f" GB/s at {_fmt_size(h2d[-1].size_bytes)}"
            )
            peak = measure_peak_matmul_flop_per_s(dev, dtype=dtype)
            say(f"peak {dtype_name} matmul {peak / 1e12:.0f} TFLOP/s")
            adam_numel = _fit_numel(_HOST_ADAM_NUMEL, available_host_memory_bytes())
            host_adams = [measure_host_adam_params_per_s(adam_numel)]
            device_adam = measure_device_adam_params_per_s(dev)
            overheads.append(measure_op_overhead_s(dev, dtype=dtype))
            say(
                f"fused Adam host {host_adams[0] / 1e9:.2f} Gparam/s (first read), "
                f"device {device_adam / 1e9:.1f} Gparam/s"
            )
            contention = measure_host_copy_contention(
                dev, _fit_numel(_HOST_ADAM_NUMEL, available_host_memory_bytes())
            )
            say(f"host Adam keeps {contention:.2f} of its rate while pinned copies run")
            device_memory = measure_device_memory_bytes_per_s(dev)
            say(f"device memory {device_memory / 1e12:.2f} TB/s (read + write)")
            host_adams.append(measure_host_adam_params_per_s(adam_numel))
            host_convert = measure_host_convert_elems_per_s(
                _fit_convert_numel(_HOST_CONVERT_NUMEL, available_host_memory_bytes()),
                dtype=dtype,
            )
            say(f"host {dtype_name} <-> float32 conversion {host_convert / 1e9:.2f} Gelem/s")
            overheads.append(measure_op_overhead_s(dev, dtype=dtype))
            host_adams.append(measure_host_adam_params_per_s(adam_numel))
            host_adam = host_adam_median(host_adams)
            say(
                f"fused Adam host {host_adam / 1e9:.2f} Gparam/s (the median of "
                f"{', '.join(f'{x / 1e9:.2f}' for x in host_adams)} Gparam/s read first, "
                "midway and last)"
            )
            overhead = statistics.median(overheads)
            say(
                f"per-operation issue cost {overhead * 1e6:.1f} us (GPT-2-like graph; the "
                f"median of {', '.join(f'{x * 1e6:.1f}' for x in overheads)} us read first, "
                "midway and last)"
            )
            _, device_total = torch.cuda.mem_get_info(dev)
        finally:
            _release_cached_memory()
    return HardwareProfile(
        name=f"{ident.name} ({dtype_name})",
        h2d=h2d,
        d2h=d2h,
        compute_flop_per_s=peak,
        compute_efficiency=DEFAULT_COMPUTE_EFFICIENCY,
        device_memory_bytes=int(device_total),
        host_memory_bytes=total_host_memory_bytes(),
        host_adam_params_per_s=host_adam,
        device_adam_params_per_s=device_adam,
        op_overhead_s=overhead,
        host_convert_elems_per_s=host_convert,
        device_memory_bytes_per_s=device_memory,
        host_copy_contention=contention,
    )


class _IssueCostBlocks(torch.nn.Module):
    """Tiny GPT-2 blocks written as the operations a traced GPT-2 graph runs, per block:
    layer norm, ``view``/``addmm``/``view`` projections, ``split`` and three ``getitem``,
    head ``view``/``transpose``, causal scaled-dot-product attention, ``transpose``/
    ``contiguous``/``reshape``, dropout, residual adds and the tanh GELU decomposed into
    element-wise ops. Shapes are tiny so that issuing, not computing, is what is timed.
    """

    def __init__(self, layers: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        hidden = _ISSUE_COST_HIDDEN
        self.hidden = hidden
        self.heads = 4

        def weight(*shape: int) -> torch.nn.Parameter:
            return torch.nn.Parameter(0.02 * torch.randn(*shape, device=device, dtype=dtype))

        self.ln_w = torch.nn.ParameterList([weight(hidden) for _ in range(2 * layers)])
        self.ln_b = torch.nn.ParameterList([weight(hidden) for _ in range(2 * layers)])
        # (in, out) features of each block's four projections; plain ints, so that tracing
        # records no shape arithmetic.
        self.dims = [
            (hidden, 3 * hidden),
            (hidden, hidden),
            (hidden, 4 * hidden),
            (4 * hidden, hidden),
        ]
        self.mm_w = torch.nn.ParameterList([weight(*d) for _ in range(layers) for d in self.dims])
        self.mm_b = torch.nn.ParameterList([weight(d[1]) for _ in range(layers) for d in self.dims])
        self.layers = layers

    def _proj(self, x: torch.Tensor, i: int, batch: int, seq: int) -> torch.Tensor:
        fan_in, fan_out = self.dims[i % 4]
        return torch.addmm(self.mm_b[i], x.view(-1, fan_in), self.mm_w[i]).view(batch, seq, fan_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, c = 2, 8, self.hidden
        heads, d = self.heads, self.hidden // self.heads
        for layer in range(self.layers):
            ln, mm = 2 * layer, 4 * layer
            h = torch.nn.functional.layer_norm(x, (c,), self.ln_w[ln], self.ln_b[ln])
            parts = torch.split(self._proj(h, mm, batch, seq), c, dim=2)
            q = parts[0].view(batch, seq, heads, d).transpose(1, 2)
            k = parts[1].view(batch, seq, heads, d).transpose(1, 2)
            v = parts[2].view(batch, seq, heads, d).transpose(1, 2)
            a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            a = a.transpose(1, 2).contiguous().reshape(batch, seq, c)
            a = self._proj(a, mm + 1, batch, seq)
            x = x + torch.nn.functional.dropout(a, 0.1, training=True)
            h = torch.nn.functional.layer_norm(x, (c,), self.ln_w[ln + 1], self.ln_b[ln + 1])
            h = self._proj(h, mm + 2, batch, seq)
            h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
            h = self._proj(h, mm + 3, batch, seq)
            x = x + torch.nn.functional.dropout(h, 0.1, training=True)
        return x.float().sum()  # the loss, as a traced training graph ends


def _issue_cost_graph(
    layers: int, dtype: torch.dtype, device: torch.device
) -> tuple[torch.fx.GraphModule, int]:
    """The traced :class:`_IssueCostBlocks` and its number of operations (``call_*`` nodes:
    per block, the operations ``offload_trace`` records for the same code)."""
    graph = torch.fx.symbolic_trace(_IssueCostBlocks(layers, dtype, device))
    flatten_attribute_reads(graph)  # as the runtime reads its graphs' parameters
    num_ops = sum(
        node.op in ("call_function", "call_method", "call_module") for node in graph.graph.nodes
    )
    return graph, num_ops


def measure_op_overhead_s(
    device: torch.device | str = "cpu",
    *,
    layers: int = 4,
    reps: int = 10,
    dtype: torch.dtype | None = None,
) -> float:
    """Seconds per operation per pass of a tiny GPT-2-like graph, forward and backward.

    The graph is ``layers`` blocks of :class:`_IssueCostBlocks` (linear layers with bias,
    layer norm, split, views and transposes, causal attention, dropout, residual adds, the
    decomposed tanh GELU), traced with ``torch.fx`` and run as a ``GraphModule``, which is
    how the offload runtime runs a model, reading its parameters as the runtime does
    (:func:`~offload_runtime.attr_reads.flatten_attribute_reads`). Its tensors are tiny,
    so one step's time is what issuing the operations costs: Python, dispatcher, autograd
    recording and the backward nodes, kernel launches (views launch none). The result is
    the median wall time of a forward plus backward over twice the graph's operation
    count (its ``call_*`` nodes): the simulator charges ``op_overhead_s`` to every traced
    operation once in forward and once in backward, so that is the per-charge cost a
    graph of this mix needs. ``dtype`` defaults to float16 on CUDA and float32 on the
    CPU.
    """
    if layers < 1 or reps < 1:
        raise ValueError(f"layers ({layers}) and reps ({reps}) must be >= 1")
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    graph, num_ops = _issue_cost_graph(layers, dtype, dev)
    x = torch.randn(2, 8, _ISSUE_COST_HIDDEN, device=dev, dtype=dtype)
    params = list(graph.parameters())

    def step() -> float:
        for p in params:
            p.grad = None
        started = time.perf_counter()
        graph(x).backward()
        if dev.type == "cuda":
            # Sync point: the time must include kernels the host has issued but not run.
            torch.cuda.synchronize(dev)
        return time.perf_counter() - started

    for _ in range(2):
        step()  # first calls allocate and pick kernels
    seconds = statistics.median(step() for _ in range(reps))
    return seconds / (2 * num_ops)


def measure_copy_bandwidth(
    device: torch.device, sizes_bytes: Sequence[int] = SWEEP_SIZES_BYTES
) -> tuple[tuple[BandwidthPoint, ...], tuple[BandwidthPoint, ...]]:
    """Pinned ``(h2d, d2h)`` copy rates in bytes/s at each size that fits.

    Copies are ``copy_(non_blocking=True)`` on a side stream (as the runtime's copy streams
    issue them), timed with CUDA events, median of several repetitions. Sizes above a
    quarter of the free device memory or of the available host memory are left out.
    """
    sizes = sorted(set(sizes_bytes))
    if not sizes or sizes[0] <= 0:
        raise ValueError(f"sizes_bytes {list(sizes_bytes)!r} must be non-empty and positive")
    free_device, _ = torch.cuda.mem_get_info(device)
    room = min(free_device, available_host_memory_bytes() or free_device) // 4
    fitting = [s for s in sizes if s <= room] or sizes[:1]
    host, dev_buf = _copy_buffers(device, fitting[-1])
    fitting = [s for s in fitting if s <= host.numel()]
    # A side stream, as the runtime's H2D / D2H streams are.
    stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
    h2d: list[BandwidthPoint] = []
    d2h: list[BandwidthPoint] = []
    for size in fitting:
        src_host, dst_dev = host[:size], dev_buf[:size]
        iters = max(1, min(_MAX_COPIES_PER_REP, _SMALL_COPY_TARGET_BYTES // size))
        reps = 5 if size <= _SMALL_COPY_TARGET_BYTES else 3
        up_s = _cuda_time_per_call_s(
            _copy_fn(dst_dev, src_host),
            stream=stream,
            iters=iters,
            reps=reps,
            hide_launch=True,
        )
        down_s = _cuda_time_per_call_s(
            _copy_fn(src_host, dst_dev),
            stream=stream,
            iters=iters,
            reps=reps,
            hide_launch=True,
        )
        h2d.append(BandwidthPoint(size_bytes=size, bytes_per_s=size / up_s))
        d2h.append(BandwidthPoint(size_bytes=size, bytes_per_s=size / down_s))
    del host, dev_buf
    return tuple(h2d), tuple(d2h)


def _copy_buffers(device: torch.device, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A pinned host buffer and a device buffer of ``size`` bytes, smaller if pinning fails.

    One pair serves every size of the sweep (as slices): pinning 1 GiB takes a noticeable
    fraction of a second, and doing it once per size would dominate the sweep.
    """
    while True:
        try:
            host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
            dev_buf = torch.empty(size, dtype=torch.uint8, device=device)
            return host, dev_buf
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            if size <= 2**10:
                raise RuntimeError(
                    f"could not allocate {size} bytes of pinned host memory and device memory "
                    f"for the copy sweep ({exc}); free some memory, or raise the locked-memory "
                    "limit (ulimit -l) if pinning is refused"
                ) from exc
            size //= 4


def measure_peak_matmul_flop_per_s(
    device: torch.device, *, dtype: torch.dtype = torch.float16
) -> float:
    """The best FLOP/s of square ``dtype`` matrix products of side 4096 and 8192.

    Random operands (zeros run faster than real data would). float32 runs whatever
    ``torch.backends.cuda.matmul.allow_tf32`` currently selects.
    """
    _dtype_name(dtype)
    element = torch.empty((), dtype=dtype).element_size()
    free_device, _ = torch.cuda.mem_get_info(device)
    sides = [n for n in _PEAK_SQUARE_SIDES if 3 * n * n * element <= free_device // 2]
    if not sides:
        sides = [1024]
    best = 0.0
    _warm_up_clocks(device, dtype)
    for n in sorted(sides, reverse=True):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        out = torch.empty(n, n, device=device, dtype=dtype)
        flop = 2 * n**3
        iters = max(2, min(50, math.ceil(20e-3 * 1e15 / flop)))
        seconds = _cuda_time_per_call_s(
            _mm_fn(a, b, out),
            stream=torch.cuda.current_stream(device),
            iters=iters,
            reps=3,
            warmup=2,
            statistic=min,
        )
        best = max(best, flop / seconds)
        del a, b, out
    return best


def measure_matmul_efficiency(
    device: torch.device,
    shapes: Sequence[MatmulShape],
    *,
    peak_flop_per_s: float,
    dtype: torch.dtype = torch.float16,
    progress: bool = False,
) -> float:
    """The model's matrix products' rate as a fraction of ``peak_flop_per_s``, in (0, 1].

    ``shapes`` lists ``(m, k, n)``, a shape counting once each time it occurs. Each shape
    is timed as three products: the forward ``[m,k]@[k,n]`` and the backward's
    ``[m,n]@[n,k]`` (input gradient) and ``[n,m]@[m,k]`` (weight gradient), each back to
    back as eager training issues them, so the launch overhead of small products counts.
    The result is total FLOP over total time, over the peak; only the 32 shapes with the
    most FLOP are timed (they carry the cost). Shapes whose operands would take more than
    half the free device memory are skipped; if all are, the default efficiency is
    returned with a warning.
    """
    if peak_flop_per_s <= 0:
        raise ValueError(f"peak_flop_per_s is {peak_flop_per_s}; must be > 0")
    dtype_name = _dtype_name(dtype)
    counted = _count_shapes(shapes)
    say = _Progress(enabled=progress)
    top = sorted(counted, key=lambda sc: sc[1] * sc[0][0] * sc[0][1] * sc[0][2], reverse=True)
    top = top[:_MAX_DISTINCT_SHAPES]
    element = torch.empty((), dtype=dtype).element_size()
    total_flop = 0.0
    total_s = 0.0
    with torch.cuda.device(device):
        try:
            free_device, _ = torch.cuda.mem_get_info(device)
            stream = torch.cuda.current_stream(device)
            # The ratio to a peak measured on warm clocks needs warm clocks here too.
            _warm_up_clocks(device, dtype)
            for (m, k, n), count in top:
                if (m * k + k * n + m * n) * element > free_device // 2:
                    continue
                for mm, kk, nn in ((m, k, n), (m, n, k), (n, m, k)):
                    a = torch.randn(mm, kk, device=device, dtype=dtype)
                    b = torch.randn(kk, nn, device=device, dtype=dtype)
                    out = torch.empty(mm, nn, device=device, dtype=dtype)
                    flop = 2.0 * mm * kk * nn
                    iters = max(
                        1,
                        min(
                            _MAX_SHAPE_ITERS,
                            math.ceil(_SHAPE_REP_TARGET_S * peak_flop_per_s / flop),
                        ),
                    )
                    seconds = _cuda_time_per_call_s(
                        _mm_fn(a, b, out),
                        stream=stream,
                        iters=iters,
                        reps=3,
                        warmup=2,
                    )
                    total_flop += count * flop
                    total_s += count * seconds
                    del a, b, out
        finally:
            _release_cached_memory()
    if total_s <= 0:
        warnings.warn(
            "no matmul shape fits in free device memory; using the default compute "
            f"efficiency {DEFAULT_COMPUTE_EFFICIENCY}",
            stacklevel=2,
        )
        return DEFAULT_COMPUTE_EFFICIENCY
    rate = total_flop / total_s
    efficiency = min(1.0, rate / peak_flop_per_s)
    say(
        f"{len(top)} {dtype_name} matmul shape(s) with backward: {rate / 1e12:.0f} TFLOP/s "
        f"= {efficiency:.2f} of peak"
    )
    return efficiency


def measure_host_convert_elems_per_s(
    numel: int = _HOST_CONVERT_NUMEL, *, dtype: torch.dtype = torch.float16, reps: int = 3
) -> float:
    """Host dtype-converting copies between ``dtype`` and float32, elements/s.

    What the runtime's host worker does to every host-state region each step: widen its
    ``dtype`` gradients into the fp32 accumulator, and publish the fp32 master into the
    ``dtype`` copy. Both directions are timed (median of ``reps`` each, after one untimed
    copy each that faults the pages in) over ``numel`` elements of plain host memory;
    the rate is ``numel`` over the mean of the two medians, with torch's current number of
    CPU threads. Pinned memory is not needed: a host-to-host copy runs at the same memory
    bandwidth, and pinning would only slow profiling down. Needs ``6 * numel`` bytes
    (fp16/bf16).
    """
    if numel < 1 or reps < 1:
        raise ValueError(f"numel ({numel}) and reps ({reps}) must be >= 1")
    _dtype_name(dtype)
    narrow = torch.empty(numel, dtype=dtype)
    wide = torch.empty(numel, dtype=torch.float32)
    narrow.fill_(1.0)

    def timed(dst: torch.Tensor, src: torch.Tensor) -> float:
        started = time.perf_counter()
        dst.copy_(src)
        return time.perf_counter() - started

    timed(wide, narrow)
    timed(narrow, wide)
    widen_s = statistics.median(timed(wide, narrow) for _ in range(reps))
    publish_s = statistics.median(timed(narrow, wide) for _ in range(reps))
    return numel / max((widen_s + publish_s) / 2, 1e-9)


def measure_host_adam_params_per_s(
    numel: int = _HOST_ADAM_NUMEL, *, steps: int = 5, settle_s: float = 0.25
) -> float:
    """Fused ``torch.optim.Adam`` steps over ``numel`` fp32 host parameters: elements/s.

    Median wall time of ``steps`` timed steps after one untimed step (which allocates the
    moments) and ``settle_s`` seconds of sleep. Uses torch's current number of CPU
    threads. Needs about ``16 * numel`` bytes. The sleep lets another thread pool that
    has just run (numba's, whose OpenMP threads may spin for a while after a kernel)
    go idle: torch's fused step runs slower right after such a kernel than alone, and this
    rate is what every plan's host steps are charged against.
    """
    if numel < 1 or steps < 1:
        raise ValueError(f"numel ({numel}) and steps ({steps}) must be >= 1")
    if settle_s < 0:
        raise ValueError(f"settle_s ({settle_s}) must be >= 0")
    timed_step = _timed_host_adam(numel)
    if settle_s:
        time.sleep(settle_s)
    return numel / max(statistics.median(timed_step() for _ in range(steps)), 1e-9)


HOST_ADAM_READS_SPREAD = 1.5
"""Ratio of the fastest to the slowest of a profile's host Adam reads above which
:func:`host_adam_median` warns: wider than the spread of reads on a quiet host, so a
warning means that something else used the host while it was profiled."""


def host_adam_median(reads: Sequence[float]) -> float:
    """The median of a profile's host Adam reads (parameters/s), warning when they
    disagree by more than :data:`HOST_ADAM_READS_SPREAD`.

    One read is a few fused steps over tens of milliseconds, and every plan charges its
    host steps at this rate: a read taken while the host is busy with something else
    (a fraction of the quiet rate) is cached with the profile and misleads every plan
    after it, which then streams too many regions and predicts too long a step. The median
    of reads taken first, midway and last through the profile drops one such read. A
    larger spread is told, with how to measure again.
    """
    if not reads or any(not (r > 0 and math.isfinite(r)) for r in reads):
        raise ValueError(f"host Adam reads must be positive and finite, got {list(reads)}")
    median = statistics.median(reads)
    if max(reads) > HOST_ADAM_READS_SPREAD * min(reads):
        warnings.warn(
            "the hardware profile's host Adam reads disagree ("
            + ", ".join(f"{r / 1e9:.2f}" for r in reads)
            + f" Gparam/s); keeping the median, {median / 1e9:.2f}. Something else was "
            "using the host while it was profiled: measure again on a quiet host "
            "(OFFLOAD_REPROFILE=1), or tell memory_optimize the rate "
            "(host_step_params_per_s=).",
            RuntimeWarning,
            stacklevel=2,
        )
    return median


def _timed_host_adam(numel: int) -> Callable[[], float]:
    """A fused ``torch.optim.Adam`` over ``numel`` fp32 host parameters, stepped once
    (which allocates the moments), and a function that times one more step in seconds."""
    params = _adam_params(numel, torch.device("cpu"))
    optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
    optimizer.step()

    def timed_step() -> float:
        started = time.perf_counter()
        optimizer.step()
        return time.perf_counter() - started

    return timed_step


def measure_host_copy_contention(
    device: torch.device,
    numel: int = _HOST_ADAM_NUMEL,
    *,
    steps: int = 7,
    copy_bytes: int = _CONTENTION_COPY_BYTES,
) -> float:
    """Fraction of its standalone rate fused host Adam keeps while pinned copies run.

    Times ``steps`` pairs of fused ``torch.optim.Adam`` steps over ``numel`` fp32 host
    parameters: one alone, then one while a host-to-device and a device-to-host stream each
    copy a ``copy_bytes`` pinned buffer back to back (as the runtime's prefetches and
    gradient copies do during a step), and returns the ratio of the medians, in (0, 1].
    The two kinds alternate so that a host that slows down or speeds up while this runs
    (other work on a shared machine) moves both medians alike; measured as one block after
    the other, a host that slowed down in between would read far too low. The copies
    are queued for three times the standalone step (doubled whenever they finished before
    the step did), so they run for its whole duration. Needs ``16 * numel`` bytes of host
    memory, ``2 * copy_bytes`` pinned, and ``2 * copy_bytes`` on the device (``copy_bytes``
    is lowered to fit a quarter of the free memory on either side).
    """
    if numel < 1 or steps < 1 or copy_bytes < 1:
        raise ValueError(
            f"numel ({numel}), steps ({steps}) and copy_bytes ({copy_bytes}) must be >= 1"
        )
    dev = _resolve_device(device)
    if dev.type != "cuda":
        raise ValueError(f"measure_host_copy_contention needs a CUDA device, got {device!r}")
    timed_step = _timed_host_adam(numel)
    alone_s = timed_step()  # sizes the copies; not a sample
    # Two buffers on each side: keep them within a quarter of what is free, as the sweep does.
    free_device, _ = torch.cuda.mem_get_info(dev)
    room = min(free_device, available_host_memory_bytes() or free_device) // 8
    copy_bytes = max(1 << 20, min(copy_bytes, room))
    up_src, down_dst = (
        torch.empty(copy_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(2)
    )
    up_dst, down_src = (torch.empty(copy_bytes, dtype=torch.uint8, device=dev) for _ in range(2))
    up = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    down = torch.cuda.Stream(dev)  # type: ignore[no-untyped-call]
    up_dst.copy_(up_src, non_blocking=True)  # first touch of the buffers and streams
    torch.cuda.synchronize(dev)
    copy_s = max(copy_bytes / _COPY_RATE_HIGH_GUESS, 1e-6)
    copies = max(2, math.ceil(3 * alone_s / copy_s))
    alone: list[float] = []
    samples: list[float] = []
    attempts = 0
    while len(samples) < steps and attempts < 4 * steps:
        attempts += 1
        if len(alone) == len(samples):  # each sample under copies has its own alone
            alone.append(timed_step())
        done = []
        for stream, dst, src in ((up, up_dst, up_src), (down, down_dst, down_src)):
            with torch.cuda.stream(stream):
                for _ in range(copies):
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(stream)
                done.append(event)
        took = timed_step()
        outlasted = not any(event.query() for event in done)  # type: ignore[no-untyped-call]
        torch.cuda.synchronize(dev)
        if outlasted:
            samples.append(took)
        else:  # a copy stream ran dry before the step ended: queue more and retry
            copies *= 2
    del up_src, down_dst, up_dst, down_src
    if not samples:
        raise RuntimeError(
            "the copies never outlasted a host Adam step; the device's copies seem far "
            "faster than assumed"
        )
    return min(1.0, statistics.median(alone[: len(samples)]) / statistics.median(samples))


def measure_device_adam_params_per_s(
    device: torch.device, numel: int = _DEVICE_ADAM_NUMEL, *, steps: int = 5
) -> float:
    """Fused ``torch.optim.Adam`` over ``numel`` fp32 parameters on a CUDA device: elements/s.

    Timed with CUDA events; ``numel`` is lowered to fit a quarter of the free memory (each
    element needs 16 bytes: parameter, gradient, two moments).
    """
    if numel < 1 or steps < 1:
        raise ValueError(f"numel ({numel}) and steps ({steps}) must be >= 1")
    free_device, _ = torch.cuda.mem_get_info(device)
    numel = _fit_numel(numel, free_device)
    params = _adam_params(numel, device)
    optimizer = torch.optim.Adam(params, lr=1e-3, fused=True)
    seconds = _cuda_time_per_call_s(
        optimizer.step, stream=torch.cuda.current_stream(device), iters=steps, reps=3
    )
    del optimizer, params
    return numel / seconds


def measure_attention_flop_per_s(
    device: torch.device | str,
    *,
    batch: int,
    heads: int,
    seq: int,
    head_dim: int,
    dtype: torch.dtype | None = None,
    dropout_p: float = 0.0,
    reps: int = 5,
) -> tuple[float, float]:
    """(forward, backward) rates of causal fused attention at one shape, FLOP/s.

    Runs ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` on ``[batch, heads,
    seq, head_dim]`` tensors that need gradients, and its backward, and divides the FLOPs
    ``torch.utils.flop_counter`` counts for each (the count the trace records for the
    profile's attention operations; where it counts none, as for the CPU's kernel, its
    ``sdpa_flop_count`` formulas) by its median time: for
    ``HardwareProfile.attention_fwd_flop_per_s`` / ``attention_bwd_flop_per_s``, which
    ``profile_hardware`` leaves to ``memory_optimize`` (it measures at the model's own
    shapes). On CUDA the times are the device's (events,
    several calls back to back); the backward's is that of forward and backward less the
    forward's. ``dtype`` defaults to float16 on CUDA and float32 on the CPU. Measure at
    the model's own shape and dropout (``dropout_p``): a head size the kernel pads (the
    example zoo's GPT-2 XL has 32 heads of 50) and dropout in attention both change the
    rate.
    """
    from torch.nn import functional as F
    from torch.utils.flop_counter import (
        FlopCounterMode,
        sdpa_backward_flop_count,
        sdpa_flop_count,
    )

    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if min(batch, heads, seq, head_dim, reps) < 1:
        raise ValueError(
            f"batch, heads, seq, head_dim and reps must be >= 1, got {batch}, {heads}, "
            f"{seq}, {head_dim}, {reps}"
        )
    dev = torch.device(device)
    if dtype is None:
        dtype = torch.float16 if dev.type == "cuda" else torch.float32
    shape = (batch, heads, seq, head_dim)
    q, k, v = (torch.randn(shape, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    grad = torch.randn(shape, device=dev, dtype=dtype)

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    def both() -> None:
        for t in (q, k, v):
            t.grad = None
        torch.autograd.backward(forward(), grad)

    with FlopCounterMode(display=False) as counter:
        out = forward()
    fwd_flop = counter.get_total_flops()
    with FlopCounterMode(display=False) as counter:
        torch.autograd.backward(out, grad)
    bwd_flop = counter.get_total_flops()
    if not fwd_flop or not bwd_flop:
        # The CPU's fused kernel has no formula registered: count as the flash kernel's.
        fwd_flop = sdpa_flop_count(shape, shape, shape)  # type: ignore[no-untyped-call]
        bwd_flop = sdpa_backward_flop_count(shape, shape, shape, shape)  # type: ignore[no-untyped-call]
    if dev.type == "cuda":
        stream = torch.cuda.current_stream(dev)
        iters = 4
        fwd_s = _cuda_time_per_call_s(forward, stream=stream, iters=iters, reps=reps)
        both_s = _cuda_time_per_call_s(both, stream=stream, iters=iters, reps=reps)
    else:

        def timed(fn: Callable[[], object]) -> float:
            fn()
            samples = []
            for _ in range(reps):
                started = time.perf_counter()
                fn()
                samples.append(time.perf_counter() - started)
            return statistics.median(samples)

        fwd_s = timed(forward)
        both_s = timed(both)
    bwd_s = max(both_s - fwd_s, 1e-9)
    return fwd_flop / max(fwd_s, 1e-9), bwd_flop / bwd_s


def measure_device_memory_bytes_per_s(
    device: torch.device, size_bytes: int = _DEVICE_COPY_BYTES, *, iters: int = 5
) -> float:
    """Device memory bandwidth of a CUDA device: bytes read plus written per second by an
    on-device copy of ``size_bytes`` (lowered to fit an eighth of the free memory).

    Timed with CUDA events, median of three repetitions of ``iters`` copies.
    """
    if size_bytes < 1 or iters < 1:
        raise ValueError(f"size_bytes ({size_bytes}) and iters ({iters}) must be >= 1")
    if torch.device(device).type != "cuda":
        raise ValueError(f"measure_device_memory_bytes_per_s needs a CUDA device, got {device!r}")
    free_device, _ = torch.cuda.mem_get_info(device)
    size = max(2**20, min(size_bytes, free_device // 8))
    src = torch.empty(size, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    seconds = _cuda_time_per_call_s(
        lambda: dst.copy_(src), stream=torch.cuda.current_stream(device), iters=iters, reps=3
    )
    return 2 * size / seconds


def _fit_numel(numel: int, room_bytes: int) -> int:
    """Shrink an Adam measurement (16 bytes per element) to a quarter of ``room_bytes``."""
    if room_bytes <= 0:
        return numel
    return max(2**16, min(numel, room_bytes // 4 // 16))


def _fit_convert_numel(numel: int, room_bytes: int) -> int:
    """Shrink a conversion measurement (at most 8 bytes per element) to a quarter of
    ``room_bytes``."""
    if room_bytes <= 0:
        return numel
    return max(2**16, min(numel, room_bytes // 4 // 8))


def _adam_params(numel: int, device: torch.device) -> list[torch.Tensor]:
    params = []
    remaining = numel
    while remaining > 0:
        size = min(remaining, _ADAM_CHUNK_NUMEL)
        p = torch.zeros(size, dtype=torch.float32, device=device, requires_grad=True)
        # Adam's cost does not depend on the values; a gradient must only be present.
        p.grad = torch.full_like(p, 1e-3)
        params.append(p)
        remaining -= size
    return params


def _copy_fn(dst: torch.Tensor, src: torch.Tensor) -> Callable[[], object]:
    def copy() -> object:
        return dst.copy_(src, non_blocking=True)

    return copy


def _mm_fn(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> Callable[[], object]:
    def mm() -> object:
        return torch.mm(a, b, out=out)

    return mm


def _cuda_time_per_call_s(
    fn: Callable[[], object],
    *,
    stream: torch.cuda.Stream,
    iters: int,
    reps: int,
    warmup: int = 1,
    hide_launch: bool = False,
    statistic: Callable[[list[float]], float] = statistics.median,
) -> float:
    """``statistic`` (default median) over ``reps`` of the device time of ``iters``
    back-to-back calls, per call.

    ``hide_launch`` first queues a spin kernel so that all ``iters`` calls are issued
    before the start event fires: the time is then the device's, not the host's issue
    rate (which matters for microsecond copies).
    """
    start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
    sleep = getattr(torch.cuda, "_sleep", None)
    clock_hz = 1e3 * torch.cuda.get_device_properties(stream.device).clock_rate
    samples = []
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
        for _ in range(reps):
            if hide_launch and sleep is not None:
                sleep(int(min(iters * _LAUNCH_S, 5e-3) * clock_hz))
            start.record(stream)
            for _ in range(iters):
                fn()
            end.record(stream)
            # Sync point: the host waits so that each repetition starts on an idle stream.
            end.synchronize()
            samples.append(float(start.elapsed_time(end)) / 1e3 / iters)
    return max(statistic(samples), 1e-9)


def _warm_up_clocks(device: torch.device, dtype: torch.dtype, seconds: float = 0.3) -> None:
    """Run matrix products for ``seconds`` so the device leaves its idle clocks.

    An idle GPU sits at a fraction of its boost clock: without this, the peak read on a
    fresh process is several percent low. Skipped when the device has too little free
    memory for the operands.
    """
    n = 4096
    element = torch.empty((), dtype=dtype).element_size()
    free_device, _ = torch.cuda.mem_get_info(device)
    if 3 * n * n * element > free_device // 2:
        return
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(10):
            torch.mm(a, b, out=out)
        # Sync point: bounds the queued work so the loop ends near ``seconds``.
        torch.cuda.synchronize(device)


def _release_cached_memory() -> None:
    """Return the profiler's device blocks and pinned host blocks to the system.

    Profiling runs before the model is placed; its gigabyte buffers would otherwise stay
    in torch's caching allocators, and the pinned host allocator never splits a cached
    block, so a 1 GiB pinned block would be held for the life of the process.
    """
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    host_empty = getattr(torch._C, "_host_emptyCache", None)
    if host_empty is not None:
        host_empty()


def _fmt_size(size_bytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size_bytes >= scale:
            return f"{size_bytes / scale:g} {unit}"
    return f"{size_bytes} B"
