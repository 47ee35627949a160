"""The inputs a module was planned for, checked where a wrong one would otherwise fail deep
inside the rewritten graph.

The traced graph fixes each input tensor's shape and dtype (``torch.export`` guards them),
and floating inputs run in the training dtype. :func:`input_spec` records them when the
model is planned; :meth:`InputSpec.check_dtype` refuses floating inputs of another dtype
then, and :meth:`InputSpec.check_call` refuses a call whose tensors differ from the traced
ones, naming the traced shape and how to plan for another.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

REPLAN = (
    "shapes and dtypes are fixed when a model is planned: plan again with "
    "memory_optimize(model, inputs of the new shape, budget) for another shape"
)


@dataclass(frozen=True)
class InputTensor:
    """One input tensor as traced: its name (a keyword) or position, shape and dtype."""

    key: str | int
    shape: tuple[int, ...]
    dtype: torch.dtype

    def describe(self) -> str:
        where = f"input {self.key!r}" if isinstance(self.key, str) else f"input {self.key}"
        return f"{where} of shape {self.shape} and dtype {self.dtype}"


@dataclass(frozen=True)
class InputSpec:
    """The input tensors a module was traced with (non-tensor inputs are not recorded)."""

    tensors: tuple[InputTensor, ...]
    """By keyword (a ``str`` key) or position (an ``int`` key)."""

    def check_dtype(self, dtype: torch.dtype) -> None:
        """Refuse floating inputs in another dtype than the training ``dtype``: the graph
        runs them in ``dtype``, and a module would fail on them at the first product."""
        for t in self.tensors:
            if t.dtype.is_floating_point and t.dtype != dtype:
                raise ValueError(
                    f"{t.describe()} is not in the training dtype {dtype} "
                    "(OffloadConfig.dtype): pass floating inputs in that dtype, e.g. "
                    f"x.to({dtype})"
                )

    def check_call(self, args: tuple[Any, ...], kwargs: Mapping[str, Any]) -> None:
        """Refuse a call whose tensors differ in shape or dtype from the traced ones, or
        lack one of them, with the traced input named."""
        for t in self.tensors:
            if isinstance(t.key, str):
                given = kwargs.get(t.key)
                missing = t.key not in kwargs
            else:
                given = args[t.key] if t.key < len(args) else None
                missing = t.key >= len(args)
            if missing:
                raise ValueError(f"the module was planned with {t.describe()}, not given here")
            if not isinstance(given, torch.Tensor):
                raise ValueError(
                    f"the module was planned with {t.describe()}; got {type(given).__name__}"
                )
            if tuple(given.shape) != t.shape or given.dtype != t.dtype:
                raise ValueError(
                    f"the module was planned with {t.describe()}; got shape "
                    f"{tuple(given.shape)} and dtype {given.dtype}: {REPLAN}"
                )


def input_spec(inputs: Mapping[str, Any] | tuple[Any, ...]) -> InputSpec:
    """The tensors of ``inputs`` (a mapping of keyword inputs or a tuple of positional
    ones, as ``memory_optimize`` takes them)."""
    if isinstance(inputs, Mapping):
        items: list[tuple[str | int, Any]] = [(str(k), v) for k, v in inputs.items()]
    else:
        items = list(enumerate(inputs))
    return InputSpec(
        tensors=tuple(
            InputTensor(key, tuple(int(d) for d in v.shape), v.dtype)
            for key, v in items
            if isinstance(v, torch.Tensor)
        )
    )


__all__ = ["InputSpec", "InputTensor", "input_spec"]


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``value``, a tensor or tuples, lists and mappings of them (a
    forward's result); anything else is skipped."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from tensors_in(item)
    elif isinstance(value, (tuple, list)):
        for item in value:
            yield from tensors_in(item)
