"""benchmarks/issue_under_load.py on the CPU: the probe read alone and beside a host Adam."""

from __future__ import annotations

import json
import time
from pathlib import Path

import issue_under_load
import pytest


def test_load_steps_on_its_thread_until_stopped() -> None:
    calls: list[float] = []

    def step() -> None:
        calls.append(time.perf_counter())
        time.sleep(0.001)

    load = issue_under_load._Load(step)
    load.start()
    time.sleep(0.05)
    load.stop()
    stopped = len(calls)
    time.sleep(0.02)
    assert stopped == len(calls) == load.steps > 3
    assert 0.001 * load.steps <= load.busy_s < 0.2


def test_torch_kind_reads_both_ways_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "reads.json"
    rc = issue_under_load.main(
        [
            "--device",
            "cpu",
            "--numel",
            "1e5",
            "--rounds",
            "2",
            "--kernel",
            "torch",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    got = json.loads(out.read_text())
    assert got["device"] == "cpu" and got["numel"] == 100_000
    reads = got["torch"]
    assert len(reads["alone_us"]) == len(reads["loaded_us"]) == 2
    assert all(0 < x < 1e5 for x in reads["alone_us"] + reads["loaded_us"])
    assert reads["ratio"] > 0 and reads["load_gparam"] > 0


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(SystemExit):
        issue_under_load.main(["--rounds", "0", "--device", "cpu"])
