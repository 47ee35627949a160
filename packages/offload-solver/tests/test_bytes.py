"""Sizes from the command line (``parse_bytes``) and byte counts from callers
(``as_bytes``): every value that is no finite, non-negative size is a named error."""

from __future__ import annotations

from decimal import Decimal
from fractions import Fraction
from typing import Any

import pytest

from offload_solver import as_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "size"),
    [("16GiB", 16 * 2**30), ("16GB", 16 * 10**9), ("512 MiB", 512 * 2**20), ("1000", 1000)],
)
def test_sizes_parse_in_decimal_and_binary_units(text: str, size: int) -> None:
    assert parse_bytes(text) == size


@pytest.mark.parametrize("text", ["nanGiB", "infGB", "-5GiB", "lots", "16XB", ""])
def test_a_size_that_is_no_finite_non_negative_number_is_named(text: str) -> None:
    with pytest.raises(ValueError, match="size"):
        parse_bytes(text)


class Index:
    """An integer-like object (as numpy's integers are): ``__index__`` only."""

    def __index__(self) -> int:
        return 4096


@pytest.mark.parametrize(
    ("value", "count"),
    [
        (2**30, 2**30),
        (1.5e9, 1_500_000_000),
        (1024.9, 1024),
        (Index(), 4096),
        (Fraction(3, 2) * 2**20, 3 * 2**19),
        (Decimal("2048.7"), 2048),
    ],
)
def test_byte_counts_take_any_integer_like_or_finite_real_rounded_down(
    value: Any, count: int
) -> None:
    assert as_bytes(value) == count


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (float("nan"), "finite"),
        (float("-inf"), "finite"),
        (0, "positive"),
        (-3, "positive"),
        (0.25, "positive"),
        ("1GiB", "number of bytes"),
        (b"1", "number of bytes"),
        (True, "number of bytes"),
        (None, "number of bytes"),
        ([1], "number of bytes"),
    ],
)
def test_a_byte_count_that_is_no_positive_finite_number_names_what(value: Any, match: str) -> None:
    with pytest.raises(ValueError, match=f"budget_bytes.*{match}"):
        as_bytes(value, "budget_bytes")
