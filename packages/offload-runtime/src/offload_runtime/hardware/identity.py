"""Which device a profile belongs to: the key of the profile cache.

:class:`DeviceIdentity` names the device model, this very device (NVML UUID or PCI bus id)
and the torch version; its :attr:`~DeviceIdentity.cache_key` is part of every cache file
name (see [Note: hardware cache] in ``cache.py``), so a different card, or a torch upgrade
that may change the kernels, gets a fresh profile.
"""

from __future__ import annotations

import contextlib
import platform
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from offload_runtime.hardware.host_memory import total_host_memory_bytes

__all__ = ["DeviceIdentity", "device_identity", "nvml_handle", "resolve_device"]


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
    dev = resolve_device(device)
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


def resolve_device(device: torch.device | str | None) -> torch.device:
    """``device`` as a ``torch.device`` with its CUDA index filled in (``None``: the current
    CUDA device when CUDA is available, else the CPU); a named error for anything else."""
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
