"""profile_reads.py on the CPU: both ways of timing the fused host Adam, and the
profile's reads recorded where they fall (the profile itself replaced: it needs CUDA)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import profile_reads
import pytest
import torch

import offload_runtime.hardware as hardware


def test_every_way_is_read_each_round_in_alternating_order() -> None:
    order: list[str] = []

    def reader(name: str, rate: float) -> Any:
        def read() -> float:
            order.append(name)
            return rate

        return read

    reads = {"a": reader("a", 1.0), "b": reader("b", 2.0)}
    assert profile_reads.read_rounds(reads, 3) == {"a": [1.0] * 3, "b": [2.0] * 3}
    assert order == ["a", "b", "b", "a", "a", "b"]


def test_the_four_ways_time_real_host_steps(tmp_path: Path) -> None:
    out = tmp_path / "reads.json"
    assert (
        profile_reads.main(
            [
                "--json",
                str(out),
                "--rounds",
                "1",
                "--profile-numel",
                "4096",
                "--bench-numel",
                "8192",
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert set(result["rounds"]) == {
        "profile_way_profile_size",
        "profile_way_bench_size",
        "bench_way_bench_size",
        "bench_way_profile_size",
    }
    assert all(len(v) == 1 and v[0] > 0 for v in result["rounds"].values())
    if not torch.cuda.is_available():
        assert result["profiles"] == []


def test_a_profiles_host_adam_reads_are_recorded_with_when_they_came(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rates = iter([1.4e9, 3.3e9, 3.8e9])
    monkeypatch.setattr(hardware, "measure_host_adam_params_per_s", lambda numel, **kw: next(rates))

    def fake_profile(device: torch.device) -> None:
        for _ in range(3):  # first, midway and last, as measure_hardware reads them
            hardware.measure_host_adam_params_per_s(1024)

    monkeypatch.setattr(hardware, "measure_hardware", fake_profile)
    original = hardware.measure_host_adam_params_per_s
    (reads,) = profile_reads.profile_reads(torch.device("cpu"), 1)
    assert [r["params_per_s"] for r in reads] == [1.4e9, 3.3e9, 3.8e9]
    assert [r["numel"] for r in reads] == [1024.0] * 3
    assert all(r["at_s"] >= 0 for r in reads)
    # The profile's own function is back in place afterwards.
    assert hardware.measure_host_adam_params_per_s is original
    lines = profile_reads.summary({"rounds": {"x": [4e9, 5e9]}, "profiles": [reads]})
    assert lines[0] == "x: median 4.50 Gparam/s (4.00-5.00, 2 reads)"
    assert lines[1].startswith("profile 1: host Adam reads 1.40 at ")
