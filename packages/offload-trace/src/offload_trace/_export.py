"""Running ``torch.export`` on the meta twin, and turning its failures into TraceErrors."""

from __future__ import annotations

import traceback
from pathlib import Path
from typing import Any

import torch
from torch import nn

from offload_trace.errors import TraceError

# Frames inside these folders are library internals; the frame that names the user's
# operation is the last one outside them.
_LIBRARY_DIRS = (
    str(Path(torch.__file__).parent),
    str(Path(__file__).parent),
)
_DATA_DEPENDENT_MARKERS = (
    "data-dependent",
    "data dependent",
    "GuardOnDataDependentSymNode",
    ".item()",
    "meta tensors",
    "Cannot copy out of meta tensor",
    "tolist",
    "nonzero",
)


def _user_frame(exc: BaseException) -> str:
    """``file:line in func: code`` of the innermost frame outside torch and this package."""
    frames = traceback.extract_tb(exc.__traceback__)
    for frame in reversed(frames):
        if not frame.filename.startswith(_LIBRARY_DIRS):
            code = (frame.line or "").strip()
            return f"{frame.filename}:{frame.lineno} in {frame.name}: `{code}`"
    return "no frame outside torch"


def _hint(message: str) -> str:
    if any(marker in message for marker in _DATA_DEPENDENT_MARKERS):
        return (
            "the model reads tensor values in Python (control flow, .item(), .tolist() or a "
            "data-dependent shape), which cannot be traced on the meta device; rewrite that "
            "branch with torch.where / torch.cond, or pass the value in as a Python constant"
        )
    if "dynamic" in message.lower() or "Constraint" in message or "specializ" in message:
        return (
            "the model fixes the batch size in Python; trace with dynamic_batch=False, or "
            "use an example batch size other than 0 or 1"
        )
    return (
        "check that the model runs eagerly on inputs of these shapes and dtype; for Hugging "
        "Face models wrap them so that forward returns plain tensors (use_cache=False, "
        "return .logits)"
    )


def export_twin(
    twin: nn.Module,
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, torch.Tensor],
    *,
    model_name: str,
    dynamic_batch: bool,
) -> torch.export.ExportedProgram:
    """``torch.export.export(twin, args, kwargs, strict=False)`` with named failures.

    Raises:
        TraceError: export failed; the message names the innermost module being run, the
            user-code line, the cause and a remedy.
    """
    # A stack of the module paths being run, so a failure can name where it happened.
    # Non-strict export runs the Python forward, so plain hooks observe it.
    stack: list[str] = []
    handles = []
    for path, module in twin.named_modules():
        label = f"{path or '<root>'} ({type(module).__name__})"

        def push(_m: nn.Module, _a: Any, _label: str = label) -> None:
            stack.append(_label)

        def pop(_m: nn.Module, _a: Any, _o: Any) -> None:
            if stack:
                stack.pop()

        handles.append(module.register_forward_pre_hook(push))
        handles.append(module.register_forward_hook(pop))
    dynamic_shapes: Any = None
    if dynamic_batch:
        batch = torch.export.Dim("batch", min=1)
        dynamic_shapes = {
            "args": tuple({0: batch} if t.dim() > 0 else None for t in args),
            "kwargs": {k: ({0: batch} if t.dim() > 0 else None) for k, t in kwargs.items()},
        }
        dynamic_shapes = _shapes_for_signature(twin, args, kwargs, dynamic_shapes)
    try:
        return torch.export.export(twin, args, kwargs, dynamic_shapes=dynamic_shapes, strict=False)
    except Exception as exc:
        where = stack[-1] if stack else f"<root> ({model_name})"
        first = str(exc).strip().splitlines()
        cause = f"{type(exc).__name__}: {first[0] if first else ''}"
        raise TraceError(
            f"cannot trace {model_name}: torch.export failed in module {where} at "
            f"{_user_frame(exc)}. Cause: {cause}. Try: {_hint(str(exc))}"
        ) from exc
    finally:
        for handle in handles:
            handle.remove()


def _shapes_for_signature(
    twin: nn.Module,
    args: tuple[torch.Tensor, ...],
    kwargs: dict[str, torch.Tensor],
    spec: dict[str, Any],
) -> Any:
    """Lay the per-input dynamic-shape specs out as ``torch.export`` expects them.

    ``torch.export`` matches ``dynamic_shapes`` against ``forward``'s parameter names, so
    positional inputs are named by the signature and keyword inputs by their keys.
    """
    import inspect

    params = list(inspect.signature(twin.forward).parameters)
    out: dict[str, Any] = {}
    for i, shape in enumerate(spec["args"]):
        if i >= len(params):
            raise TraceError(
                f"dynamic_batch=True needs named forward parameters, but input {i} has no "
                "matching parameter in forward's signature; pass the inputs as a dict"
            )
        out[params[i]] = shape
    out.update(spec["kwargs"])
    return out
