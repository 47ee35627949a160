"""JSON documents and the ``offload-solve`` CLI: round trips and named errors."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from solver_helpers import chain, flat_hardware, hardware_profiles, profiles

import offload_solver
from offload_solver import (
    CostModel,
    HardwareProfile,
    ModelProfile,
    Operation,
    Parameter,
    ParamPlacement,
    Plan,
    StatePlacement,
    default_hardware,
    solve,
)
from offload_solver.cli import main


def small_profile() -> ModelProfile:
    params = tuple(Parameter(f"w{i}", s // 2, s) for i, s in enumerate([200, 300, 150, 250]))
    ops = tuple(
        Operation(f"op{i}", (f"w{i}",), saved_bytes=1000, fwd_flop=100, bwd_flop=400)
        for i in range(4)
    )
    return ModelProfile("small", params, ops, host_grad_bytes_per_param=0)


@settings(max_examples=60, deadline=None)
@given(profile=profiles(), hardware=hardware_profiles())
def test_profiles_round_trip(profile: ModelProfile, hardware: HardwareProfile) -> None:
    assert ModelProfile.from_json(profile.to_json()) == profile
    assert HardwareProfile.from_json(hardware.to_json()) == hardware


def test_default_hardware_round_trips_and_is_h200_like() -> None:
    hw = default_hardware()
    assert HardwareProfile.from_json(hw.to_json()) == hw
    assert hw.h2d_bytes_per_s(256 * 10**6) == pytest.approx(55e9)
    assert hw.h2d_bytes_per_s(10**6) < hw.h2d_bytes_per_s(16 * 10**6)
    assert hw.device_memory_bytes == 140 * 2**30 and hw.host_memory_bytes == 128 * 2**30
    assert hw.device_memory_bytes_per_s == pytest.approx(4.2e12)
    # Assumed as the other rates are: a little above what its fp32 host Adam moves.
    assert hw.host_memory_bytes_per_s == pytest.approx(150e9)
    assert hw.host_memory_bytes_per_s > 28 * hw.host_adam_params_per_s


def test_hardware_json_without_the_conversion_rate_still_loads() -> None:
    # Profiles cached before the field existed: the rate is unknown (0), so the simulator
    # charges the host optimizer step alone, as it did when they were written.
    hw = default_hardware()
    assert hw.host_convert_elems_per_s == 11e9
    old = json.loads(hw.to_json())
    del old["host_convert_elems_per_s"]
    loaded = HardwareProfile.from_json(json.dumps(old))
    assert loaded.host_convert_elems_per_s == 0.0
    assert loaded.host_convert_time_s(10**9) == 0.0
    assert loaded.to_json() != hw.to_json()
    assert HardwareProfile.from_json(loaded.to_json()) == loaded
    assert hw.host_convert_time_s(11 * 10**9) == pytest.approx(1.0)


def test_hardware_json_without_the_device_memory_rate_loads_as_unknown() -> None:
    # Profiles cached before the field existed price operations by FLOPs and issue cost.
    hw = flat_hardware(device_memory_bytes_per_s=4e12)
    assert HardwareProfile.from_json(hw.to_json()) == hw
    old = json.loads(hw.to_json())
    del old["device_memory_bytes_per_s"]
    loaded = HardwareProfile.from_json(json.dumps(old))
    assert loaded.device_memory_bytes_per_s == 0.0
    assert loaded.op_time_s(0, 10**12) == 0.0
    assert hw.op_time_s(0, 10**12) == pytest.approx(0.25)


def test_hardware_json_without_the_host_memory_rate_loads_as_unknown() -> None:
    # Profiles cached before the field existed: the host's bandwidth is unknown (0).
    hw = flat_hardware(host_memory_bytes_per_s=100e9)
    assert HardwareProfile.from_json(hw.to_json()) == hw
    assert json.loads(hw.to_json())["host_memory_bytes_per_s"] == 100e9
    assert hw.host_memory_time_s(50 * 10**9) == pytest.approx(0.5)
    old = json.loads(hw.to_json())
    del old["host_memory_bytes_per_s"]
    loaded = HardwareProfile.from_json(json.dumps(old))
    assert loaded.host_memory_bytes_per_s == 0.0
    assert loaded.host_memory_time_s(50 * 10**9) == 0.0
    assert HardwareProfile.from_json(loaded.to_json()) == loaded


def test_hardware_json_without_copy_contention_loads_as_none() -> None:
    # Profiles cached before the field existed charge host work at its standalone rate.
    hw = default_hardware()
    assert hw.host_copy_contention == pytest.approx(0.55)
    old = json.loads(hw.to_json())
    del old["host_copy_contention"]
    loaded = HardwareProfile.from_json(json.dumps(old))
    assert loaded.host_copy_contention == 1.0
    assert HardwareProfile.from_json(loaded.to_json()) == loaded


def test_hardware_json_with_the_retired_issue_ahead_key_loads() -> None:
    # Older profiles carry "issue_ahead", a pricing the simulator no longer has. False
    # loads silently as any unknown key does; true loads the same profile and warns.
    hw = default_hardware()
    assert "issue_ahead" not in json.loads(hw.to_json())
    doc = json.loads(hw.to_json())
    doc["issue_ahead"] = False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HardwareProfile.from_json(json.dumps(doc)) == hw
    doc["issue_ahead"] = True
    with pytest.warns(UserWarning, match="'issue_ahead': true"):
        assert HardwareProfile.from_json(json.dumps(doc)) == hw


def test_cost_model_json_round_trips_and_fills_defaults() -> None:
    model = CostModel(backward_issue_factor=2.5, stream_up_fraction=0.7, stream_host_charge=0.0)
    assert CostModel.from_json(model.to_json()) == model
    assert json.loads(CostModel().to_json()) == {
        "schema_version": 1,
        "backward_issue_factor": 4.0,
        "stream_up_fraction": 0.78,
        "stream_host_charge": 0.5,
    }
    # A factor the document leaves out takes its default.
    partial = CostModel.from_json('{"schema_version": 1, "stream_up_fraction": 0.6}')
    assert partial == CostModel(stream_up_fraction=0.6)


@pytest.mark.parametrize(
    ("field", "value"),
    [("backward_issue_factor", v) for v in (0.5, float("inf"), float("nan"), True, "4")]
    + [("stream_up_fraction", v) for v in (0.0, -0.5, 1.5, float("nan"))]
    + [("stream_host_charge", v) for v in (-0.1, 1.5, float("nan"))],
)
def test_bad_cost_model_factor_is_named(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"CostModel.{field} is"):
        CostModel(**{field: value})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field):
        CostModel.from_json(json.dumps({"schema_version": 1, field: value}))


def test_a_misspelt_cost_model_factor_is_named() -> None:
    with pytest.raises(ValueError, match=r"unknown keys \['stream_up_fractoin'\]"):
        CostModel.from_json('{"schema_version": 1, "stream_up_fractoin": 0.5}')


def test_hardware_json_with_fitted_factors_loads_without_them_and_warns() -> None:
    # A HardwareProfile written while it held the cost model's factors: they load into no
    # field. Set ones (not 1) warn, naming them and the way to keep them; those at 1,
    # which every profile wrote when they were not set, load silently.
    hw = default_hardware()
    doc = json.loads(hw.to_json())
    doc.update(backward_issue_factor=1.0, stream_up_fraction=1.0, stream_host_charge=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert HardwareProfile.from_json(json.dumps(doc)) == hw
    assert CostModel.from_hardware_json(json.dumps(doc)) == CostModel(1.0, 1.0, 1.0)
    doc.update(backward_issue_factor=4.0, stream_up_fraction=0.78, stream_host_charge=0.5)
    with pytest.warns(UserWarning, match="backward_issue_factor=4.0, stream_up_fraction=0.78"):
        assert HardwareProfile.from_json(json.dumps(doc)) == hw
    with pytest.warns(UserWarning, match=r"CostModel.from_hardware_json\(text\)"):
        HardwareProfile.from_json(json.dumps(doc))
    # Mapped: the factors it carries, 1 for any it lacks (as that profile read them).
    assert CostModel.from_hardware_json(json.dumps(doc)) == CostModel()
    del doc["stream_host_charge"]
    assert CostModel.from_hardware_json(json.dumps(doc)) == CostModel(4.0, 0.78, 1.0)
    assert "backward_issue_factor" not in json.loads(hw.to_json())


def test_plans_record_their_cost_model_and_older_plans_read_with_the_defaults() -> None:
    profile = chain([200, 300, 150, 250], fwd_flop=100, bwd_flop=400)
    hardware = flat_hardware(h2d_bytes_per_s=100.0, flop_per_s=100.0)
    model = CostModel(backward_issue_factor=2.0, stream_up_fraction=0.5)
    plan = solve(profile, hardware, 5200, cost_model=model)
    assert plan.cost_model == model
    doc = json.loads(plan.to_json())
    assert doc["cost_model"] == {
        "backward_issue_factor": 2.0,
        "stream_up_fraction": 0.5,
        "stream_host_charge": 0.5,
    }
    assert Plan.from_json(plan.to_json()) == plan
    del doc["cost_model"]  # a plan written before plans recorded their cost model
    assert Plan.from_json(json.dumps(doc)) == dataclasses.replace(plan, cost_model=CostModel())
    doc["cost_model"] = {"backward_issue_factor": 0.5}
    with pytest.raises(ValueError, match=r"CostModel\.backward_issue_factor is 0\.5"):
        Plan.from_json(json.dumps(doc))


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_bad_device_memory_rate_is_named(rate: float) -> None:
    with pytest.raises(ValueError, match="device_memory_bytes_per_s"):
        flat_hardware(device_memory_bytes_per_s=rate)
    doc = json.loads(flat_hardware().to_json())
    doc["device_memory_bytes_per_s"] = "fast"
    with pytest.raises(ValueError, match="device_memory_bytes_per_s"):
        HardwareProfile.from_json(json.dumps(doc))


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_bad_host_memory_rate_is_named(rate: float) -> None:
    with pytest.raises(ValueError, match="host_memory_bytes_per_s"):
        flat_hardware(host_memory_bytes_per_s=rate)
    doc = json.loads(flat_hardware().to_json())
    doc["host_memory_bytes_per_s"] = "fast"
    with pytest.raises(ValueError, match="host_memory_bytes_per_s"):
        HardwareProfile.from_json(json.dumps(doc))


@pytest.mark.parametrize("rate", [-1.0, float("inf"), float("nan")])
def test_bad_conversion_rate_is_named(rate: float) -> None:
    with pytest.raises(ValueError, match="host_convert_elems_per_s"):
        flat_hardware(host_convert_elems_per_s=rate)
    doc = json.loads(flat_hardware().to_json())
    doc["host_convert_elems_per_s"] = "fast"
    with pytest.raises(ValueError, match="host_convert_elems_per_s"):
        HardwareProfile.from_json(json.dumps(doc))


def test_upload_bytes_per_param_round_trips_and_defaults_for_old_json() -> None:
    base = small_profile()
    fp32 = dataclasses.replace(base, host_upload_bytes_per_param=4)
    assert ModelProfile.from_json(fp32.to_json()) == fp32
    assert json.loads(fp32.to_json())["host_upload_bytes_per_param"] == 4
    # Profiles written before the field existed upload the parameters' own size.
    old = json.loads(fp32.to_json())
    del old["host_upload_bytes_per_param"]
    loaded = ModelProfile.from_json(json.dumps(old))
    assert loaded.host_upload_bytes_per_param == 0
    assert loaded == base


def test_bad_upload_bytes_per_param_is_named() -> None:
    base = small_profile()
    with pytest.raises(ValueError, match="host_upload_bytes_per_param is -4; must be a finite"):
        dataclasses.replace(base, host_upload_bytes_per_param=-4)
    doc = json.loads(base.to_json())
    doc["host_upload_bytes_per_param"] = "fp32"
    with pytest.raises(ValueError, match="host_upload_bytes_per_param"):
        ModelProfile.from_json(json.dumps(doc))


@pytest.mark.parametrize("kind", [ModelProfile, HardwareProfile, CostModel, Plan])
def test_wrong_schema_version_is_named(
    kind: type[ModelProfile | HardwareProfile | CostModel | Plan],
) -> None:
    with pytest.raises(ValueError, match="schema_version 99; this solver reads version 1"):
        kind.from_json(json.dumps({"schema_version": 99}))


@pytest.mark.parametrize("kind", [ModelProfile, HardwareProfile, CostModel, Plan])
def test_malformed_json_is_named(
    kind: type[ModelProfile | HardwareProfile | CostModel | Plan],
) -> None:
    with pytest.raises(ValueError, match="is not valid JSON"):
        kind.from_json("{not json")
    with pytest.raises(ValueError, match="must be an object"):
        kind.from_json("[1, 2]")


def test_profile_field_errors_are_named() -> None:
    doc = json.loads(small_profile().to_json())
    del doc["operations"]
    with pytest.raises(ValueError, match="'operations' is missing"):
        ModelProfile.from_json(json.dumps(doc))
    doc = json.loads(small_profile().to_json())
    doc["operations"][1]["param_names"] = ["nope"]
    with pytest.raises(
        ValueError, match=r"operations\[1\] \('op1'\) uses unknown parameter 'nope'"
    ):
        ModelProfile.from_json(json.dumps(doc))
    doc = json.loads(small_profile().to_json())
    doc["operations"] = []
    with pytest.raises(ValueError, match="operations is empty"):
        ModelProfile.from_json(json.dumps(doc))


def _write_inputs(tmp_path: Path) -> tuple[Path, Path]:
    profile = tmp_path / "profile.json"
    profile.write_text(small_profile().to_json())
    hardware = tmp_path / "hw.json"
    hardware.write_text(
        flat_hardware(
            h2d_bytes_per_s=100.0,
            d2h_bytes_per_s=1e12,
            flop_per_s=100.0,
            host_adam_params_per_s=1e12,
        ).to_json()
    )
    return profile, hardware


def test_cli_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile, hardware = _write_inputs(tmp_path)
    out = tmp_path / "plan.json"
    code = main([str(profile), "--budget", "5130", "--hardware", str(hardware), "-o", str(out)])
    assert code == 0
    plan = Plan.from_json(out.read_text())
    assert [rp.placement for rp in plan.regions] == [
        ParamPlacement.ASYNC,
        ParamPlacement.RESIDENT,
        ParamPlacement.ASYNC,
        ParamPlacement.RESIDENT,
    ]
    printed = capsys.readouterr().out
    assert "prefetch_at" in printed and "predicted peak" in printed
    assert "2/4 regions offloaded" in printed
    # Bytes already in use come off the budget: the same budget no longer fits.
    args = [str(profile), "--budget", "5130", "--hardware", str(hardware), "--in-use", "1KiB"]
    assert main(args) == 2
    assert "least budget that works is" in capsys.readouterr().err


def test_cli_host_step_options_reach_the_solver(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A budget that keeps every region's optimizer state on the host: how host steps may
    # run decides the step (see test_speculative_params_reach_the_simulation).
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    path, hw_path = tmp_path / "chain.json", tmp_path / "hw.json"
    path.write_text(profile.to_json())
    hardware = flat_hardware()
    hw_path.write_text(hardware.to_json())
    out = tmp_path / "plan.json"
    cases: list[tuple[list[str], dict[str, Any]]] = [
        ([], {}),
        (["--host-step-after-backward"], {"host_step_after_backward": True}),
        (
            ["--speculative-step-cost", "3", "--speculative-params", "500"],
            {"speculative_step_cost": 3.0, "speculative_params": 500},
        ),
    ]
    steps = []
    for flags, kwargs in cases:
        args = [str(path), "--budget", "8000", "--hardware", str(hw_path), *flags]
        assert main([*args, "-o", str(out)]) == 0, flags
        capsys.readouterr()
        got = Plan.from_json(out.read_text())
        want = solve(profile, hardware, 8000, **kwargs)
        assert got.regions == want.regions, flags
        assert all(rp.state is StatePlacement.HOST for rp in got.regions)
        assert got.predicted_step_time_s == want.predicted_step_time_s, flags
        steps.append(got.predicted_step_time_s)
    assert len(set(steps)) == 3, steps


def test_cli_plans_with_a_cost_model_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Host state and an issue cost: the backward issue factor changes the step. Without
    # --cost-model the CLI plans with CostModel(); with one, with its factors (those it
    # leaves out at their defaults), and the plan records them.
    profile = chain([300, 400, 500, 400, 300], fwd_flop=100, bwd_flop=1000)
    hardware = dataclasses.replace(flat_hardware(), op_overhead_s=0.5)
    path, hw_path = tmp_path / "chain.json", tmp_path / "hw.json"
    path.write_text(profile.to_json())
    hw_path.write_text(hardware.to_json())
    cost_path, out = tmp_path / "cost.json", tmp_path / "plan.json"
    cost_path.write_text('{"schema_version": 1, "backward_issue_factor": 1.0}')
    base = [str(path), "--budget", "8000", "--hardware", str(hw_path), "-o", str(out)]
    assert main(base) == 0
    fitted = Plan.from_json(out.read_text())
    assert main([*base, "--cost-model", str(cost_path)]) == 0
    told = Plan.from_json(out.read_text())
    capsys.readouterr()
    assert fitted.cost_model == CostModel()
    assert told.cost_model == CostModel(backward_issue_factor=1.0)
    for plan in (fitted, told):
        want = solve(profile, hardware, 8000, cost_model=plan.cost_model)
        assert plan.regions == want.regions
        assert plan.predicted_step_time_s == want.predicted_step_time_s
    assert told.predicted_step_time_s < fitted.predicted_step_time_s
    cost_path.write_text('{"schema_version": 1, "backward_issue_factor": 0.5}')
    assert main([*base, "--cost-model", str(cost_path)]) == 2
    assert "CostModel.backward_issue_factor is 0.5" in capsys.readouterr().err


def test_cli_block_search_range(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    profile = tmp_path / "layers.json"
    sizes = [1000, 24, 1000, 24, 1000, 24, 1000]  # one 4072 B region by default
    params = tuple(Parameter(f"w{i}", s // 2, s) for i, s in enumerate(sizes))
    ops = tuple(Operation(f"op{i}", (f"w{i}",), saved_bytes=1000) for i in range(7))
    profile.write_text(ModelProfile("layers", params, ops).to_json())
    assert main([str(profile), "--budget", "10000"]) == 2
    assert "least budget" in capsys.readouterr().err
    assert main([str(profile), "--budget", "10000", "--block-search-range", "0"]) == 0
    assert "/7 regions offloaded" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--budget", "lots"], "cannot parse size 'lots'"),
        (["--budget", "0"], "budget_bytes is 0"),
        (["--budget", "1KB"], "least budget that works is"),
        (["--budget", "16GiB", "--in-use", "-5"], "size '-5' is not a finite, non-negative number"),
        (["--budget", "16GiB", "--micro-batches", "0"], "micro_batches is 0"),
        (["--budget", "16GiB", "--speculative-params", "-1"], "speculative_params must be"),
        (["--budget", "16GiB", "--speculative-step-cost", "0.5"], "speculative_step_cost is"),
        (["--budget", "16GiB", "--solver", "magic"], "Solver 'magic' is not registered"),
        (["--budget", "16GiB", "--hardware", "missing.json"], "cannot read hardware file"),
        (["--budget", "16GiB", "--cost-model", "missing.json"], "cannot read cost model file"),
    ],
)
def test_cli_bad_input_exits_2_without_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    profile, _ = _write_inputs(tmp_path)
    os.chdir(tmp_path)
    assert main([str(profile), *args]) == 2
    err = capsys.readouterr().err
    assert message in err
    assert "Traceback" not in err


def test_cli_rejects_wrong_version_profile(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = json.loads(small_profile().to_json())
    doc["schema_version"] = 2
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    assert main([str(path), "--budget", "1GiB"]) == 2
    assert "schema_version 2" in capsys.readouterr().err


def test_python_dash_m_runs_the_cli(tmp_path: Path) -> None:
    profile, hardware = _write_inputs(tmp_path)
    src = str(Path(offload_solver.__file__).parents[1])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "offload_solver",
            str(profile),
            "--budget",
            "5130",
            "--hardware",
            str(hardware),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "predicted step" in done.stdout
    bad = subprocess.run(
        [sys.executable, "-m", "offload_solver", str(tmp_path / "none.json"), "--budget", "1GB"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert bad.returncode == 2
    assert "cannot read profile file" in bad.stderr and "Traceback" not in bad.stderr


@pytest.mark.parametrize(
    ("doc", "path", "value", "message"),
    [
        ("profile", ("operations", 0, "saved_bytes"), float("nan"), "saved_bytes is nan"),
        ("profile", ("operations", 0, "fwd_flop"), -1.5, "fwd_flop is -1.5"),
        ("profile", ("operations", 0, "fwd_out_bytes"), float("inf"), "fwd_out_bytes is inf"),
        ("profile", ("parameters", 0, "size_bytes"), 3.5, "size_bytes is 3.5"),
        ("profile", ("parameters", 0, "size_bytes"), 3, "not numel"),
        ("profile", ("parameters", 0, "numel"), "10", "numel is '10'"),
        ("hardware", ("compute_flop_per_s",), float("nan"), "compute_flop_per_s is nan"),
        ("hardware", ("host_adam_params_per_s",), float("inf"), "host_adam_params_per_s is inf"),
        ("hardware", ("h2d", 0, "bytes_per_s"), float("nan"), "BandwidthPoint.bytes_per_s is nan"),
        ("hardware", ("op_overhead_s",), -1e-6, "op_overhead_s is -1e-06"),
    ],
)
def test_every_number_of_a_profile_or_hardware_file_is_checked(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    doc: str,
    path: tuple[Any, ...],
    value: Any,
    message: str,
) -> None:
    """NaN, infinite, negative, fractional counts and strings in a JSON file exit 2 with
    the field named, and write no plan."""
    profile, hardware = _write_inputs(tmp_path)
    target = profile if doc == "profile" else hardware
    data = json.loads(target.read_text())
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    target.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
    out = tmp_path / "plan.json"
    argv = [str(profile), "--budget", "1GiB", "--hardware", str(hardware), "-o", str(out)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()


def test_the_plan_file_is_replaced_whole(tmp_path: Path) -> None:
    """The plan is written to a temporary file beside the target and renamed over it: the
    target holds the old plan or the new one, never a part, and nothing else is left."""
    profile, hardware = _write_inputs(tmp_path)
    out = tmp_path / "plan.json"
    out.write_text("old")
    argv = [str(profile), "--budget", "1GiB", "--hardware", str(hardware), "-o", str(out)]
    assert main(argv) == 0
    assert Plan.from_json(out.read_text()).budget_bytes == 2**30
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [profile.name, hardware.name, out.name]
    )
