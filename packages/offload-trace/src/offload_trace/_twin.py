"""A meta-device twin of the user's model, in the training dtype.

The twin is a ``copy.deepcopy`` of the model whose memo is pre-seeded so that every
parameter and buffer maps to an empty meta tensor of the training dtype. Because the memo
is keyed by object identity, a parameter reachable under several names (tied weights) maps
to one twin parameter, so ties survive the copy and tracing never touches real storage.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from offload_trace.errors import TraceError


@dataclass(frozen=True)
class MetaTwin:
    """The twin module and how its tensors relate to the original's names."""

    module: nn.Module
    param_names: tuple[str, ...]
    """Every parameter name of the original (``remove_duplicate=False``), in its order."""
    buffer_names: tuple[str, ...]
    """Every buffer name of the original (``remove_duplicate=False``), in its order."""
    names_by_twin_id: dict[int, tuple[str, ...]]
    """``id`` of a twin parameter -> the original names that share it."""
    param_numel: dict[str, int]
    param_dtype: dict[str, torch.dtype]
    """Training dtype of each parameter (non-floating parameters keep theirs)."""
    param_trainable: dict[str, bool]
    """Whether each parameter trains (``requires_grad``): a frozen one has no optimizer
    state."""
    identity_groups: tuple[tuple[str, ...], ...]
    """Original parameter names grouped by tensor identity, groups of two or more only."""


def _meta_like(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    target = dtype if t.is_floating_point() else t.dtype
    return torch.empty(tuple(t.shape), dtype=target, device="meta")


def build_meta_twin(model: nn.Module, dtype: torch.dtype) -> MetaTwin:
    """Copy ``model`` onto the meta device in ``dtype`` without copying any weight.

    Raises:
        TraceError: the model cannot be deep-copied.
    """
    memo: dict[int, object] = {}
    names_by_orig_id: dict[int, list[str]] = {}
    param_names: list[str] = []
    numel: dict[str, int] = {}
    pdtype: dict[str, torch.dtype] = {}
    trainable: dict[str, bool] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        param_names.append(name)
        numel[name] = p.numel()
        trainable[name] = p.requires_grad
        twin_param = memo.get(id(p))
        if not isinstance(twin_param, nn.Parameter):
            twin_param = nn.Parameter(_meta_like(p, dtype), requires_grad=p.requires_grad)
            memo[id(p)] = twin_param
        pdtype[name] = twin_param.dtype
        names_by_orig_id.setdefault(id(p), []).append(name)
    buffer_names: list[str] = []
    for name, b in model.named_buffers(remove_duplicate=False):
        buffer_names.append(name)
        if id(b) not in memo:
            memo[id(b)] = _meta_like(b, dtype)
    try:
        twin = copy.deepcopy(model, memo)
    except Exception as exc:  # any failure of a user __deepcopy__ or unpicklable attribute
        raise TraceError(
            f"cannot copy {type(model).__name__} onto the meta device: deepcopy failed with "
            f"{type(exc).__name__}: {exc}. Tracing works on a copy so the caller's model is "
            "never modified; make the model deep-copyable (drop open files, locks or "
            "hooks holding external state) or build it under `with torch.device('meta')`"
        ) from exc
    twin.train()
    names_by_twin_id: dict[int, tuple[str, ...]] = {}
    for orig_id, names in names_by_orig_id.items():
        names_by_twin_id[id(memo[orig_id])] = tuple(names)
    groups = tuple(tuple(n) for n in names_by_orig_id.values() if len(n) > 1)
    return MetaTwin(
        module=twin,
        param_names=tuple(param_names),
        buffer_names=tuple(buffer_names),
        names_by_twin_id=names_by_twin_id,
        param_numel=numel,
        param_dtype=pdtype,
        param_trainable=trainable,
        identity_groups=groups,
    )
