"""``attention_rates.py``: each workload's attention shape from its traced graph, and its
rates measured there (on the CPU here)."""

from __future__ import annotations

import json
from pathlib import Path

from attention_rates import attention_shape, main

from offload_runtime import AttentionShape


def test_w1_attention_shape_comes_from_the_graph() -> None:
    # gpt2_medium at 64 x 8: 16 heads of 64 in each of 24 layers; offload_bench trains
    # with dropout 0.1.
    assert attention_shape("W1") == AttentionShape(64, 16, 8, 64, 0.1, calls=24)


def test_rates_are_written_per_workload(tmp_path: Path) -> None:
    out = tmp_path / "rates.json"
    assert main(["--workloads", "W1", "--device", "cpu", "--reps", "1", "--json", str(out)]) == 0
    rates = json.loads(out.read_text())["W1"]
    assert (rates["heads"], rates["head_dim"]) == (16, 64)
    assert rates["fwd_flop_per_s"] > 0 and rates["bwd_flop_per_s"] > 0
