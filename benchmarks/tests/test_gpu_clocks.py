"""benchmarks/gpu_clocks.py: NVML samples around the timed steps, and no failure without."""

from __future__ import annotations

import sys
import time
import types
from typing import Any

import gpu_clocks
import pytest
from gpu_clocks import ClockSampler, summarise


def test_summaries_take_medians_extremes_and_every_reason() -> None:
    got = summarise([(1980.0, 3200.0, 650.0, 60.0, 0), (1755.0, 3200.0, 700.0, 64.0, 4)])
    assert got == {
        "samples": 2,
        "sm_mhz_median": pytest.approx(1867.5),
        "sm_mhz_min": 1755.0,
        "mem_mhz_median": 3200.0,
        "power_w_median": pytest.approx(675.0),
        "power_w_max": 700.0,
        "temp_c_max": 64.0,
        "event_reasons": 4,
    }
    assert summarise([], "NVML: gone") == {"samples": 0, "error": "NVML: gone"}


def _fake_nvml(calls: list[str]) -> types.ModuleType:
    nv = types.ModuleType("pynvml")
    nv.NVML_CLOCK_SM, nv.NVML_CLOCK_MEM, nv.NVML_TEMPERATURE_GPU = 1, 2, 0  # type: ignore[attr-defined]
    clocks = {1: 1500, 2: 3200}

    def record(name: str, value: Any) -> Any:
        calls.append(name)
        return value

    nv.nvmlInit = lambda: record("init", None)  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: record("shutdown", None)  # type: ignore[attr-defined]
    nv.nvmlDeviceGetClockInfo = lambda h, which: clocks[which]  # type: ignore[attr-defined]
    nv.nvmlDeviceGetPowerUsage = lambda h: 600_000  # type: ignore[attr-defined]
    nv.nvmlDeviceGetTemperature = lambda h, which: 55  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCurrentClocksEventReasons = lambda h: 4  # type: ignore[attr-defined]
    return nv


def test_the_sampler_reads_the_device_until_the_block_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[str] = []
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml(calls))
    monkeypatch.setattr(gpu_clocks, "_handle_for", lambda nv, device: ("handle", device))
    with ClockSampler(interval_s=0.001) as sampler:
        deadline = time.monotonic() + 5.0
        while len(sampler.samples) < 3 and time.monotonic() < deadline:
            time.sleep(0.001)
    taken = len(sampler.samples)
    time.sleep(0.01)
    assert len(sampler.samples) == taken >= 3, "sampling stops with the block"
    got = sampler.summary()
    assert got["sm_mhz_median"] == 1500.0 and got["power_w_median"] == 600.0
    assert got["event_reasons"] == 4 and "error" not in got
    assert calls == ["init", "shutdown"]


def test_without_nvml_the_row_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import fails
    with ClockSampler() as sampler:
        pass
    assert sampler.summary() == {"samples": 0, "error": "pynvml is not installed"}
    calls: list[str] = []
    nv = _fake_nvml(calls)

    def no_device(nv: Any, device: int) -> Any:
        raise RuntimeError("no such device")

    monkeypatch.setitem(sys.modules, "pynvml", nv)
    monkeypatch.setattr(gpu_clocks, "_handle_for", no_device)
    with ClockSampler() as sampler:
        pass
    assert sampler.summary() == {"samples": 0, "error": "NVML: no such device"}
    assert calls == ["init", "shutdown"]
