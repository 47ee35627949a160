"""gpu_session.sh: its syntax, and each phase's commands as a dry run prints them (no GPU),
each benchmark command checked by offload_bench.py's own argument parser."""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from offload_bench import REPORT_KINDS, parse_args

SCRIPT = Path(__file__).resolve().parents[1] / "gpu_session.sh"
PHASES = (
    "configs1",
    "configs2",
    "configs3",
    "peers1",
    "peers2",
    "ladder1",
    "ladder2",
    "ladder3",
    "w5a",
    "w5b",
    "w6a",
    "w6b",
)


def dry_run(phase: str, out: Path) -> list[str]:
    """The commands ``phase`` runs, as DRY_RUN=1 prints them."""
    proc = subprocess.run(
        ["bash", str(SCRIPT), phase, str(out)],
        env={**os.environ, "DRY_RUN": "1", "LIMIT": "570"},
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return [ln[2:] for ln in proc.stdout.splitlines() if ln.startswith("+ ")]


def bench_rows(commands: list[str]) -> list[tuple[str, str, bool]]:
    """(workload, kind, paired) of every row the benchmark commands measure, each command
    parsed by offload_bench.parse_args."""
    rows = []
    for command in commands:
        argv = shlex.split(command)
        if not argv[1].endswith("offload_bench.py"):
            continue
        args = parse_args(argv[2:])
        assert args.summary is None and args.time_limit_s is not None
        rows += [(w, k, bool(args.pair_full_gpu)) for w in args.workloads for k in args.kinds]
    return rows


def test_the_script_parses() -> None:
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True, timeout=30)


def test_the_bench_phases_measure_the_reports_rows_and_the_defaults(tmp_path: Path) -> None:
    rows: list[tuple[str, str, bool]] = []
    for phase in PHASES:
        commands = dry_run(phase, tmp_path / phase)
        # Each phase ends with the results table and the targets over its folder.
        assert commands[-2:] == [
            f"python3 {SCRIPT.parent / 'targets.py'} --table {tmp_path / phase}",
            f"python3 {SCRIPT.parent / 'targets.py'} {tmp_path / phase}",
        ]
        rows += bench_rows(commands)
    # Every report row once.
    report = [(w, k) for w, kinds in REPORT_KINDS.items() for k in kinds]
    assert sorted((w, k) for w, k, _ in rows) == sorted(report)
    # W1's row of ours also steps full-GPU training in turn; no other workload's does.
    assert {w for w, _, paired in rows if paired} == {"W1"}


def test_the_tests_phase_runs_the_gpu_session_of_nox(tmp_path: Path) -> None:
    (command,) = dry_run("tests", tmp_path)
    assert command.startswith(
        f"python3 -m nox -f {SCRIPT.parent.parent / 'noxfile.py'} -s gpu_tests"
    )


def test_all_runs_the_tests_then_every_bench_phase(tmp_path: Path) -> None:
    commands = dry_run("all", tmp_path)
    assert "-s gpu_tests" in commands[0]
    assert len(bench_rows(commands)) == len(bench_rows(dry_run("bench", tmp_path))) == 43


def test_an_unknown_phase_is_refused(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["bash", str(SCRIPT), "w3", str(tmp_path)], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode == 2
    assert "unknown phase w3" in proc.stderr


@pytest.mark.parametrize("phase", PHASES)
def test_a_bench_phase_passes_what_is_left_of_its_limit(phase: str, tmp_path: Path) -> None:
    for command in dry_run(phase, tmp_path):
        if "offload_bench.py" in command:
            args = parse_args(shlex.split(command)[2:])
            assert 0 < args.time_limit_s <= 570
            assert args.out == tmp_path


def test_the_w6_phases_run_the_defaults_and_the_checkpointing_peers(tmp_path: Path) -> None:
    assert bench_rows(dry_run("w6a", tmp_path)) == [
        ("W6a", kind, False) for kind in ("ours", "fsdp2_ckpt", "fsdp2_ckpt_host", "full_gpu_ckpt")
    ]
    assert bench_rows(dry_run("w6b", tmp_path)) == [
        ("W6b", kind, False) for kind in ("ours", "fsdp2_ckpt", "fsdp2_ckpt_host")
    ]
