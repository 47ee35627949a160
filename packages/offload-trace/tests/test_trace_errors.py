"""Bad arguments get a ValueError naming them; untraceable models get a TraceError."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from trace_helpers import ThreeWayTied

from offload_trace import TraceError, trace
from offload_trace._inputs import check_example_inputs


def test_example_inputs_of_the_wrong_type_are_named() -> None:
    model = ThreeWayTied()
    with pytest.raises(ValueError, match="example_inputs is a list"):
        trace(model, [torch.randn(4, 16)], target_device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"example_inputs\[1\] is a int"):
        trace(model, (torch.randn(4, 16), 3), target_device="cpu")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"example_inputs\['x'\] is a list"):
        trace(model, {"x": [1.0]}, target_device="cpu")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="non-string key 0"):
        trace(model, {0: torch.randn(4, 16)}, target_device="cpu")  # type: ignore[dict-item]


def test_an_input_on_an_unexpected_device_is_named() -> None:
    # This machine may only have a CPU, so check the rule itself: the CPU is not among
    # the devices allowed here.
    with pytest.raises(ValueError, match=r"example_inputs\['ids'\] is on cpu"):
        check_example_inputs(
            {"ids": torch.zeros(2, 3, dtype=torch.long)},
            dtype=torch.float16,
            allowed_devices={torch.device("cuda", 0)},
        )
    # Meta inputs are always accepted and keep integer dtypes.
    meta = check_example_inputs(
        (torch.zeros(2, 3, dtype=torch.long, device="meta"), torch.ones(2, 3)),
        dtype=torch.bfloat16,
        allowed_devices={torch.device("cpu")},
    )
    assert [t.dtype for t in meta.args] == [torch.long, torch.bfloat16]
    assert all(t.device.type == "meta" for t in meta.args)


def test_bad_model_dtype_and_device_arguments_are_named() -> None:
    x = (torch.randn(4, 16),)
    with pytest.raises(ValueError, match="model is a builtin_function_or_method"):
        trace(torch.relu, x)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"dtype torch\.int64 is not a floating-point"):
        trace(ThreeWayTied(), x, dtype=torch.int64)
    with pytest.raises(ValueError, match="target_device is 'meta'"):
        trace(ThreeWayTied(), x, target_device="meta")
    with pytest.raises(ValueError, match="target_device 'gpu0' is not a torch device"):
        trace(ThreeWayTied(), x, target_device="gpu0")


class _BranchOnData(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.proj(x)
        if y.sum() > 0:  # reads an activation's value: cannot be traced on meta
            return y
        return -y


def test_an_untraceable_root_names_module_line_cause_and_remedy() -> None:
    # A submodule export cannot capture runs as an opaque operation (test_opaque.py); the
    # root's own code has nothing around it to do that.
    with pytest.raises(TraceError) as info:
        trace(_BranchOnData(), (torch.randn(2, 4),), target_device="cpu")
    message = str(info.value)
    assert "module <root> (_BranchOnData)" in message
    assert "if y.sum() > 0" in message
    assert "Cause:" in message
    assert "torch.where" in message
    assert isinstance(info.value, RuntimeError)


def test_tracing_leaves_the_callers_model_untouched() -> None:
    model = ThreeWayTied()
    model.eval()
    before = {n: (p, p.device, p.dtype) for n, p in model.named_parameters()}
    trace(model, (torch.randn(4, 16),), dtype=torch.float16, target_device="cpu")
    assert not model.training
    for n, p in model.named_parameters():
        assert before[n] == (p, p.device, p.dtype)
    assert model.first.weight is model.third.weight


class _Boxed:
    def __init__(self, value: torch.Tensor) -> None:
        self.value = value


class _ReturnsAnObject(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> _Boxed:
        return _Boxed(self.proj(x))


def test_an_unflattenable_output_asks_for_plain_tensors() -> None:
    with pytest.raises(TraceError, match="return plain tensors"):
        trace(_ReturnsAnObject(), (torch.randn(2, 4),), target_device="cpu")
