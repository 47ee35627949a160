"""Bad input is one clear error at the boundary: budgets of any integer-like or finite real
number, and the input tensors a module was planned for, checked when it is planned and
when it is called (before anything runs inside the rewritten graph)."""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
import torch
from tiny_models import inputs, tiny_gpt2

from offload_runtime import OffloadConfig, default_cpu_profile, memory_optimize, plan

FP32 = OffloadConfig(dtype=torch.float32, fuse_gelu=False)
KW: dict[str, Any] = {"config": FP32, "device": "cpu", "progress": False}


@pytest.mark.parametrize(
    "budget", [2**30, float(2**30), 1.07e9, np.int64(2**30), np.float32(1e9), Fraction(2**31, 2)]
)
def test_any_integer_like_or_finite_real_budget_is_bytes_rounded_down(budget: Any) -> None:
    found = plan(tiny_gpt2(), inputs(), budget, hardware=default_cpu_profile(), **KW)
    assert found.budget_bytes == int(budget) and isinstance(found.budget_bytes, int)


@pytest.mark.parametrize(
    ("budget", "match"),
    [
        (float("nan"), "finite"),
        (float("inf"), "finite"),
        (0, "positive"),
        (-1.5e9, "positive"),
        (0.5, "positive"),
        ("16GB", "number of bytes"),
        (True, "number of bytes"),
        (None, "number of bytes"),
    ],
)
def test_a_budget_that_is_no_positive_finite_number_is_named(budget: Any, match: str) -> None:
    with pytest.raises(ValueError, match=f"memory_budget.*{match}"):
        plan(tiny_gpt2(), inputs(), budget, hardware=default_cpu_profile(), **KW)


def test_floating_inputs_in_another_dtype_are_refused_when_planned() -> None:
    class Linear(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.proj(x)

    fp16 = OffloadConfig(dtype=torch.float16)
    with pytest.raises(ValueError, match=r"input 0 of shape \(4, 8\).*float32.*training dtype"):
        plan(Linear(), (torch.ones(4, 8),), 2**30, config=fp16, device="cpu", progress=False)
    with pytest.raises(ValueError, match="dict of keyword tensors or a tuple"):
        plan(Linear(), [torch.ones(4, 8)], 2**30, config=fp16, device="cpu", progress=False)  # type: ignore[arg-type]


def test_a_call_with_other_shapes_or_inputs_names_the_traced_ones() -> None:
    inp = inputs()
    module = memory_optimize(tiny_gpt2(), inp, 2**30, **KW)
    try:
        module(**inp)  # as planned
        traced = tuple(inp["input_ids"].shape)
        other = {**inp, "input_ids": inp["input_ids"][:1]}
        shape = re.escape(str(traced))
        with pytest.raises(ValueError, match=rf"'input_ids' of shape {shape}.*plan again"):
            module(**other)
        with pytest.raises(ValueError, match=r"'input_ids'.*dtype torch\.int32"):
            module(**{**inp, "input_ids": inp["input_ids"].int()})
        missing = {k: v for k, v in inp.items() if k != "input_ids"}
        with pytest.raises(ValueError, match=r"'input_ids'.*not given"):
            module(**missing)
    finally:
        module.close()
