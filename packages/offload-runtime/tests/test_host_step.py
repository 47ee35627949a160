"""The one timer of host optimizer steps: what it calls, in what order, and what it reads.

Every time here is read from a fake clock, so the numbers are the same on any machine (up
to the rounding of the clock's float arithmetic).
"""

from __future__ import annotations

import types

import pytest
import torch

from offload_runtime.hardware import host_step, measure_host_adam_params_per_s, measure_host_step


class FakeClock:
    """``time.perf_counter`` and ``time.sleep`` for :mod:`host_step`: each timed call
    (a pair of clock reads) takes the next of ``durations_s``; a sleep advances the clock.
    ``events`` records the sleeps and, through :meth:`step`, the steps, in order."""

    def __init__(self, durations_s: list[float]) -> None:
        self.durations_s = list(durations_s)
        self.now = 0.0
        self.timing = False
        self.events: list[tuple[str, float]] = []

    def perf_counter(self) -> float:
        if self.timing:
            self.now += self.durations_s.pop(0)
        self.timing = not self.timing
        return self.now

    def sleep(self, seconds: float) -> None:
        self.events.append(("sleep", seconds))
        self.now += seconds

    def step(self, count: int) -> None:
        self.events.append(("step", count))


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    fake = FakeClock([])
    namespace = types.SimpleNamespace(perf_counter=fake.perf_counter, sleep=fake.sleep)
    monkeypatch.setattr(host_step, "time", namespace)
    return fake


def test_one_untimed_step_then_the_settle_then_the_median_of_the_timed_steps(
    clock: FakeClock,
) -> None:
    clock.durations_s = [3e-3, 1e-3, 2e-3]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        timing = measure_host_step(clock.step, 4096, steps=3, settle_s=0.5)
    finally:
        torch.set_num_threads(threads)
    assert clock.events == [("step", 1), ("sleep", 0.5), ("step", 2), ("step", 3), ("step", 4)]
    assert (timing.numel, timing.threads) == (4096, 1)
    assert timing.samples_s == pytest.approx((3e-3, 1e-3, 2e-3), rel=1e-9)
    assert timing.median_s == pytest.approx(2e-3, rel=1e-9)
    assert timing.params_per_s == pytest.approx(4096 / 2e-3, rel=1e-9)
    assert not clock.durations_s  # every timed call read the clock twice, no more


def test_no_settle_means_no_sleep(clock: FakeClock) -> None:
    clock.durations_s = [5e-3]
    timing = measure_host_step(clock.step, 10, steps=1)
    assert clock.events == [("step", 1), ("step", 2)]
    assert timing.samples_s == pytest.approx((5e-3,), rel=1e-9)


def test_the_profiles_host_adam_rate_is_the_timer_over_torchs_fused_adam(
    clock: FakeClock,
) -> None:
    # Five timed fused steps after one untimed one and the settle: the median's rate.
    clock.durations_s = [4e-3, 9e-3, 2e-3, 4e-3, 5e-3]
    rate = measure_host_adam_params_per_s(1 << 12, steps=5, settle_s=0.25)
    assert rate == pytest.approx((1 << 12) / 4e-3, rel=1e-9)
    assert clock.events == [("sleep", 0.25)]
    assert not clock.durations_s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"numel": 0}, "numel"),
        ({"steps": 0}, "steps"),
        ({"settle_s": -1.0}, "settle_s"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, float], match: str) -> None:
    args: dict[str, float] = {"numel": 16, "steps": 1, "settle_s": 0.0, **kwargs}
    calls: list[int] = []
    with pytest.raises(ValueError, match=match):
        measure_host_step(
            calls.append, int(args["numel"]), steps=int(args["steps"]), settle_s=args["settle_s"]
        )
    assert not calls  # rejected before any step runs


def test_every_host_step_is_timed_by_the_timer_and_the_fused_rate_is_not_timed_again(
    clock: FakeClock,
) -> None:
    """``measure_host_step_rates`` times each configuration's own step (one untimed step,
    the settle, the median of the timed ones) and records torch's fused fp32 plain step at
    the rate it is given: the profile's host Adam rate, read once."""
    configurations = [
        ("torch", "fp32", False, False),
        ("torch", "fp32", False, True),
        ("torch", "bf16_moments", False, False),
    ]
    # Two configurations timed, three timed steps each: medians 2 ms and 4 ms.
    clock.durations_s = [1e-3, 2e-3, 3e-3, 4e-3, 8e-3, 1e-3]
    rates = host_step.measure_host_step_rates(
        4096, 5e9, steps=3, settle_s=0.5, configurations=configurations
    )
    assert [r.key for r in rates] == configurations
    assert rates[0].params_per_s == 5e9
    assert rates[1].params_per_s == pytest.approx(4096 / 2e-3, rel=1e-9)
    assert rates[2].params_per_s == pytest.approx(4096 / 4e-3, rel=1e-9)
    assert all(r.threads == torch.get_num_threads() for r in rates)
    assert clock.events == [("sleep", 0.5), ("sleep", 0.5)]
    assert not clock.durations_s


def test_the_configurations_are_those_the_optimizer_can_run_here(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch's kernels everywhere (fp32 and bf16 moments, plain and speculative); the
    single-pass ones only where numba loads, with fp16 I/O only where its conversions
    compile; the three bf16-master rungs, plain, with the one family the planner runs
    them with."""
    from offload_runtime.host_kernels import single_pass

    bf16_master = {"bf16_stochastic", "bf16_8bit", "bf16_nearest"}
    monkeypatch.setattr(single_pass, "available", lambda: False)
    found = host_step.host_step_configurations()
    assert {c[0] for c in found} == {"torch"}
    assert len(found) == 4 + 3
    assert {c[1] for c in found[4:]} == bf16_master
    monkeypatch.setattr(single_pass, "available", lambda: True)
    monkeypatch.setattr(single_pass, "fp16_io_available", lambda: False)
    found = host_step.host_step_configurations()
    assert len(found) == 8 + 3
    assert not any(io for _, _, io, _ in found)
    assert [c for c in found if c[1] in bf16_master] == [
        ("single_pass", s, False, False) for s in ("bf16_stochastic", "bf16_8bit", "bf16_nearest")
    ]
    monkeypatch.setattr(single_pass, "fp16_io_available", lambda: True)
    assert len(host_step.host_step_configurations()) == 12 + 3


def test_every_configuration_here_has_a_step_the_timer_can_time() -> None:
    """Each kernel configuration the optimizer can run here is built and timed over a few
    thousand parameters; what it reads is this machine's and is not checked, only that it
    is a rate; bad configurations are named."""
    rates = host_step.measure_host_step_rates(4096, 1e9, steps=1, settle_s=0.0)
    assert [r.key for r in rates] == host_step.host_step_configurations()
    assert all(r.params_per_s > 0 for r in rates)
    with pytest.raises(ValueError, match="host_kernel must be"):
        host_step.kernel_steps(torch.float32, 16, "numba")
    with pytest.raises(ValueError, match="moments_dtype"):
        host_step.kernel_steps(torch.float16, 16, "torch")
    with pytest.raises(ValueError, match="numel"):
        host_step.kernel_steps(torch.float32, 0, "torch")
    with pytest.raises(ValueError, match="single-pass"):
        host_step.kernel_steps(torch.float32, 16, "torch", fp16_io=True)
