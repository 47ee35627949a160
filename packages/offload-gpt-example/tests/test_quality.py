"""Each rung of the host-state ladder trains a small GPT-2 to within its tolerance of
fp32 AdamW (``offload_gpt_example.quality``; the curves: BENCHMARKS.md, "Host-state
precision")."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from offload_gpt_example import quality
from offload_solver import HOST_STATES


@pytest.fixture(scope="module")
def runs() -> dict[str, quality.Run]:
    return quality.train_all(300)


@pytest.mark.parametrize("rung", sorted(quality.TOLERANCE))
def test_rung_ends_within_its_tolerance_of_fp32_adamw(
    runs: dict[str, quality.Run], rung: str
) -> None:
    assert quality.excess(runs, rung) <= quality.TOLERANCE[rung], quality.summary(runs)


def test_every_run_learns_the_corpus(runs: dict[str, quality.Run]) -> None:
    for name, run in runs.items():
        assert math.isfinite(run.eval_loss), name
        assert run.losses[0] > 6.5, name  # ln(1024) at the start
        assert run.eval_loss < 0.3 * run.losses[0], name
        assert run.eval_loss > quality.entropy_nats(), name


def test_stochastic_rounding_beats_rounding_to_nearest(runs: dict[str, quality.Run]) -> None:
    """At this learning rate most late updates are below half a bf16 ulp of their weight:
    rounding to nearest drops them, stochastic rounding keeps them in expectation."""
    assert runs["bf16_stochastic"].eval_loss < runs["bf16_nearest"].eval_loss


def test_the_command_writes_its_curves_and_summary(tmp_path: Path) -> None:
    assert quality.main(["--steps", "3", "--out", str(tmp_path)]) == 0
    assert (tmp_path / "host_state_quality.png").stat().st_size > 0
    summary = json.loads((tmp_path / "host_state_quality.json").read_text())
    assert set(summary["runs"]) == {quality.REFERENCE, *HOST_STATES}
    assert summary["steps"] == 3
