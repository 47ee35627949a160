"""gpu_session.sh sweep on the CPU: its phases run in turn into their own folders, a phase
whose estimate does not fit the call is skipped and said so, and targets.md is written
over every phase's rows.

The bench itself needs a GPU, so a ``python3`` placed first on PATH stands in for
``offload_bench.py`` (it copies a recorded row of the workload asked for to the --json
path) and hands every other script (pair_ratios.py, targets.py) to this interpreter. A
device call costs minutes; this catches a broken sweep before one is spent on it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_session.sh"
# Recorded rows of session 54 (every target met there but W2's prediction): W1 beside
# full GPU by fp32 masters, W4 with fp32 state beside FSDP2.
ROWS = {
    "W1": ROOT / "benchmarks" / "results" / "s54c2_W1_1.json",
    "W4": ROOT / "benchmarks" / "results" / "s54c2_W4_fsp.json",
}

SHIM = """#!/usr/bin/env bash
# Stands in for python3: offload_bench.py copies a recorded row; the rest run for real.
if [[ "${1:-}" == */offload_bench.py ]]; then
  shift
  workload="" json=""
  while (($#)); do
    case "$1" in
      --workloads) workload=$2; shift ;;
      --json) json=$2; shift ;;
    esac
    shift
  done
  echo "$workload" >> "$FAKE_BENCH_CALLS"
  echo "[bench] $workload (recorded row)"
  cp "$FAKE_ROWS/$workload.json" "$json"
  exit 0
fi
exec "$REAL_PYTHON" "$@"
"""


def _sweep(tmp_path: Path, phases: str, limit_s: int) -> tuple[Path, list[str]]:
    """Run ``gpu_session.sh sweep`` over ``phases`` with ``SWEEP_LIMIT=limit_s`` into a
    fresh folder; returns the folder and the workloads the bench was asked for."""
    bin_dir, rows, out = tmp_path / "bin", tmp_path / "rows", tmp_path / "out"
    for d in (bin_dir, rows):
        d.mkdir()
    for workload, row in ROWS.items():
        shutil.copy(row, rows / f"{workload}.json")
    shim = bin_dir / "python3"
    shim.write_text(SHIM)
    shim.chmod(0o755)
    calls = tmp_path / "calls.txt"
    calls.touch()
    env = {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
        "REAL_PYTHON": sys.executable,
        "FAKE_ROWS": str(rows),
        "FAKE_BENCH_CALLS": str(calls),
        "SWEEP": phases,
        "SWEEP_LIMIT": str(limit_s),
        "BENCH_COMMIT": "test",
    }
    env.pop("ROUNDS", None)
    proc = subprocess.run(
        ["bash", str(SCRIPT), "sweep", str(out)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out, calls.read_text().split()


@pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_session.sh is a bash script")
def test_sweep_runs_each_phase_into_its_folder_then_targets_over_all(tmp_path: Path) -> None:
    out, calls = _sweep(tmp_path, "w1p w4fsp", 570)
    # ROUNDS=1 in a sweep: w1p asks for one W1 row, w4fsp for one W4 row, in that order.
    assert calls == ["W1", "W4"]
    assert (out / "w1p" / "W1_1.json").is_file()
    assert (out / "w4fsp" / "W4_fsp.json").is_file()
    assert "W1" in (out / "w1p" / "w1_ratios.txt").read_text()
    sweep_log = (out / "sweep.txt").read_text().splitlines()
    assert [line.split(":")[0] for line in sweep_log] == ["[sweep] w1p", "[sweep] w4fsp"]
    assert all(": exit 0 at " in line for line in sweep_log)
    assert (out / "w1p.log").is_file() and (out / "w4fsp.log").is_file()
    # targets.md reads the rows of both phases: W1 beside full GPU and W4 beside FSDP2.
    targets = (out / "targets.md").read_text()
    w1_line = next(line for line in targets.splitlines() if line.startswith("| W1 <= 1.05x"))
    assert "w1p/W1_1" not in w1_line and "W1_1 ours" in w1_line and w1_line.endswith("| met |")
    w4_line = next(line for line in targets.splitlines() if "W4 fp32 state <= 0.55x" in line)
    assert "W4_fsp ours_io_spec1_stream" in w4_line and w4_line.endswith("| met |")


@pytest.mark.skipif(shutil.which("bash") is None, reason="gpu_session.sh is a bash script")
def test_sweep_skips_a_phase_whose_estimate_does_not_fit(tmp_path: Path) -> None:
    # 200 s: w1p (estimated 120 s) fits, w4fsp (300 s) does not once w1p has run.
    out, calls = _sweep(tmp_path, "w1p w4fsp", 200)
    assert calls == ["W1"]
    assert not (out / "w4fsp").exists()
    sweep_log = (out / "sweep.txt").read_text().splitlines()
    assert sweep_log[0].startswith("[sweep] w1p: exit 0 at ")
    assert sweep_log[1].startswith("[sweep] w4fsp skipped: ")
    assert sweep_log[1].endswith("about 300 s needed")
    assert (
        "W4 fp32 state <= 0.55x FSDP2 | no rows | not measured |"
        in (out / "targets.md").read_text()
    )
