"""The maintainers' tools beside the benchmark, on the CPU: step_trace.py's trace summaries,
solver_bench.py's synthetic profile, host_step_contention.py's host memory rates."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import host_step_contention
import pytest
import solver_bench
import step_trace


def event(cat: str, stream: int, ts: float, dur: float, name: str = "k") -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}


TRACE = {
    "traceEvents": [
        # Compute stream 7: forward 0-100 us, a backward kernel 150-250, another 700-800.
        event("kernel", 7, 0.0, 100.0, "fwd_gemm"),
        event("kernel", 7, 150.0, 100.0, "gemm_bwd"),
        event("kernel", 7, 700.0, 100.0, "gemm_bwd"),
        # Stream 13 copies up 50-250 us (100 of it beside compute).
        event("gpu_memcpy", 13, 50.0, 200.0, "Memcpy HtoD (Pinned -> Device)"),
        # The host worker's region steps and a long gradient hook.
        {"ph": "X", "cat": "user_annotation", "ts": 300.0, "dur": 100.0, "name": "host step 3"},
        {
            "ph": "X",
            "cat": "user_annotation",
            "ts": 350.0,
            "dur": 100.0,
            "name": "speculative step 2",
        },
        {
            "ph": "X",
            "cat": "cpu_op",
            "ts": 260.0,
            "dur": 600.0,
            "name": "torch::autograd::AccumulateGrad",
        },
    ]
}


def test_a_trace_summary_has_each_streams_busy_time_and_the_compute_idle() -> None:
    got = step_trace.summarise_trace(TRACE)
    assert got["compute_stream"] == "7"
    assert got["span_ms"] == pytest.approx(0.8)
    assert got["streams"]["7"]["busy_ms"] == pytest.approx(0.3)
    assert got["streams"]["13"]["kinds"] == {"memcpy HtoD": 0.2}
    assert got["copy_overlap_ms"] == {"13": pytest.approx(0.15)}
    assert got["compute_idle_ms"] == pytest.approx(0.5)
    assert got["host_steps"] == {
        "count": 2,
        "busy_ms": pytest.approx(0.15),
        "first_ms": pytest.approx(0.3),
        "last_end_ms": pytest.approx(0.45),
    }


def test_backward_is_summarised_from_its_first_kernel() -> None:
    got = step_trace.summarise_backward(TRACE, "7")
    assert got["span_ms"] == pytest.approx(0.65)  # 150 to 800 us
    assert got["compute_busy_ms"] == pytest.approx(0.2)
    assert (got["gaps"], got["gaps_ms"]) == (1, pytest.approx(0.45))
    assert got["long_accumulate_grad"] == 1
    assert step_trace.summarise_backward({"traceEvents": []}, "7") == {}


def test_a_gzipped_trace_is_summarised_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump(TRACE, f)
    assert step_trace.load_trace(path) == TRACE
    assert step_trace.main(["--summarise", str(path)]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["compute_stream"] == "7" and got["backward"]["gaps"] == 1


def test_the_memory_summary_groups_what_is_live_at_the_peak() -> None:
    frame = {"filename": "/src/model.py", "line": 3, "name": "forward"}
    snapshot = {
        "device_traces": [
            [
                {"action": "alloc", "addr": 1, "size": 2**20, "frames": [frame]},
                {"action": "alloc", "addr": 2, "size": 2**21, "frames": [frame]},
                {"action": "free_completed", "addr": 1},
                {"action": "alloc", "addr": 3, "size": 2**20, "frames": []},
            ]
        ]
    }
    got = step_trace.summarise_memory(snapshot)
    assert got["peak_mib"] == 3.0
    assert got["by_site"] == [("model.py:3 forward", 3.0, 2)]


def test_the_solver_bench_profile_is_shaped_like_gpt2(capsys: pytest.CaptureFixture[str]) -> None:
    profile = solver_bench.gpt2_profile(2)
    assert len(profile.operations) == 5 + 2 * 56 + 6  # embeddings, 2 blocks, head and loss
    assert profile.tied_groups == (("wte.weight", "lm_head.weight"),)
    solver_bench.bench(2, "2GiB", "asyn")
    line = capsys.readouterr().out
    assert line.startswith("   2 layers,") and "simulations" in line


def test_host_memory_rates_count_28_bytes_a_parameter_and_add_the_copies() -> None:
    assert host_step_contention.ADAM_BYTES_PER_PARAM == 28
    assert host_step_contention.memory_rates(1e9, []) == {"adam_gbps": 28.0}
    got = host_step_contention.memory_rates(1e9, [10.0, 30.0, 20.0])
    assert got == {"adam_gbps": 28.0, "copy_gbps": 20.0, "host_memory_gbps": 48.0}


def test_the_host_probe_steps_alone_and_beside_issuing_on_the_cpu(tmp_path: Path) -> None:
    import torch

    out = tmp_path / "rates.json"
    argv = ["--params", "2e5", "--region", "1e5", "--repeats", "1", "--threads", "1"]
    threads = torch.get_num_threads()
    try:
        assert host_step_contention.main([*argv, "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)  # the probe sets the thread count it measures
    rows = json.loads(out.read_text())["rows"]
    assert [r["condition"] for r in rows] == ["alone", "issue"]
    assert all(r["gparam_per_s"] > 0 and r["adam_gbps"] > 0 for r in rows)
