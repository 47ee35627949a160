"""offload_bench.py without a GPU: its command line, its table of kinds, the rows and the
summary it writes, and the floor it defines."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import offload_bench
import pytest
from offload_bench import (
    FULL_GPU,
    KINDS,
    OURS,
    PEERS,
    REPORT_KINDS,
    REPORT_STEPS,
    SUMMARY,
    WORKLOADS,
    OursConfig,
    compact_row,
    host_floor_parts_ms,
    issue_floor,
    parse_args,
    read_rows,
    trained,
)


def test_the_kinds_are_ours_configurations_and_the_peers() -> None:
    assert (*OURS, *PEERS) == KINDS
    assert OURS["ours"] == OursConfig()  # the libraries' defaults: nothing passed
    assert OURS["ablation"].reference
    fast, bf16 = OURS["ours_io_spec1_stream"], OURS["ours_bf16m"]
    assert fast.fp16_io and fast.speculate and fast.streamed and fast.host_state == "fp32"
    assert bf16 == OursConfig(host_state="bf16_moments") and not bf16.bf16
    # The bf16-master rungs train in bf16, as torchao does.
    assert OURS["ours_bf16_rn"].bf16 and OURS["ours_bf16_rn"].host_state == "bf16_nearest"
    assert OURS["ours_bf16_sr"].host_state == "bf16_stochastic"
    assert OURS["ours_bf16_8bit"].host_state == "bf16_8bit"
    # The defaults force nothing; the others force what they name.
    assert OURS["ours"].force() is None and bf16.force() is None
    forced = fast.force()
    assert forced.fp16_io and forced.speculative and forced.streamed
    device = OURS["ours_device_conv"].force()
    assert device.host_kernel == "torch" and device.convert_on_device
    assert device.speculative is False and device.fp16_io is None
    assert OURS["ours_no_stream"].force().streamed is False
    reference = OURS["ablation"].force()
    assert reference.overlap is False and reference.state_on_device is False
    # What the defaults are set against: every configuration of the same numerics.
    assert {k for k, c in OURS.items() if c.speed_only} == {
        "ours",
        "ours_io_spec1_stream",
        "ours_device_conv",
        "ours_no_stream",
    }


def test_the_report_runs_every_row_its_targets_need() -> None:
    assert set(REPORT_KINDS) == set(REPORT_STEPS) == {"W1", "W2", "W3", "W4", "W5", "W6a", "W6b"}
    assert set(REPORT_KINDS) <= set(WORKLOADS)
    assert all(k in KINDS for kinds in REPORT_KINDS.values() for k in kinds)
    assert REPORT_KINDS["W1"] == ("ours", FULL_GPU)
    for w in ("W2", "W3", "W4", "W5"):
        kinds = REPORT_KINDS[w]
        assert kinds[0] == "ours" and "fsdp2" in kinds
        # The defaults, and the planner's two fp16 candidates forced.
        assert {"ours_io_spec1_stream", "ours_device_conv"} <= set(kinds)
    assert FULL_GPU in REPORT_KINDS["W2"] and FULL_GPU in REPORT_KINDS["W3"]  # the floor
    # The two bf16-master rungs the targets set beside torchao, at W3, W4 and W5.
    for w in ("W3", "W4", "W5"):
        assert {"ours_bf16_rn", "ours_bf16_sr", "torchao"} <= set(REPORT_KINDS[w])
    # W5 beside full GPU, FSDP2 and torchao; every configuration of the same numerics.
    assert {FULL_GPU, "fsdp2", "torchao", "ours_no_stream"} <= set(REPORT_KINDS["W5"])
    assert all(steps >= 5 for steps in REPORT_STEPS.values())


def test_w5_is_llama_3b_in_its_own_vocabulary() -> None:
    from offload_bench import PEER_ACTIVATION, peer_activation, workload_batch

    from offload_gpt_example.models import get_spec

    name, batch, seq, budget = WORKLOADS["W5"]
    assert (name, batch, seq, budget) == ("llama_3b", 2, 2048, 24)
    data = workload_batch("W5", "meta")
    assert data["input_ids"].shape == (batch, seq)
    assert get_spec(name).vocab_size == 32000
    cpu = workload_batch("W1", "cpu")
    assert int(cpu["input_ids"].max()) < get_spec(WORKLOADS["W1"][0]).vocab_size
    # GPT-2's peers run the fused tanh GELU ours traces; Llama's keep their SiLU.
    assert peer_activation("gpt2_xl") == PEER_ACTIVATION
    assert peer_activation("llama_3b") == "silu"


def test_w6_is_bound_by_activations_beside_the_checkpointing_peers() -> None:
    assert WORKLOADS["W6a"] == ("gpt2_xl", 8, 8192, 40)
    assert WORKLOADS["W6b"] == ("llama_3b", 1, 32768, 24)
    assert {"fsdp2_ckpt", "fsdp2_ckpt_host", "full_gpu_ckpt"} <= set(PEERS)
    assert REPORT_KINDS["W6a"] == ("ours", "fsdp2_ckpt", "fsdp2_ckpt_host", "full_gpu_ckpt")
    assert REPORT_KINDS["W6b"] == ("ours", "fsdp2_ckpt", "fsdp2_ckpt_host")
    # The plan's activation handling reaches the summary.
    assert {"recompute_regions", "host_activation_regions"} <= set(offload_bench.SUMMARY_KEYS)
    args = parse_args(
        [
            "--workloads",
            "W6a,W6b",
            "--kinds",
            "ours,fsdp2_ckpt,fsdp2_ckpt_host,full_gpu_ckpt",
        ]
    )
    assert args.workloads == ["W6a", "W6b"]
    assert args.kinds == ["ours", "fsdp2_ckpt", "fsdp2_ckpt_host", "full_gpu_ckpt"]


def test_the_command_line_defaults_to_the_reports_rows(tmp_path: Path) -> None:
    args = parse_args([])
    assert args.workloads == list(WORKLOADS)
    assert args.kinds is None and args.steps is None  # REPORT_KINDS, REPORT_STEPS
    assert args.out == Path("bench_out") and args.summary is None
    args = parse_args(["--workloads", "W3,W1", "--kinds", "ours,fsdp2", "--steps", "7"])
    assert args.workloads == ["W3", "W1"] and args.kinds == ["ours", "fsdp2"]
    assert args.steps == 7
    args = parse_args(["--summary", str(tmp_path / "s.json"), str(tmp_path)])
    assert args.summary == tmp_path / "s.json" and args.folders == [tmp_path]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--workloads", "W9"], "unknown or no workloads ['W9']"),
        (["--kinds", "ours,ours_spec"], "unknown or no kinds ['ours_spec']"),
        (["--kinds", "full_gpu"], "unknown or no kinds ['full_gpu']"),
        (["--steps", "4"], "--steps must be at least 5"),
        (["--warmup", "-1"], "--warmup must be >= 0"),
        (["--summary", "s.json"], "--summary FILE needs the output folders"),
        (["--summary", "s.json", "/no/such/folder"], "no such folder: /no/such/folder"),
        (["some_folder"], "output folders are read only with --summary"),
    ],
)
def test_bad_command_lines_are_refused_with_the_reason(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(argv)
    assert message in capsys.readouterr().err


def fake_result(workload: str, kind: str) -> dict[str, Any]:
    """What a child prints for a row, as far as the summary reads it (and more)."""
    out: dict[str, Any] = {
        "ok": True,
        "step_ms": 100.0,
        "step_mean_ms": 110.0,
        "steps_ms": [100.0] * 10,
        "timed_steps": 10,
        "peak_alloc_gib": 2.5,
    }
    if kind in OURS:
        out |= {
            "pred_step_ms": 105.0,
            "pred_peak_gib": 2.4,
            "budget_gib": WORKLOADS[workload][3],
            "floor_parts_ms": {"h2d": 10.0, "d2h": 20.0, "host_adam": 90.0},
            "profile_host_adam_gparam": 4.0,
            "hardware": {"name": "a profile"},
            "cpu_span_ms": {"forward": 1.0, "backward": 2.0, "step": 0.5, "calls": 10},
        }
    if kind == FULL_GPU:
        out |= {"fwd_bwd_ms": 80.0, "loss_before": 7.0, "loss_after": 6.5}
    return out


def test_a_run_writes_each_row_as_it_comes_and_a_compact_summary(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[tuple[str, str, int, float]] = []

    def run_child(
        workload: str, kind: str, steps: int, args: argparse.Namespace, timeout_s: float
    ) -> dict[str, Any]:
        calls.append((workload, kind, steps, timeout_s))
        if kind == "fsdp2":
            return {"ok": False, "error": "timed out after 600 s"}
        return fake_result(workload, kind)

    monkeypatch.setattr(offload_bench, "run_child", run_child)
    monkeypatch.setenv("BENCH_COMMIT", "abc1234")
    out = tmp_path / "out"
    assert offload_bench.main(["--workloads", "W1,W2", "--out", str(out)]) == 0
    expected = [(w, k) for w in ("W1", "W2") for k in REPORT_KINDS[w]]
    assert [(w, k) for w, k, _, _ in calls] == expected
    assert [s for _, _, s, _ in calls] == [REPORT_STEPS[w] for w, _ in expected]
    assert all(t == 600 for *_, t in calls)
    names = sorted(p.name for p in out.iterdir())
    assert names == sorted([f"{w}_{k}.json" for w, k in expected] + [SUMMARY])
    record = json.loads((out / "W2_ours.json").read_text())
    assert record["result"]["steps_ms"] == [100.0] * 10  # the row file keeps everything
    assert record["meta"]["commit"] == "abc1234"
    assert record["meta"]["command"] == "python benchmarks/offload_bench.py --workloads W1,W2 " + (
        f"--out {out}"
    )
    rows = json.loads((out / SUMMARY).read_text())["rows"]
    assert [(r["workload"], r["kind"]) for r in rows] == expected
    ours = rows[2]
    assert ours["kind"] == "ours" and ours["ok"]
    assert ours["step_ms"] == 100.0 and ours["step_mean_ms"] == 110.0
    assert ours["pred_step_ms"] == 105.0 and ours["budget_gib"] == 3
    assert ours["floor_parts_ms"] == {"h2d": 10.0, "d2h": 20.0, "host_adam": 90.0}
    assert {"date", "commit", "gpu", "torch", "command"} <= ours.keys()
    assert not {"steps_ms", "hardware", "cpu_span_ms"} & ours.keys()  # no per-step data
    by_kind = {r["kind"]: r for r in rows if r["workload"] == "W2"}
    assert by_kind["fsdp2"] == {**by_kind["fsdp2"], "ok": False, "error": "timed out after 600 s"}
    assert by_kind[FULL_GPU]["fwd_bwd_ms"] == 80.0 and by_kind[FULL_GPU]["budget_gib"] == 3
    assert read_rows(out) == rows == read_rows(out / SUMMARY)


def test_under_a_time_limit_rows_start_only_with_time_left_and_are_cut_at_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timeouts: list[float] = []

    def run_child(
        workload: str, kind: str, steps: int, args: argparse.Namespace, timeout_s: float
    ) -> dict[str, Any]:
        timeouts.append(timeout_s)
        return fake_result(workload, kind)

    monkeypatch.setattr(offload_bench, "run_child", run_child)
    out = tmp_path / "out"
    offload_bench.main(["--workloads", "W1", "--out", str(out), "--time-limit-s", "100"])
    assert len(timeouts) == 2 and all(90 < t <= 100 for t in timeouts)
    timeouts.clear()
    offload_bench.main(["--workloads", "W3", "--out", str(out), "--time-limit-s", "20"])
    assert timeouts == [] and not list(out.glob("W3_*.json"))


def test_the_summary_of_several_folders_holds_all_their_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(
        offload_bench, "run_child", lambda w, k, steps, args, timeout: fake_result(w, k)
    )
    a, b = tmp_path / "a", tmp_path / "b"
    offload_bench.main(["--workloads", "W1", "--out", str(a)])
    offload_bench.main(["--workloads", "W3", "--kinds", "torchao", "--out", str(b)])
    (b / "notes.json").write_text("[1, 2]")  # other JSON in a folder is not a row
    summary = tmp_path / "results" / SUMMARY
    assert offload_bench.main(["--summary", str(summary), str(a), str(b)]) == 0
    rows = json.loads(summary.read_text())["rows"]
    assert [(r["workload"], r["kind"]) for r in rows] == [
        ("W1", "ours"),
        ("W1", FULL_GPU),
        ("W3", "torchao"),
    ]
    with pytest.raises(ValueError, match="neither a summary file"):
        read_rows(b / "notes.json")


def test_a_failing_measurement_is_a_row_that_says_why(tiny: tuple[str, str]) -> None:
    row = offload_bench.measure(tiny[0], "ours_spec", 1, 5)
    assert row == {"ok": False, "error": row["error"], "gpu": "no GPU", "torch": row["torch"]}
    assert "unknown kind 'ours_spec'" in row["error"]


def test_the_floor_is_its_largest_part_with_the_host_at_the_faster_rate() -> None:
    row = {
        "floor_parts_ms": {"h2d": 100.0, "d2h": 80.0, "host_adam": 300.0},
        "profile_host_adam_gparam": 3.0,
    }
    assert issue_floor(row) == (300.0, "host_adam")
    # Full GPU's compute sets it where it is the largest part.
    assert issue_floor(row, compute_ms=350.0) == (350.0, "gpu_compute")
    # The run's processes read the host at 4 Gparam/s where its profile read 3: a floor is
    # a lower bound, so the host part is taken at the faster rate (300 * 3 / 4 = 225).
    assert issue_floor(row, host_gparam=4.0) == (pytest.approx(225.0), "host_adam")
    assert issue_floor(row, host_gparam=2.0) == (300.0, "host_adam")  # slower: the profile's
    # W1 without full GPU: nothing crosses PCIe or steps on the host, so no floor.
    assert issue_floor({"floor_parts_ms": {"h2d": 0.0, "d2h": 0.0, "host_adam": 0.0}}) is None
    assert issue_floor({}) is None


def test_the_host_parts_of_a_floor_follow_the_rung() -> None:
    from offload_runtime import default_cpu_profile
    from offload_solver import default_hardware

    hw = default_hardware()  # fused host Adam 4.4e9 parameters/s, host memory 150e9 bytes/s
    # fp32 state: torch's fused fp32 step and 28 bytes a trainable parameter.
    fp32 = host_floor_parts_ms(hw, "fp32", 2 * 10**9, 10**9)
    assert fp32 == {
        "host_adam": pytest.approx(2e9 / 4.4e9 * 1e3),
        "host_memory": pytest.approx(28e9 / 150e9 * 1e3),
    }
    # A lower rung: its bytes over the bandwidth; the fused fp32 rate is no floor of it.
    for rung, nbytes in (("bf16_moments", 20), ("bf16_stochastic", 14), ("bf16_8bit", 10)):
        parts = host_floor_parts_ms(hw, rung, 2 * 10**9, 10**9)
        assert parts == {"host_memory": pytest.approx(nbytes * 1e9 / 150e9 * 1e3)}, rung
    # A profile that does not know the host's memory bandwidth has no memory part.
    cpu = default_cpu_profile()
    assert cpu.host_memory_bytes_per_s == 0
    assert host_floor_parts_ms(cpu, "fp32", 10**9, 10**9) == {"host_adam": 1e3}
    assert host_floor_parts_ms(cpu, "bf16_stochastic", 10**9, 10**9) == {}


def test_the_floor_of_a_lower_rung_is_its_largest_part_with_host_memory() -> None:
    row = {
        "floor_parts_ms": {"h2d": 100.0, "d2h": 80.0, "host_memory": 150.0},
        "profile_host_adam_gparam": 3.0,
    }
    assert issue_floor(row) == (150.0, "host_memory")
    # The faster host Adam read scales the fused-Adam part only, not the memory part.
    assert issue_floor(row, host_gparam=6.0) == (150.0, "host_memory")
    assert issue_floor(row, compute_ms=200.0) == (200.0, "gpu_compute")
    # With fp32 state both host parts stand, and the larger sets the floor.
    fp32 = {"floor_parts_ms": {"h2d": 100.0, "d2h": 80.0, "host_adam": 300.0, "host_memory": 250.0}}
    assert issue_floor(fp32) == (300.0, "host_adam")
    # Read twice as fast in the run's processes, the fused-Adam part halves to 150 ms.
    read_slow = {**fp32, "profile_host_adam_gparam": 3.0}
    assert issue_floor(read_slow, host_gparam=6.0) == (250.0, "host_memory")


def test_trained_needs_a_finite_loss_that_fell() -> None:
    assert trained({"loss_before": 7.0, "loss_after": 6.0})
    assert trained({"loss_before": 7.0, "loss_after": 8.0}) is False
    assert trained({"loss_before": 7.0, "loss_after": float("nan")}) is False
    assert trained({"step_ms": 1.0}) is None


def test_a_compact_row_of_a_measured_row_is_small(cpu_rows: dict[str, dict[str, Any]]) -> None:
    meta = {k: "x" for k in ("date", "commit", "gpu", "torch", "command")}
    for kind, result in cpu_rows.items():
        record = {"meta": meta, "workload": "T", "kind": kind, "result": {**result, "ok": True}}
        row = compact_row(record)
        assert set(row) <= {
            "workload",
            "kind",
            "ok",
            "paired_full_gpu",
            *offload_bench.SUMMARY_KEYS,
            *offload_bench.META_KEYS,
        }
        assert row["step_ms"] == pytest.approx(result["step_ms"], abs=1e-4)
        assert len(json.dumps(row)) < 1000 < len(json.dumps(result))
