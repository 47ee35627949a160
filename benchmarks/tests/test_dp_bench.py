"""dp_bench.py on the CPU: ours over gloo at the tiny workload on 1 and 2 ranks, and the
table the report is made from (the same code as on GPUs but for the device and the
backend)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import dp_bench

SCRIPT = Path(dp_bench.__file__)


def _launch(out: Path, ranks: int) -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo"}
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={ranks}",
        str(SCRIPT),
        "--device",
        "cpu",
        "--workload",
        "T",
        "--warmup",
        "1",
        "--steps",
        "5",
        "--out",
        str(out),
    ]
    proc = subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_rows_on_one_and_two_ranks_and_their_table(tmp_path: Path) -> None:
    for ranks in (1, 2):
        _launch(tmp_path, ranks)
    row = json.loads((tmp_path / "T_ours_x2.json").read_text())
    assert row["world"] == 2 and len(row["ranks"]) == 2
    assert row["step_ms"] == max(r["step_ms"] for r in row["ranks"])
    assert row["samples_per_s"] == 2 * dp_bench.TINY[1] / (row["step_ms"] / 1e3)
    assert row["command"].startswith("torchrun --standalone --nproc_per_node=2 ")
    for key in ("date", "commit", "gpu", "torch"):
        assert row[key]
    # The ranks own disjoint host-state regions; one process owns none (no sharding).
    owned = [set(r["owned_regions"]) for r in row["ranks"]]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    one = json.loads((tmp_path / "T_ours_x1.json").read_text())
    assert one["ranks"][0]["owned_regions"] is None
    lines = dp_bench.table(tmp_path).splitlines()
    assert len(lines) == 4
    efficiency = one["samples_per_s"] and row["samples_per_s"] / (2 * one["samples_per_s"])
    assert lines[3].startswith("| T | 2 | ours |")
    assert f"| {efficiency:.2f} |" in lines[3]
