"""The training script end to end on gpt2_tiny, run.sh, --plan_only, and bad input.

Every run here trains on the CPU: uploads and offloads are host-to-host copies there, so
the whole pipeline (trace, solve, rewrite, offloaded training, plan files) is exercised
without a GPU. A CPU run plans for ``offload_solver.default_hardware()``, as ``--plan_only``
does without a GPU. The last test, marked ``gpu``, runs run.sh with the reference defaults.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from offload_gpt_example.__main__ import main
from offload_gpt_example.models import (
    WithLMLoss,
    build_model,
    labels_for,
    lm_loss,
    random_batch,
)
from offload_runtime import describe_plan
from offload_solver import ParamPlacement, Plan, StatePlacement

PACKAGE_DIR = Path(__file__).resolve().parents[1]
RUN_SH = PACKAGE_DIR / "run.sh"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
GB = 1024**3
MB = 1024**2

NUM = r"([0-9]+(?:\.[0-9]+)?(?:e[-+]?[0-9]+)?)"
INIT_LINE = re.compile(rf"^init_param_size={NUM} MB \| init_model_time={NUM} s$", re.M)
SUMMARY_LINE = re.compile(
    rf"^act_peak_mem={NUM} MB \| max_param_mem={NUM} MB \| total_param_mem={NUM} MB$", re.M
)
SOLVER_LINE = re.compile(rf"^solver_time={NUM} s$", re.M)
FINAL_LINE = re.compile(
    rf"^\| exec_time={NUM} s \| param_size={NUM} MB \| runtime_peak_mem_alc={NUM} MB\| "
    rf"runtime_peak_mem_res={NUM} MB\|$",
    re.M,
)
PREDICTED_LINE = re.compile(
    rf"^predicted_peak_mem={NUM} MB \| runtime_peak_mem_alc={NUM} MB \| "
    rf"predicted_step_time={NUM} s \| exec_time={NUM} s$",
    re.M,
)
LOSS_LINE = re.compile(r"^final_loss=([-+0-9.eE]+|nan|inf)$", re.M)
HOST_LINE = re.compile(
    rf"^host_adam: planned {NUM} G parameters/s, {NUM} ms busy per step \| in the loop "
    rf"{NUM} ms busy per step \((\d+) steps\): {NUM} G parameters/s$",
    re.M,
)
BACKWARD_LINE = re.compile(
    rf"^backward: planned issue factor {NUM} \| in the loop {NUM} ms per backward "
    rf"\((\d+) steps\) for (\d+) operations at {NUM} us: factor {NUM}$",
    re.M,
)
LEAST_BUDGET = re.compile(r"below the least feasible budget [0-9.e+-]+ GB \(([0-9]+) bytes\)")
# What the plan chose: the options line, then the table of regions up to solver_time.
PLAN_TEXT = re.compile(r"^plan: .*?(?=^solver_time=)", re.M | re.S)
SPECULATION_LINE = re.compile(
    r"^speculation: (\d+) regions stepped under the last backward; (\d+) steps undone", re.M
)

TINY = ["--model_type", "gpt2_tiny", "--device", "cpu", "--no_progress"]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    """Run the script in this process; (exit code, stdout, stderr)."""
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse's usage errors
        code = int(exc.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def _plan_text(out: str) -> str:
    """The ``plan:`` line and the region table a run printed."""
    match = PLAN_TEXT.search(out)
    assert match is not None, out
    return match.group(0).rstrip("\n")


def _least_budget_gb(base: list[str], capsys: pytest.CaptureFixture[str]) -> float:
    """The least feasible budget the script reports for ``base`` (asking for 1 byte)."""
    code, _, err = _run([*base, "--memory_budget", str(1 / GB)], capsys)
    assert code == 1, err
    match = LEAST_BUDGET.search(err)
    assert match is not None, err
    return int(match.group(1)) / GB


@pytest.fixture(scope="module")
def least_tiny_gb() -> dict[tuple[str, str], float]:
    """Cache of least budgets per (solver, dtype), filled by the tests that need one."""
    return {}


@pytest.mark.parametrize("solver", ["syn", "asyn"])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_trains_gpt2_tiny_at_its_least_budget(
    solver: str,
    dtype: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    base = [*TINY, "--batch_size", "2", "--solver_type", solver, "--dtype", dtype]
    base += ["--log_dir", str(tmp_path), "--steps", "3"]
    # Half again the least feasible budget: tight enough that regions must be offloaded,
    # loose enough that the asyn solver can afford prefetch buffers (at the least budget
    # its repair step turns every prefetch back into a sync upload).
    budget_gb = _least_budget_gb(base, capsys) * 1.5
    code, out, err = _run([*base, "--memory_budget", repr(budget_gb)], capsys)
    assert code == 0, err

    init = INIT_LINE.search(out)
    assert init is not None, out
    bytes_per = {"fp32": 4, "bf16": 2}[dtype]
    numel = sum(p.numel() for p in build_model("gpt2_tiny", device="meta").parameters())
    assert float(init.group(1)) == pytest.approx(numel * bytes_per / MB, abs=1e-3)
    assert SUMMARY_LINE.search(out) is not None, out
    assert SOLVER_LINE.search(out) is not None, out
    final = FINAL_LINE.search(out)
    assert final is not None, out
    exec_time, param_size, alc, res = (float(g) for g in final.groups())
    assert exec_time > 0
    assert param_size == pytest.approx(numel * bytes_per / MB, abs=1e-3)
    assert (alc, res) == (0.0, 0.0)  # no CUDA allocator on the CPU, and the script says so
    assert "runtime_peak_mem_* are 0 on the CPU" in out
    predicted = PREDICTED_LINE.search(out)
    assert predicted is not None, out
    assert float(predicted.group(1)) <= budget_gb * 1024  # MB
    loss = LOSS_LINE.search(out)
    assert loss is not None, out
    # Three Adam steps on one batch: the loss falls below its starting log(vocab).
    assert math.isfinite(float(loss.group(1)))
    assert float(loss.group(1)) < math.log(1024)

    stem = f"gpt2_tiny_bs_2_st_{solver}"
    plan = Plan.from_json((tmp_path / f"{stem}.plan.json").read_text())
    assert plan.solver == solver
    assert plan.budget_bytes == int(budget_gb * GB)
    assert plan.predicted_peak_bytes <= 0.95 * plan.budget_bytes + 1
    # Regions are offloaded, the way the solver was asked to.
    offloaded = [rp for rp in plan.regions if rp.placement is not ParamPlacement.RESIDENT]
    assert offloaded, plan.regions
    if solver == "syn":
        assert all(rp.placement is ParamPlacement.SYNC for rp in offloaded)
    else:
        assert any(rp.placement is ParamPlacement.ASYNC for rp in offloaded)
    assert sum(rp.region.size_bytes for rp in plan.regions) == numel * bytes_per
    assert (tmp_path / f"{stem}.plan.png").read_bytes()[:8] == PNG_MAGIC


def test_fp32_offloaded_training_matches_plain_adamw(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The script's loss after 3 steps equals the same 3 steps of plain torch AdamW."""
    steps, batch, lr = 3, 2, 1e-3
    base = [*TINY, "--batch_size", str(batch), "--dtype", "fp32", "--solver_type", "asyn"]
    base += ["--log_dir", str(tmp_path), "--steps", str(steps), "--lr", str(lr)]
    least_gb = _least_budget_gb(base, capsys)
    code, out, err = _run([*base, "--memory_budget", repr(least_gb * 1.5)], capsys)
    assert code == 0, err
    match = LOSS_LINE.search(out)
    assert match is not None, out
    plan = Plan.from_json((tmp_path / f"gpt2_tiny_bs_{batch}_st_asyn.plan.json").read_text())
    assert any(rp.placement is ParamPlacement.ASYNC for rp in plan.regions)

    # The script seeds the global RNG, builds the model (its own seeded generator), then
    # draws the batch: repeat that order.
    torch.manual_seed(0)
    model = build_model("gpt2_tiny", dtype=torch.float32, dropout=0.0)
    data = random_batch(batch, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        loss = lm_loss(model(**data), labels_for(data))
        loss.backward()  # type: ignore[no-untyped-call]
        opt.step()
    assert float(match.group(1)) == pytest.approx(loss.item(), rel=1e-5)


def test_accumulated_training_matches_plain_adamw_and_is_planned_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two micro-batches per step: the loss after 3 steps equals plain torch AdamW's on the
    mean of the two micro-batch losses, and the plan's step covers both."""
    steps, batch, lr, micro = 3, 2, 1e-3, 2
    base = [*TINY, "--batch_size", str(batch), "--dtype", "fp32", "--solver_type", "asyn"]
    base += ["--log_dir", str(tmp_path), "--steps", str(steps), "--lr", str(lr)]
    budget = repr(_least_budget_gb(base, capsys) * 1.5)
    predicted = {}
    for k in (1, micro):
        argv = [*base, "--memory_budget", budget, "--accumulation_steps", str(k)]
        code, out, err = _run(argv, capsys)
        assert code == 0, err
        line = PREDICTED_LINE.search(out)
        assert line is not None, out
        predicted[k] = float(line.group(3))
    match = LOSS_LINE.search(out)
    assert match is not None, out
    assert predicted[micro] > predicted[1]

    torch.manual_seed(0)
    model = build_model("gpt2_tiny", dtype=torch.float32, dropout=0.0)
    batches = [random_batch(batch, 8) for _ in range(micro)]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    for _ in range(steps):
        opt.zero_grad()
        losses = []
        for b in batches:
            loss = lm_loss(model(**b), labels_for(b))
            (loss / micro).backward()  # type: ignore[no-untyped-call]
            losses.append(loss.item())
        opt.step()
    assert float(match.group(1)) == pytest.approx(sum(losses) / micro, rel=1e-5)


def test_the_default_fp16_plan_trains_and_the_log_names_what_it_chose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """fp16 with the planner's choices: the run trains to a finite loss, and what it prints
    of the plan (the ``plan:`` line and the region table) is the plan it wrote. Where
    the plan speculates (the single-pass kernels load), the host-resident regions step
    under backward and no step is undone."""
    base = [*TINY, "--batch_size", "2", "--dtype", "fp16", "--steps", "4"]
    base += ["--log_dir", str(tmp_path)]
    budget = repr(_least_budget_gb(base, capsys) * 1.5)
    code, out, err = _run([*base, "--memory_budget", budget], capsys)
    assert code == 0, err
    loss = LOSS_LINE.search(out)
    assert loss is not None, out
    assert math.isfinite(float(loss.group(1))) and float(loss.group(1)) < math.log(1024)
    plan = Plan.from_json((tmp_path / "gpt2_tiny_bs_2_st_asyn.plan.json").read_text())
    assert _plan_text(out) == describe_plan(plan)
    assert any(rp.placement is not ParamPlacement.RESIDENT for rp in plan.regions)
    host = sum(rp.state is StatePlacement.HOST for rp in plan.regions)
    spec = SPECULATION_LINE.search(out)
    assert (spec is not None) == plan.options.speculative, out
    if spec is not None:
        # The steps run on the speculation thread, which skips one that would start after
        # backward has ended (that region steps after the answer instead): how many make
        # it depends on the machine's load, so not all are required.
        assert 1 <= int(spec.group(1)) <= host and spec.group(2) == "0"
        assert "speculative host steps" in _plan_text(out).splitlines()[0]


def test_speculation_is_planned_for_the_undo_buffers_that_fit(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Host memory for the undo buffers of the last host-resident region only: the plan
    speculates that region's parameters (the planner counts them from the host memory its
    host state leaves, the model's own host weights counted as free), the optimizer gives
    buffers to the same region, and the run trains as with room for all."""
    pytest.importorskip("numba", reason="fp16 speculation is planned with numba's kernels")
    import offload_runtime.planning.planner as planner
    from offload_runtime.planning import SPECULATION_HOST_SHARE
    from offload_runtime.planning.device import model_bytes_on
    from offload_runtime.planning.speculation import host_state_bytes

    base = [*TINY, "--batch_size", "2", "--dtype", "fp16", "--steps", "3"]
    base += ["--log_dir", str(tmp_path)]
    budget = repr(_least_budget_gb(base, capsys) * 1.5)
    code, out, err = _run([*base, "--memory_budget", budget], capsys)
    assert code == 0, err
    plain_loss = LOSS_LINE.search(out)
    assert plain_loss is not None, out
    plan_file = tmp_path / "gpt2_tiny_bs_2_st_asyn.plan.json"
    first = Plan.from_json(plan_file.read_text())
    assert first.options.speculative and first.options.speculative_params is None
    host = [rp.region for rp in first.regions if rp.state is StatePlacement.HOST]
    assert len(host) >= 2
    last = max(host, key=lambda r: r.index)
    state = host_state_bytes(first, torch.float32, torch.float16)
    # The planner adds the model's own host weights (the script's fp16 copy) to the room.
    model = build_model("gpt2_tiny", dtype=torch.float16)
    model_bytes = model_bytes_on(model, torch.device("cpu"))
    room = state + math.ceil(12 * last.numel / SPECULATION_HOST_SHARE) + 1 - model_bytes
    monkeypatch.setattr(planner, "available_host_memory_bytes", lambda: room)
    code, out, err = _run([*base, "--memory_budget", budget], capsys)
    assert code == 0, err
    plan = Plan.from_json(plan_file.read_text())
    assert [rp.state for rp in plan.regions] == [rp.state for rp in first.regions]
    assert plan.options.speculative_params == last.numel
    assert f"undo buffers for {last.numel} parameters" in _plan_text(out)
    assert _plan_text(out).count(" yes") == 1  # one row: the last region
    assert "speculation: 1 regions stepped under the last backward" in out
    loss = LOSS_LINE.search(out)
    assert loss is not None, out
    assert float(loss.group(1)) == pytest.approx(float(plain_loss.group(1)), abs=1e-3)


def test_bf16_moments_train_as_fp32_moments_do(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--host_state bf16_moments: planned with host state in bf16 moments, and training as
    with fp32 moments up to the moments' rounding (the kernels' exactness is tested in
    offload-optim); --plan_only plans it too."""
    base = [*TINY, "--batch_size", "2", "--dtype", "fp16", "--steps", "4"]
    base += ["--log_dir", str(tmp_path)]
    budget = repr(_least_budget_gb(base, capsys) * 1.5)
    losses = {}
    for flags in ([], ["--host_state", "bf16_moments"]):
        code, out, err = _run([*base, "--memory_budget", budget, *flags], capsys)
        assert code == 0, err
        loss = LOSS_LINE.search(out)
        assert loss is not None, out
        losses[" ".join(flags)] = float(loss.group(1))
    plan = Plan.from_json((tmp_path / "gpt2_tiny_bs_2_st_asyn.plan.json").read_text())
    assert any(rp.state is StatePlacement.HOST for rp in plan.regions)
    assert math.isfinite(losses[""]) and losses[""] < math.log(1024)
    assert losses["--host_state bf16_moments"] == pytest.approx(losses[""], abs=1e-3)
    code, out, err = _run(
        [*base, "--memory_budget", budget, "--host_state", "bf16_moments", "--plan_only"], capsys
    )
    assert code == 0, err
    assert re.search(r"^predicted_peak_mem=[0-9.]+ MB \| predicted_step_time=", out, re.M), out


@pytest.mark.parametrize(
    "flags",
    [
        ["--speculate"],
        ["--fp16_io"],
        ["--stream"],
        ["--fuse_gelu"],
        ["--host_rate", "1"],
        ["--backward_issue_factor", "2"],
        ["--block_search_range", "0"],
    ],
)
def test_speed_only_choices_are_the_planners_not_flags(
    flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run([*TINY, *flags, "--plan_only"], capsys)
    assert code == 2
    assert f"unrecognized arguments: {' '.join(flags)}" in err


@pytest.mark.parametrize("dtype", ["fp16", "fp32"])
def test_plan_only_prints_and_writes_the_plan_a_run_trains_with(
    dtype: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The same flags with and without --plan_only, on this machine: the same ``plan:``
    line and region table, and the same plan JSON up to the solver's own wall time."""
    base = [*TINY, "--batch_size", "2", "--dtype", dtype, "--steps", "1"]
    base += ["--memory_budget", repr(_least_budget_gb(base, capsys) * 1.5)]
    texts, plans = [], []
    for extra in ([], ["--plan_only"]):
        log_dir = tmp_path / ("plan_only" if extra else "run")
        code, out, err = _run([*base, *extra, "--log_dir", str(log_dir)], capsys)
        assert code == 0, err
        texts.append(_plan_text(out))
        plans.append(json.loads((log_dir / "gpt2_tiny_bs_2_st_asyn.plan.json").read_text()))
        plans[-1].pop("solve_time_s")
    assert texts[0] == texts[1]
    assert plans[0] == plans[1]
    assert any(rp["placement"] != "resident" for rp in plans[0]["regions"]), texts[0]


def test_run_sh_tees_to_the_reference_log_name(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHON": sys.executable,
        "MODEL_TYPE": "gpt2_tiny",
        "BATCH_SIZE": "2",
        "MEMORY_BUDGET": "1",
        "SOLVER_TYPE": "syn",
    }
    # Run from an unrelated folder: run.sh finds the packages from its own location.
    proc = subprocess.run(
        ["bash", str(RUN_SH), "--device", "cpu", "--dtype", "fp32", "--steps", "2"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log_dir = tmp_path / "offload_logs"
    log = log_dir / "gpt2_tiny_bs_2_st_syn.log"
    text = log.read_text()
    # Progress bars share the log (stderr is merged); every result line still starts a line.
    for line in (INIT_LINE, SUMMARY_LINE, SOLVER_LINE, FINAL_LINE, PREDICTED_LINE):
        assert line.search(text) is not None, (line.pattern, text)
    # The log holds what the terminal showed.
    assert FINAL_LINE.search(proc.stdout) is not None
    assert Plan.from_json((log_dir / "gpt2_tiny_bs_2_st_syn.plan.json").read_text()).solver == "syn"
    assert (log_dir / "gpt2_tiny_bs_2_st_syn.plan.png").read_bytes()[:8] == PNG_MAGIC


def test_run_sh_fails_when_the_script_fails(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "MODEL_TYPE": "gpt2_nope",
    }
    proc = subprocess.run(
        ["bash", str(RUN_SH)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 2, proc.stdout + proc.stderr
    log = tmp_path / "offload_logs" / "gpt2_nope_bs_64_st_asyn.log"
    assert "Model 'gpt2_nope' is not registered" in log.read_text()


def test_plan_only_plans_as_the_planner_does_for_a_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a GPU, --plan_only plans the model it names for the default GPU profile
    through the public planner (offload_runtime.plan), with the OffloadConfig the flags
    make, and prints what the plan chose."""
    from offload_runtime import OffloadConfig, plan
    from offload_solver import default_hardware

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--model_type", "gpt2_medium", "--batch_size", "8", "--seq_len", "1024"]
    argv += ["--dtype", "fp16", "--memory_budget", "13", "--accumulation_steps", "2"]
    argv += ["--dropout", "0.1", "--no_fuse_gelu"]
    code, out, err = _run(
        [*argv, "--plan_only", "--log_dir", str(tmp_path), "--no_progress"], capsys
    )
    assert code == 0, err
    assert "no CUDA device: planning for default-h200-pcie5" in out
    got = Plan.from_json((tmp_path / "gpt2_medium_bs_8_st_asyn.plan.json").read_text())
    assert _plan_text(out) == describe_plan(got)
    # The example plans its model with the loss (WithLMLoss).
    model = WithLMLoss(
        build_model("gpt2_medium", device="meta", dtype=torch.float16, seq_len=1024, dropout=0.1)
    )
    model.train()
    want = plan(
        model,
        random_batch(8, 1024, device="meta"),
        13 * GB,
        config=OffloadConfig(accumulation_steps=2, fuse_gelu=False),
        hardware=default_hardware(),
        device="cuda",
        progress=False,
    )
    assert got.options == want.options and got.options.micro_batches == 2
    assert got.regions == want.regions
    assert got.predicted_step_time_s == want.predicted_step_time_s


def test_plan_only_gpt2_24b_allocates_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Plan for the default GPU profile even on a machine that has one, so the test is the
    # same everywhere.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    # How long planning takes is measured by benchmarks/solver_bench.py, not bounded here
    # (a loaded CI machine makes wall-clock bounds flaky).
    code, out, err = _run(
        ["--model_type", "gpt2_24b", "--plan_only", "--log_dir", str(tmp_path), "--no_progress"],
        capsys,
    )
    assert code == 0, err
    init = INIT_LINE.search(out)
    assert init is not None, out
    # 24.2e9 fp16 parameters: about 46,000 MB.
    assert float(init.group(1)) == pytest.approx(24.179e9 * 2 / MB, rel=1e-3)
    assert SOLVER_LINE.search(out) is not None, out
    assert FINAL_LINE.search(out) is None  # nothing was trained
    plan = Plan.from_json((tmp_path / "gpt2_24b_bs_64_st_asyn.plan.json").read_text())
    assert plan.budget_bytes == 16 * GB
    assert plan.predicted_peak_bytes <= 0.95 * 16 * GB
    # 48 GB of fp16 weights cannot sit in 16 GB: most regions are offloaded.
    offloaded = [rp for rp in plan.regions if rp.placement is not ParamPlacement.RESIDENT]
    assert len(offloaded) > len(plan.regions) // 2
    assert (tmp_path / "gpt2_24b_bs_64_st_asyn.plan.png").read_bytes()[:8] == PNG_MAGIC


def test_unknown_model_lists_the_valid_ones(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(["--model_type", "gpt5"], capsys)
    assert code == 2
    assert "Model 'gpt5' is not registered; known: gpt2_micro, gpt2_tiny, gpt2_medium" in err
    assert "gpt2_24b" in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch_size", "0", "--batch_size is 0"),
        ("--steps", "-1", "--steps is -1"),
        ("--accumulation_steps", "0", "--accumulation_steps is 0"),
        ("--memory_budget", "0", "--memory_budget is 0"),
        ("--memory_budget", "nan", "--memory_budget is nan"),
        ("--solver_type", "greedy", "invalid choice: 'greedy'"),
        ("--dtype", "fp8", "invalid choice: 'fp8'"),
    ],
)
def test_bad_flags_are_usage_errors(
    flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _run([*TINY, flag, value], capsys)
    assert code == 2
    assert message in err


def test_budget_below_least_prints_it_and_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = [*TINY, "--batch_size", "2", "--dtype", "fp32", "--log_dir", str(tmp_path)]
    least_gb = _least_budget_gb(base, capsys)
    assert least_gb > 0
    # Just below the least: still refused, and no plan file is written.
    code, _, err = _run([*base, "--memory_budget", repr(least_gb * 0.9)], capsys)
    assert code == 1
    assert "rerun with --memory_budget" in err
    assert not list(tmp_path.glob("*.plan.json"))
    code, _, err = _run(
        ["--model_type", "gpt2_24b", "--plan_only", "--memory_budget", "0.001", "--no_progress"],
        capsys,
    )
    assert code == 1
    assert LEAST_BUDGET.search(err) is not None, err


def test_device_cuda_without_cuda_says_so(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _run(["--device", "cuda", "--no_progress"], capsys)
    assert code == 1
    assert "--device cuda was requested but CUDA is not available" in err
    assert INIT_LINE.search(out) is None  # it stopped before building anything


def test_device_auto_without_gpu_falls_back_to_tiny(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    code, out, err = _run(
        ["--steps", "2", "--log_dir", str(tmp_path), "--no_progress", "--dtype", "bf16"], capsys
    )
    assert code == 0, err
    assert "no CUDA device: falling back to gpt2_tiny at batch 4 on the CPU" in out
    assert "asked for gpt2_medium at batch 64" in out
    final = FINAL_LINE.search(out)
    assert final is not None, out
    numel = sum(p.numel() for p in build_model("gpt2_tiny", device="meta").parameters())
    assert float(final.group(2)) == pytest.approx(numel * 2 / MB, abs=1e-3)
    # The files keep the requested run's name, so they sit beside run.sh's log.
    plan = Plan.from_json((tmp_path / "gpt2_medium_bs_64_st_asyn.plan.json").read_text())
    assert plan.budget_bytes == 16 * GB


@pytest.mark.gpu
def test_run_sh_defaults_fit_the_budget_on_a_gpu(tmp_path: Path) -> None:
    """The reference default (gpt2_medium, bs 64, 16 GB, asyn) trains within its budget."""
    env = {**os.environ, "PYTHON": sys.executable}
    for name in ("MODEL_TYPE", "BATCH_SIZE", "MEMORY_BUDGET", "SOLVER_TYPE"):
        env.pop(name, None)
    proc = subprocess.run(
        ["bash", str(RUN_SH)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = (tmp_path / "offload_logs" / "gpt2_medium_bs_64_st_asyn.log").read_text()
    final = FINAL_LINE.search(text)
    assert final is not None, text[-4000:]
    exec_time, param_size, alc, res = (float(g) for g in final.groups())
    assert exec_time > 0
    assert param_size == pytest.approx(304_408_576 * 2 / MB, rel=1e-3)
    assert 0 < alc <= 16 * 1024, f"peak allocated {alc:.1f} MB exceeds the 16 GB budget"
    assert res >= alc
    loss = LOSS_LINE.search(text)
    assert loss is not None and math.isfinite(float(loss.group(1)))


def test_the_host_rate_the_loop_ran_at_is_printed_beside_the_plans(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The host_adam line says how busy the host was in the loop against the plan, and the
    rate that makes."""
    base = [*TINY, "--batch_size", "2", "--dtype", "fp32", "--log_dir", str(tmp_path)]
    base += ["--steps", "4"]
    budget_gb = _least_budget_gb(base, capsys) * 1.5
    code, out, err = _run([*base, "--memory_budget", repr(budget_gb)], capsys)
    assert code == 0, err
    line = HOST_LINE.search(out)
    assert line is not None, out
    planned, planned_ms, loop_ms, steps, loop = line.groups()
    assert int(steps) == 3  # the first of the 4 steps left out
    # The printed figures are rounded to 4 significant digits: agree within 1%.
    assert float(loop) == pytest.approx(
        float(planned) * float(planned_ms) / float(loop_ms), rel=1e-2
    )


def test_the_backward_issue_factor_the_loop_read_is_printed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """With host state and a profile that charges an issue cost, the backward line sets
    the host's time in backward(loss) beside issuing the plan's operations at that cost,
    and the factor that makes. (The default profile charges no issue cost: 20 us an
    operation is set here.)"""
    import offload_gpt_example.__main__ as script
    from offload_solver import CostModel, default_hardware

    profile = dataclasses.replace(default_hardware(), op_overhead_s=20e-6)
    monkeypatch.setattr(script, "default_hardware", lambda: profile)
    base = [*TINY, "--batch_size", "2", "--dtype", "fp32", "--log_dir", str(tmp_path)]
    base += ["--steps", "4"]
    budget = repr(_least_budget_gb(base, capsys) * 1.5)
    code, out, err = _run([*base, "--memory_budget", budget], capsys)
    assert code == 0, err
    line = BACKWARD_LINE.search(out)
    assert line is not None, out
    planned, loop_ms, steps, ops, issue_us, factor = line.groups()
    # Planned at the cost model's default factor.
    assert float(planned) == CostModel().backward_issue_factor and int(steps) == 3
    assert float(issue_us) == 20.0
    expected = max(1.0, float(loop_ms) / (int(ops) * 0.02))
    assert float(factor) == pytest.approx(expected, rel=1e-2, abs=2e-3)


def test_fused_gelu_keeps_fewer_activations_and_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """By default GPT-2's written-out GELU is traced as one aten.gelu: against
    --no_fuse_gelu the planned activation peak drops (three fewer MLP-width activations a
    layer), and the tiny model trains to a finite loss either way."""
    base = [*TINY, "--batch_size", "2", "--steps", "2", "--log_dir", str(tmp_path)]
    peaks = []
    for extra in (["--no_fuse_gelu"], []):
        code, out, err = _run([*base, *extra, "--plan_only"], capsys)
        assert code == 0, err
        match = SUMMARY_LINE.search(out)
        assert match is not None, out
        peaks.append(float(match.group(1)))
    assert peaks[1] < peaks[0]
    for extra in (["--no_fuse_gelu"], []):
        code, out, err = _run([*base, *extra], capsys)
        assert code == 0, err
        loss = LOSS_LINE.search(out)
        assert loss is not None and math.isfinite(float(loss.group(1))), out


def test_torchrun_trains_data_parallel_and_says_so(tmp_path: Path) -> None:
    """The done-when command of data-parallel training, with gloo on the CPU: both ranks
    train at a budget that puts optimizer state on the host, each says the world size and
    which host-state regions it owns (one owner each), and only rank 0 writes the plan."""
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            "-m",
            "offload_gpt_example",
            "--device",
            "cpu",
            "--model_type",
            "gpt2_tiny",
            "--batch_size",
            "4",
            "--steps",
            "3",
            "--memory_budget",
            "0.01",
            "--no_progress",
            "--log_dir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    owned = {}
    for rank in (0, 1):
        line = re.search(
            rf"data parallel: world size 2, rank {rank} of 2 owns host-state regions "
            r"\[([\d, ]*)\] \((\d+) of (\d+):",
            proc.stdout,
        )
        assert line is not None, proc.stdout
        owned[rank] = {int(r) for r in line[1].split(",") if r.strip()}
        assert len(owned[rank]) == int(line[2])
        sharded = int(line[3])
    # Each sharded region has one owner; at this budget some are sharded.
    assert not owned[0] & owned[1]
    assert len(owned[0] | owned[1]) == sharded > 1
    assert len(FINAL_LINE.findall(proc.stdout)) == 2
    assert [p.name for p in tmp_path.glob("*.plan.json")] == ["gpt2_tiny_bs_4_st_asyn.plan.json"]
