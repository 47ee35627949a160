"""The optimizer's host step rates and cost ratios are read by the runtime's one host step
timer (``offload_runtime.hardware.measure_host_step``), as the hardware profile's fused
Adam rate is: under a fake clock in that timer, every number here is known exactly."""

from __future__ import annotations

import types

import pytest
import torch

from offload_optim import (
    measure_host_step_cost,
    measure_host_step_params_per_s,
    measure_speculative_step_cost,
)
from offload_runtime.hardware import host_step, measure_host_adam_params_per_s
from offload_runtime.host_kernels import single_pass

NUMEL = 1 << 12
KINDS = [("torch", False)]
"""(host_kernel, fp16_io) of every kind of host step this machine can run."""
if single_pass.available():
    KINDS.append(("single_pass", False))
if single_pass.fp16_io_available():
    KINDS.append(("single_pass", True))


class FakeClock:
    """``time.perf_counter`` and ``time.sleep`` for the runtime's timer: each timed step
    (a pair of clock reads) takes the next of ``durations_s``; sleeps are recorded."""

    def __init__(self) -> None:
        self.durations_s: list[float] = []
        self.now = 0.0
        self.timing = False
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        if self.timing:
            self.now += self.durations_s.pop(0)
        self.timing = not self.timing
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock()
    namespace = types.SimpleNamespace(perf_counter=fake.perf_counter, sleep=fake.sleep)
    monkeypatch.setattr(host_step, "time", namespace)
    return fake


@pytest.mark.parametrize(("kernel", "io"), KINDS)
@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("speculative", [False, True])
def test_a_kernels_rate_is_the_median_of_its_timed_steps(
    clock: FakeClock, kernel: str, io: bool, moments: torch.dtype, speculative: bool
) -> None:
    clock.durations_s = [3e-3, 1e-3, 2e-3]
    rate = measure_host_step_params_per_s(
        moments, NUMEL, steps=3, host_kernel=kernel, speculative=speculative, fp16_io=io
    )
    assert rate == pytest.approx(NUMEL / 2e-3, rel=1e-9)
    assert not clock.durations_s and not clock.sleeps


def test_the_profile_and_the_optimizer_read_the_same_timer(clock: FakeClock) -> None:
    # The same step times give the profile's fused Adam rate and the optimizer's fused
    # fp32 rate: no second timer with its own method stands between them.
    clock.durations_s = [4e-3, 5e-3, 3e-3] * 2
    profile_rate = measure_host_adam_params_per_s(NUMEL, steps=3, settle_s=0.0)
    optim_rate = measure_host_step_params_per_s(torch.float32, NUMEL, steps=3)
    assert profile_rate == pytest.approx(optim_rate, rel=1e-9)
    assert optim_rate == pytest.approx(NUMEL / 4e-3, rel=1e-9)


@pytest.mark.parametrize(("kernel", "io"), KINDS)
def test_host_step_cost_alternates_which_kind_goes_first(
    clock: FakeClock, kernel: str, io: bool
) -> None:
    # The kind's steps take 2 ms and the fused fp32 steps 1 ms, in the order the pairs
    # run: kind then fused, then fused then kind. Any other order would mix the two.
    kind, fused = [2e-3] * 3, [1e-3] * 3
    clock.durations_s = kind + fused + fused + kind
    cost = measure_host_step_cost(
        torch.bfloat16, NUMEL, host_kernel=kernel, fp16_io=io, pairs=2, gap_s=0.01
    )
    assert cost == pytest.approx(2.0, rel=1e-9)
    assert clock.sleeps == [0.01] * 4  # each half settles after its untimed step
    assert not clock.durations_s


@pytest.mark.parametrize(("kernel", "io"), KINDS)
def test_speculative_step_cost_is_the_speculative_over_the_plain_median(
    clock: FakeClock, kernel: str, io: bool
) -> None:
    clock.durations_s = [3e-3] * 3 + [2e-3] * 3
    cost = measure_speculative_step_cost(
        torch.float32, NUMEL, host_kernel=kernel, fp16_io=io, pairs=1
    )
    assert cost == pytest.approx(1.5, rel=1e-9)
    # Never below 1: a speculative step does all that a plain one does.
    clock.durations_s = [1e-3] * 3 + [2e-3] * 3
    assert (
        measure_speculative_step_cost(torch.float32, NUMEL, host_kernel=kernel, fp16_io=io, pairs=1)
        == 1.0
    )
