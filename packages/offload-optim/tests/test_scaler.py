"""The dynamic loss scale's update rule."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from offload_optim import DynamicLossScaler


def test_hysteresis_then_backoff_then_growth_resets_it() -> None:
    s = DynamicLossScaler(initial_scale=2.0**16, growth_interval=3, hysteresis=2)
    s.update(True)
    assert s.scale == 2.0**16, "first overflow: skip only"
    s.update(False)
    s.update(True)
    assert s.scale == 2.0**15, "second overflow since the last growth: back off"
    s.update(True)
    assert s.scale == 2.0**14, "every further one backs off too"
    for _ in range(3):
        s.update(False)
    assert s.scale == 2.0**15, "three good steps grow the scale"
    s.update(True)
    assert s.scale == 2.0**15, "growth re-arms the hysteresis"


def test_growth_needs_consecutive_good_steps() -> None:
    s = DynamicLossScaler(initial_scale=4.0, growth_interval=2, hysteresis=5)
    s.update(False)
    s.update(True)
    s.update(False)
    assert s.scale == 4.0
    s.update(False)
    assert s.scale == 8.0


@given(st.lists(st.booleans(), max_size=60), st.integers(1, 3), st.integers(1, 4))
def test_scale_stays_a_power_of_two_within_bounds(
    overflows: list[bool], hysteresis: int, interval: int
) -> None:
    s = DynamicLossScaler(
        initial_scale=2.0**4,
        growth_interval=interval,
        hysteresis=hysteresis,
        min_scale=1.0,
        max_scale=2.0**8,
    )
    for overflow in overflows:
        s.update(overflow)
        assert 1.0 <= s.scale <= 2.0**8
        assert math.log2(s.scale).is_integer()


def test_state_round_trip() -> None:
    a = DynamicLossScaler(growth_interval=2)
    for overflow in (True, False, True, True, False):
        a.update(overflow)
    b = DynamicLossScaler()
    b.load_state_dict(a.state_dict())
    for overflow in (False, False, True, False):
        a.update(overflow)
        b.update(overflow)
        assert a.scale == b.scale


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"initial_scale": 0.5}, "initial_scale"),
        ({"growth_factor": 1.0}, "growth_factor"),
        ({"backoff_factor": 1.0}, "backoff_factor"),
        ({"hysteresis": 0}, "hysteresis"),
        ({"growth_interval": 0}, "growth_interval"),
        ({"min_scale": 0.0}, "min_scale"),
    ],
)
def test_bad_settings_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DynamicLossScaler(**kwargs)  # type: ignore[arg-type]
