"""The host step rates of a hardware profile: one per kernel configuration, read back from
JSON, and derived from the fused rate by the documented ratios where none was measured."""

from __future__ import annotations

import dataclasses

import pytest

from offload_solver import HardwareProfile, HostStepRate, default_hardware, default_host_step_rates
from offload_solver.host_rates import DEFAULT_HOST_STEP_TIMES


def test_a_profile_with_host_step_rates_reads_back_from_json() -> None:
    rates = (
        HostStepRate("torch", "fp32", False, False, 4e9, threads=16),
        HostStepRate("single_pass", "bf16_moments", True, True, 5.5e9, threads=16),
    )
    hw = dataclasses.replace(default_hardware(), host_step_rates=rates)
    back = HardwareProfile.from_json(hw.to_json())
    assert back == hw
    assert back.host_step_rates == rates


def test_a_profile_written_without_host_step_rates_reads_with_none() -> None:
    text = dataclasses.replace(default_hardware(), host_step_rates=()).to_json()
    assert '"host_step_rates": []' in text
    old = text.replace('"host_step_rates": [],', "").replace(',\n "host_step_rates": []', "")
    assert "host_step_rates" not in old
    assert HardwareProfile.from_json(old).host_step_rates == ()


def test_the_lookup_reads_a_measured_rate_and_derives_the_others() -> None:
    measured = HostStepRate("single_pass", "fp32", True, False, 7e9)
    hw = dataclasses.replace(
        default_hardware(), host_adam_params_per_s=4e9, host_step_rates=(measured,)
    )
    assert hw.host_step_params_per_s("single_pass", "fp32", True, False) == 7e9
    # Not measured: the fused rate over the documented time ratio.
    assert hw.host_step_params_per_s("single_pass", "bf16_moments") == pytest.approx(4e9 / 0.73)
    assert hw.host_step_params_per_s("torch", "fp32", speculative=True) == pytest.approx(4e9 / 2.53)
    # torch's fused fp32 step is the profile's reference rate, whatever a record says.
    fused = HostStepRate("torch", "fp32", False, False, 1e9)
    assert dataclasses.replace(hw, host_step_rates=(fused,)).host_step_params_per_s(
        "torch", "fp32"
    ) == pytest.approx(4e9)
    with pytest.raises(ValueError, match="fp16_io only with the single_pass kernel"):
        hw.host_step_params_per_s("torch", "fp32", fp16_io=True)


def test_the_default_rates_cover_every_configuration_at_the_documented_ratios() -> None:
    rates = default_host_step_rates(2e9)
    assert {r.key for r in rates} == set(DEFAULT_HOST_STEP_TIMES)
    for r in rates:
        assert r.params_per_s == pytest.approx(2e9 / DEFAULT_HOST_STEP_TIMES[r.key])
        assert r.threads == 0
    hw = default_hardware()
    assert {r.key for r in hw.host_step_rates} == set(DEFAULT_HOST_STEP_TIMES)
    assert hw.host_step_params_per_s("torch", "fp32") == hw.host_adam_params_per_s


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"kernel": "cuda"}, "kernel is 'cuda'"),
        ({"state": "fp16"}, "state is 'fp16'"),
        ({"fp16_io": True}, "single_pass kernel"),
        ({"params_per_s": 0.0}, "params_per_s is 0.0"),
        ({"params_per_s": float("inf")}, "params_per_s is inf"),
        ({"threads": -1}, "threads is -1"),
    ],
)
def test_a_bad_rate_is_named(kwargs: dict[str, object], match: str) -> None:
    args: dict[str, object] = {
        "kernel": "torch",
        "state": "fp32",
        "fp16_io": False,
        "speculative": False,
        "params_per_s": 1e9,
        **kwargs,
    }
    with pytest.raises(ValueError, match=match):
        HostStepRate(**args)  # type: ignore[arg-type]


def test_two_rates_of_one_configuration_are_refused() -> None:
    twice = (
        HostStepRate("torch", "bf16_moments", False, False, 1e9),
        HostStepRate("torch", "bf16_moments", False, False, 2e9),
    )
    with pytest.raises(ValueError, match="two rates of one configuration"):
        dataclasses.replace(default_hardware(), host_step_rates=twice)


def test_ranks_sharing_the_host_each_plan_with_their_share_of_it() -> None:
    hw = default_hardware()
    base = dataclasses.replace(
        hw, host_step_rates=default_host_step_rates(hw.host_adam_params_per_s)
    )
    assert base.shared_host(1) is base
    shared = base.shared_host(4)
    assert shared.host_memory_bytes_per_s == base.host_memory_bytes_per_s / 4
    assert shared.host_convert_elems_per_s == base.host_convert_elems_per_s / 4
    assert shared.host_memory_bytes == base.host_memory_bytes // 4
    # A quarter of the host state on a quarter of the host: the whole step's time.
    assert shared.host_adam_params_per_s == base.host_adam_params_per_s
    assert shared.host_step_rates == base.host_step_rates
    # The device and the copies are each rank's own.
    assert (shared.h2d, shared.d2h, shared.compute_flop_per_s) == (
        base.h2d,
        base.d2h,
        base.compute_flop_per_s,
    )
    assert HardwareProfile.from_json(shared.to_json()) == shared
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="ranks is"):
            base.shared_host(bad)  # type: ignore[arg-type]
