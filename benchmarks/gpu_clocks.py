"""What the GPU's clocks, power and temperature did while steps were timed (NVML).

``offload_bench.py`` samples them around every kind's timed steps and records the
summary in the row (``gpu_clocks``). Session 38 found our W3 kernels 3-16% longer than
the same kernels in full-GPU training alone, copies or not (``kernel_overlap.py``): a
lower SM clock under a power cap would do that, and these fields say whether it did.

:class:`ClockSampler` is a context manager: a daemon thread reads the device every
``interval_s`` seconds until the block ends; :meth:`ClockSampler.summary` gives medians
and extremes. Without ``pynvml`` or the device it records why instead, and nothing fails.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from types import TracebackType
from typing import Any

INTERVAL_S = 0.02
"""Seconds between samples."""


class ClockSampler:
    """Samples SM and memory clocks (MHz), power (W), temperature (C) and the clock
    event (throttle) reasons of ``device`` (a CUDA index) while the block runs."""

    def __init__(self, device: int = 0, interval_s: float = INTERVAL_S) -> None:
        self.device = device
        self.interval_s = interval_s
        self.samples: list[tuple[float, float, float, float, int]] = []
        """(sm_mhz, mem_mhz, power_w, temp_c, reasons) per sample."""
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._nvml: Any = None
        self._handle: Any = None

    def __enter__(self) -> ClockSampler:
        try:
            import pynvml
        except ImportError:
            self.error = "pynvml is not installed"
            return self
        try:
            pynvml.nvmlInit()
        except Exception as exc:  # NVML raises its own error types; none must stop a row
            self.error = f"NVML: {exc}"
            return self
        try:
            self._handle = _handle_for(pynvml, self.device)
        except Exception as exc:
            self.error = f"NVML: {exc}"
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return self
        self._nvml = pynvml
        self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if self._nvml is not None:
            with contextlib.suppress(Exception):  # shutting down is best effort
                self._nvml.nvmlShutdown()

    def _run(self) -> None:
        nv, h = self._nvml, self._handle
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or getattr(
            nv, "nvmlDeviceGetCurrentClocksThrottleReasons", None
        )
        while not self._stop.is_set():
            try:
                self.samples.append(
                    (
                        float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
                        float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM)),
                        nv.nvmlDeviceGetPowerUsage(h) / 1e3,
                        float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU)),
                        int(reasons(h)) if reasons is not None else 0,
                    )
                )
            except Exception as exc:  # a failing read ends the sampling, not the row
                self.error = f"NVML: {exc}"
                return
            self._stop.wait(self.interval_s)

    def summary(self) -> dict[str, Any]:
        """Medians, the SM clock's minimum, the largest power and temperature, and the
        union of the clock event reasons seen (NVML's bitmask) over the samples."""
        return summarise(self.samples, self.error)


def summarise(
    samples: list[tuple[float, float, float, float, int]], error: str | None = None
) -> dict[str, Any]:
    """:meth:`ClockSampler.summary` of ``samples``."""
    if not samples:
        return {"samples": 0, "error": error or "no samples"}
    sm, mem, power, temp, reasons = zip(*samples, strict=True)
    union = 0
    for r in reasons:
        union |= r
    out: dict[str, Any] = {
        "samples": len(samples),
        "sm_mhz_median": statistics.median(sm),
        "sm_mhz_min": min(sm),
        "mem_mhz_median": statistics.median(mem),
        "power_w_median": statistics.median(power),
        "power_w_max": max(power),
        "temp_c_max": max(temp),
        "event_reasons": union,
    }
    if error is not None:
        out["error"] = error
    return out


def _handle_for(pynvml: Any, device: int) -> Any:
    """NVML's handle of torch's CUDA device ``device`` (``offload_runtime.hardware``'s
    lookup, by UUID then PCI bus id); LookupError when NVML does not know it."""
    from offload_runtime.hardware import nvml_handle

    handle = nvml_handle(pynvml, device)
    if handle is None:
        raise LookupError(f"NVML has no device matching torch's cuda:{device}")
    return handle


def timed(seconds: float) -> dict[str, Any]:
    """Sample for ``seconds`` (a check from the command line on a GPU machine)."""
    with ClockSampler() as sampler:
        time.sleep(seconds)
    return sampler.summary()


if __name__ == "__main__":
    print(timed(1.0))
