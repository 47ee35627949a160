"""Checking the caller's example inputs and turning them into meta tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MetaInputs:
    """Example inputs rebuilt on the meta device, in the structure the caller gave."""

    args: tuple[torch.Tensor, ...]
    kwargs: dict[str, torch.Tensor]

    def labelled(self) -> list[tuple[str, torch.Tensor]]:
        """Each tensor with the label that error messages use for it."""
        out = [(f"example_inputs[{i}]", t) for i, t in enumerate(self.args)]
        out += [(f"example_inputs[{k!r}]", t) for k, t in self.kwargs.items()]
        return out


def _label(key: int | str) -> str:
    return f"example_inputs[{key!r}]" if isinstance(key, str) else f"example_inputs[{key}]"


def check_example_inputs(
    example_inputs: object,
    *,
    dtype: torch.dtype,
    allowed_devices: set[torch.device],
) -> MetaInputs:
    """Validate ``example_inputs`` and return meta copies of its tensors.

    Floating-point inputs are cast to the training ``dtype`` (the model is traced in that
    dtype); integer and boolean inputs keep theirs. ``allowed_devices`` are the devices a
    real (non-meta) input may live on.

    Raises:
        ValueError: ``example_inputs`` is not a dict of tensors or a tuple of tensors, or a
            tensor is on a device outside ``allowed_devices``, or the real inputs are spread
            over several devices.
    """
    items: list[tuple[int | str, object]]
    if isinstance(example_inputs, Mapping):
        items = []
        for key, value in example_inputs.items():
            if not isinstance(key, str):
                raise ValueError(
                    f"example_inputs has a non-string key {key!r}; a dict of example inputs "
                    "must map keyword-argument names to tensors"
                )
            items.append((key, value))
    elif isinstance(example_inputs, tuple):
        items = list(enumerate(example_inputs))
    else:
        raise ValueError(
            f"example_inputs is a {type(example_inputs).__name__}; pass a dict of keyword "
            "tensors (e.g. {'input_ids': ids}) or a tuple of positional tensors"
        )
    real_device: tuple[str, torch.device] | None = None
    args: list[torch.Tensor] = []
    kwargs: dict[str, torch.Tensor] = {}
    for key, value in items:
        label = _label(key)
        if not isinstance(value, torch.Tensor):
            raise ValueError(
                f"{label} is a {type(value).__name__}, not a torch.Tensor; every example "
                "input must be a tensor (bind other arguments with functools.partial or a "
                "wrapper module)"
            )
        if value.device.type != "meta":
            if value.device not in allowed_devices:
                allowed = ", ".join(sorted({str(d) for d in allowed_devices} | {"meta"}))
                raise ValueError(
                    f"{label} is on {value.device}, which is neither the target device nor "
                    f"the model's device; move it to one of: {allowed}"
                )
            if real_device is not None and value.device != real_device[1]:
                raise ValueError(
                    f"{label} is on {value.device} but {real_device[0]} is on "
                    f"{real_device[1]}; put all example inputs on one device (or on meta)"
                )
            real_device = (label, value.device)
        meta_dtype = dtype if value.is_floating_point() else value.dtype
        meta = torch.empty(tuple(value.shape), dtype=meta_dtype, device="meta")
        if isinstance(key, str):
            kwargs[key] = meta
        else:
            args.append(meta)
    return MetaInputs(tuple(args), kwargs)
