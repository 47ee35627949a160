"""offload_bench.py's settings read from the environment (no GPU)."""

from __future__ import annotations

import pytest
from offload_bench import WORKLOADS, bench_budget_gib


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
