"""offload_bench.interleaved_steps and pair_summary: two step functions taken in turn in
one process, on a fake clock (no GPU, no torch)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pair_ratios
import pytest
from offload_bench import interleaved_steps, pair_summary


class FakeHost:
    """A clock that each step advances by its cost times the host's slowness, which
    drifts: the drift a launch-bound row sees between two rows minutes apart."""

    def __init__(self) -> None:
        self.now = 0.0
        self.slowness = 1.0
        self.calls: list[str] = []
        self.syncs = 0

    def step(self, name: str, cost_s: float) -> Callable[[], None]:
        def run() -> None:
            self.calls.append(name)
            self.now += cost_s * self.slowness
            self.slowness *= 1.1  # the host slows down step after step

        return run

    def clock(self) -> float:
        return self.now

    def sync(self) -> None:
        self.syncs += 1


def test_steps_alternate_order_each_pair_and_warm_up_in_turn() -> None:
    host = FakeHost()
    a, b = host.step("a", 0.040), host.step("b", 0.040)
    ta, tb = interleaved_steps(a, b, warmup=2, pairs=4, sync=host.sync, clock=host.clock)
    assert host.calls == ["a", "b"] * 2 + ["a", "b", "b", "a", "a", "b", "b", "a"]
    assert len(ta) == len(tb) == 4
    assert host.syncs == 1 + 8  # after the warm-up, then after every timed step


def test_equal_programs_on_a_drifting_host_pair_to_a_ratio_near_one() -> None:
    # Timed one after the other, the second would look 1.1**pairs times slower; in turn,
    # with the order swapped each pair, the median pair ratio is within one step's drift.
    host = FakeHost()
    a, b = host.step("a", 0.040), host.step("b", 0.040)
    ta, tb = interleaved_steps(a, b, warmup=0, pairs=10, sync=host.sync, clock=host.clock)
    summary = pair_summary(ta, tb)
    assert summary["pairs"] == 10
    assert summary["pair_ratio_median"] == pytest.approx(1.0, abs=0.11)
    assert 0.9 < summary["run_ratio"] < 1.1


def test_pair_summary_reports_each_side_in_ms_and_their_ratios() -> None:
    ours = [0.030, 0.031, 0.032, 0.033, 0.034, 0.050]
    peer = [0.030, 0.030, 0.030, 0.030, 0.030, 0.030]
    s = pair_summary(ours, peer)
    assert s["ours_steps_ms"] == pytest.approx([30, 31, 32, 33, 34, 50])
    assert s["ours_step_ms"] == pytest.approx(32.0)  # mean of the 5 fastest
    assert s["peer_step_ms"] == pytest.approx(30.0)
    assert s["ratio"] == pytest.approx(32.0 / 30.0)
    assert s["run_ratio"] == pytest.approx((210 / 6) / 30.0)
    assert s["pair_ratio_median"] == pytest.approx((32 / 30 + 33 / 30) / 2)


def test_bad_input_is_a_named_error() -> None:
    with pytest.raises(ValueError, match="pairs=0"):
        interleaved_steps(lambda: None, lambda: None, 0, 0, lambda: None)
    with pytest.raises(ValueError, match="equal, non-empty"):
        pair_summary([0.1], [])


def test_pair_ratios_prints_rows_stepped_in_turn_beside_the_separate_rows(
    tmp_path: Path,
) -> None:
    paired = pair_summary([0.033] * 5, [0.030] * 5)
    ours = {"ok": True, "step_ms": 40.0, "step_mean_ms": 44.0, "paired_full_gpu": paired}
    full = {"ok": True, "step_ms": 29.0, "step_mean_ms": 31.0}
    path = tmp_path / "W1_1.json"
    path.write_text(json.dumps({"results": {"W1": {"ours": ours, "full_gpu": full}}}))
    lines = pair_ratios.report([path], "W1", "ours", "full_gpu")
    assert lines[0] == (
        "W1_1.json, in turn (5 pairs): ours 33.0 ms, full_gpu 30.0 ms: 1.100x "
        "(run 1.100x, median pair 1.100x)"
    )
    assert lines[1].endswith("1.379x (run 1.419x)")
    assert lines[-1] == "in turn, median over 1 rounds: 1.100x; range 1.100-1.100x"
