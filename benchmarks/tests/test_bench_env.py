"""offload_bench.py's settings read from the environment (no GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import offload_bench
import pytest
from offload_bench import (
    WORKLOADS,
    bench_budget_gib,
    bench_host_margin,
    bench_host_rate,
    host_margin_inputs,
)


def test_the_budget_is_the_workloads_unless_bench_budget_gib_sets_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BENCH_BUDGET_GIB", raising=False)
    assert bench_budget_gib("W3") == WORKLOADS["W3"][3] == 40
    monkeypatch.setenv("BENCH_BUDGET_GIB", "")
    assert bench_budget_gib("W2") == 3
    monkeypatch.setenv("BENCH_BUDGET_GIB", "120")
    assert bench_budget_gib("W3") == 120.0
    monkeypatch.setenv("BENCH_BUDGET_GIB", "2.5")
    assert bench_budget_gib("W1") == 2.5


@pytest.mark.parametrize("bad", ["0", "-3", "nan", "inf", "lots"])
def test_a_budget_that_is_not_a_positive_number_of_gib_is_refused(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv("BENCH_BUDGET_GIB", bad)
    with pytest.raises(ValueError, match="BENCH_BUDGET_GIB must be a positive number"):
        bench_budget_gib("W3")


def test_the_host_margin_is_one_unless_bench_host_margin_sets_a_number_of_at_least_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BENCH_HOST_MARGIN", raising=False)
    assert bench_host_margin() == 1.0
    monkeypatch.setenv("BENCH_HOST_MARGIN", "")
    assert bench_host_margin() == 1.0
    monkeypatch.setenv("BENCH_HOST_MARGIN", "1.15")
    assert bench_host_margin() == 1.15
    for bad in ("0.9", "0", "nan", "inf", "slow"):
        monkeypatch.setenv("BENCH_HOST_MARGIN", bad)
        with pytest.raises(ValueError, match="BENCH_HOST_MARGIN must be a number >= 1"):
            bench_host_margin()


def test_the_host_rate_is_the_samples_unless_bench_host_rate_names_the_blend(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BENCH_HOST_RATE", raising=False)
    assert bench_host_rate() == "samples"
    monkeypatch.setenv("BENCH_HOST_RATE", "")
    assert bench_host_rate() == "samples"
    monkeypatch.setenv("BENCH_HOST_RATE", "blend")
    assert bench_host_rate() == "blend"
    monkeypatch.setenv("BENCH_HOST_RATE", "profile")
    with pytest.raises(ValueError, match="BENCH_HOST_RATE='profile'; known: blend, samples"):
        bench_host_rate()


def test_the_host_margin_slows_the_cost_and_the_rate_the_plan_is_given() -> None:
    # No margin: what the bench measured goes to memory_optimize as it is.
    assert host_margin_inputs(1.2, 4e9, 1.0) == (1.2, 4e9)
    assert host_margin_inputs(None, None, 1.0) == (None, None)
    # Both measured: the cost times the margin, the rate over it, so that their
    # geometric mean (what the planner takes) is the margin slower.
    cost, rate = host_margin_inputs(1.2, 4e9, 1.25)
    assert cost == pytest.approx(1.5) and rate == pytest.approx(3.2e9)
    # The calibrated rate alone stays alone.
    cost, rate = host_margin_inputs(None, 4e9, 1.25)
    assert cost is None and rate == pytest.approx(3.2e9)
    # Nothing measured (a pinned row, fp32 state): the profile's rate over the margin.
    assert host_margin_inputs(None, None, 1.25) == (1.25, None)


def test_stream_not_first_moves_the_first_streamed_region_to_the_next_host_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    def storages(flags: str) -> list[SimpleNamespace]:
        # d: device state, h: host state, s: streamed, e: host state without parameters
        return [
            SimpleNamespace(
                index=i, host_state=f != "d", streamed=f == "s", numel=0 if f == "e" else 10
            )
            for i, f in enumerate(flags)
        ]

    st = storages("dsdehhs")
    assert offload_bench._stream_not_first(st) == (1, 4)
    assert [x.streamed for x in st] == [False, False, False, False, True, False, True]
    # Nothing streamed, or no host-state region after the first streamed one: unchanged.
    for flags in ("dhh", "dhsd"):
        st = storages(flags)
        assert offload_bench._stream_not_first(st) is None
        assert [x.streamed for x in st] == [f == "s" for f in flags]
    monkeypatch.delenv("BENCH_STREAM_NOT_FIRST", raising=False)
    assert not offload_bench.bench_stream_not_first()
    monkeypatch.setenv("BENCH_STREAM_NOT_FIRST", "1")
    assert offload_bench.bench_stream_not_first()


def test_stream_max_steps_the_streamed_regions_after_the_first_n_on_the_host(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from types import SimpleNamespace

    def storages(flags: str) -> list[SimpleNamespace]:
        # d: device state, h: host state, s: streamed
        return [
            SimpleNamespace(index=10 + i, host_state=f != "d", streamed=f == "s")
            for i, f in enumerate(flags)
        ]

    st = storages("dshsdsh")
    assert offload_bench._cap_streamed(st, 1) == [13, 15]
    assert [x.streamed for x in st] == [f == "s" for f in "dshhdhh"]
    st = storages("dshsdsh")
    assert offload_bench._cap_streamed(st, 3) == []
    assert [x.streamed for x in st] == [f == "s" for f in "dshsdsh"]
    assert offload_bench._cap_streamed(st, 0) == [11, 13, 15]
    assert not any(x.streamed for x in st)
    monkeypatch.delenv("BENCH_STREAM_MAX", raising=False)
    assert offload_bench.bench_stream_max() is None
    monkeypatch.setenv("BENCH_STREAM_MAX", "2")
    assert offload_bench.bench_stream_max() == 2
    for bad in ("-1", "two", "1.5"):
        monkeypatch.setenv("BENCH_STREAM_MAX", bad)
        with pytest.raises(ValueError, match="BENCH_STREAM_MAX"):
            offload_bench.bench_stream_max()


def test_stream_slots_are_the_optimizers_unless_bench_stream_slots_sets_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from offload_optim.streamed import STREAM_SLOTS

    monkeypatch.delenv("BENCH_STREAM_SLOTS", raising=False)
    assert offload_bench.bench_stream_slots() == STREAM_SLOTS
    monkeypatch.setenv("BENCH_STREAM_SLOTS", "6")
    assert offload_bench.bench_stream_slots() == 6
    for bad in ("1", "six"):
        monkeypatch.setenv("BENCH_STREAM_SLOTS", bad)
        with pytest.raises(ValueError, match="BENCH_STREAM_SLOTS"):
            offload_bench.bench_stream_slots()


@pytest.mark.parametrize(
    ("env", "parameter", "default"),
    [
        ("BENCH_SPECULATION_THREAD", "speculation_thread", True),
        ("BENCH_STREAM_PACED", "paced_ring", True),
        ("BENCH_ISSUER_PUBLISHES", "issuer_publishes", True),
        ("BENCH_STAGE_AHEAD", "stage_ahead", False),
        ("BENCH_STAGE_IN_BACKWARD", "stage_in_backward", True),
    ],
)
def test_optimizer_flags_follow_hybrid_adams_defaults_unless_set(
    monkeypatch: pytest.MonkeyPatch, env: str, parameter: str, default: bool
) -> None:
    monkeypatch.delenv(env, raising=False)
    assert offload_bench._hybrid_adam_flag(env, parameter) is default
    monkeypatch.setenv(env, "0")
    assert offload_bench._hybrid_adam_flag(env, parameter) is False
    monkeypatch.setenv(env, "1")
    assert offload_bench._hybrid_adam_flag(env, parameter) is True


def test_host_work_moves_late_as_memory_optimize_does_unless_bench_late_host_work_is_0(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import inspect

    from offload_runtime import memory_optimize

    default = inspect.signature(memory_optimize).parameters["late_host_work"].default
    monkeypatch.delenv("BENCH_LATE_HOST_WORK", raising=False)
    assert offload_bench.bench_late_host_work() is default is True
    monkeypatch.setenv("BENCH_LATE_HOST_WORK", "0")
    assert offload_bench.bench_late_host_work() is False
    monkeypatch.setenv("BENCH_LATE_HOST_WORK", "1")
    assert offload_bench.bench_late_host_work() is True


def test_profile_steps_default_to_two_and_refuse_what_is_not_a_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("BENCH_PROFILE_STEPS", raising=False)
    assert offload_bench.bench_profile_steps() == 2
    monkeypatch.setenv("BENCH_PROFILE_STEPS", "3")
    assert offload_bench.bench_profile_steps() == 3
    for bad in ("0", "-1", "2.5", "two"):
        monkeypatch.setenv("BENCH_PROFILE_STEPS", bad)
        with pytest.raises(ValueError, match="BENCH_PROFILE_STEPS"):
            offload_bench.bench_profile_steps()


def test_a_pinned_plan_stages_as_its_source_row_planned(tmp_path: Path) -> None:
    # BENCH_PLAN_FROM: both arms of an A/B plan as the source row did, staging included,
    # whatever their own optimizer does; rows before session 45's planner counted none.
    def source(streamed: dict[str, Any] | None) -> str:
        row: dict[str, Any] = {
            "ok": True,
            "hardware": {"name": "x"},
            "pred_step_ms": 250.0,
            "pred_peak_gib": 37.9,
            "stage_in_backward": True,
        }
        if streamed is not None:
            row["plan_streamed"] = streamed
        path = tmp_path / f"s{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps({"results": {"W3": {"ours_io_spec1_stream": row}}}))
        return str(path)

    costs = {"up_bytes_per_param": 14, "down_bytes_per_param": 14, "slot_bytes": 1}
    staged = {**costs, "staged_chunks": 3, "staged_chunk_numel": 10, "staged_bytes_per_param": 12}
    for streamed, expected in ((staged, True), (costs, False), (None, False)):
        inputs = offload_bench.plan_inputs_from(source(streamed), "W3", "ours_io_spec1_stream")
        assert inputs.stage_in_backward is expected


def test_a_disturbed_cached_profile_is_measured_again_before_planning() -> None:
    # The cached profile read the fused host Adam at 1.40 Gparam/s (session 47's); this
    # process timed it at 4.64: measured again, with force, and the rates recorded.
    calls: list[dict[str, Any]] = []

    class Profile:
        def __init__(self, gparam: float) -> None:
            self.host_adam_params_per_s = gparam * 1e9

    def profile(device: str, **kwargs: Any) -> Profile:
        calls.append({"device": device, **kwargs})
        return Profile(4.5 if kwargs.get("force") else 1.4)

    done = offload_bench.reprofile_if_disturbed(4.64, profile)
    assert done == pytest.approx(
        {"cached_gparam": 1.4, "in_process_gparam": 4.64, "now_gparam": 4.5}
    )
    assert [c.get("force", False) for c in calls] == [False, True]
    assert all(c["device"] == "cuda" for c in calls)
    # Within PROFILE_HOST_DISTURBED of the cached rate: nothing is measured again.
    calls.clear()
    limit = 1.4 * offload_bench.PROFILE_HOST_DISTURBED
    assert offload_bench.reprofile_if_disturbed(limit, profile) is None
    assert [c.get("force", False) for c in calls] == [False]
