"""Checkpoints of data-parallel training with ``torch.distributed.checkpoint`` (DCP).

[Note: distributed checkpoints]
Under data parallel each rank keeps only the moments of the regions it steps ([Note: data
parallel] in ``offload_runtime.distributed``), so no rank can save the optimizer alone.
:func:`save_distributed` writes one DCP checkpoint (a directory) from every rank
together: each entry under a key of its own, flat:

- ``module.<name>``: the fp32 master weights and buffers (``OffloadModule.state_dict``),
  the same on every rank, so DCP writes them once;
- ``optimizer.state.<name>.<key>``: the state of the module's parameter ``<name>`` (a
  parameter that is not the module's: ``#<i>``, its index in the optimizer's groups)
  from the rank that steps it;
- ``meta``: the optimizer's parameter groups, the loss scaler, the step count and the
  caller's ``extra`` values, as JSON.

:func:`load_distributed` asks for the master weights and the state of the parameters
this rank steps now, whatever the number of ranks that saved it: a checkpoint saved on N
ranks resumes on M (one process without a process group included), since a parameter's
state is found by its parameter's name, not by its old owner or region.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystemReader
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from offload_optim.amp import AMPOptimizer
from offload_runtime.distributed import agree

_STATE = "optimizer.state."
_META = "meta"


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


@contextlib.contextmanager
def _quiet_single_process() -> Iterator[None]:
    """DCP warns on every call without a process group, even when asked for that."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _names(amp: AMPOptimizer) -> list[str]:
    """Each of the optimizer's parameters' key: its name in the module, else ``#<i>``."""
    named = {id(p): name for name, p in amp.module.named_parameters()}
    params = [p for group in amp.optimizer.param_groups for p in group["params"]]
    return [named.get(id(p), f"#{i}") for i, p in enumerate(params)]


def _flat(state: dict[str, Any], names: list[str], extra: dict[str, Any]) -> dict[str, Any]:
    """``AMPOptimizer.state_dict(shard=True)`` output as DCP's flat keys (see the note),
    ``names`` the optimizer's parameters' keys (:func:`_names`)."""
    flat: dict[str, Any] = {f"module.{k}": v for k, v in state["module"].items()}
    for i, entry in state["optimizer"]["state"].items():
        for key, value in entry.items():
            flat[f"{_STATE}{names[i]}.{key}"] = value
    meta = {
        "param_groups": state["optimizer"]["param_groups"],
        "scaler": state["scaler"],
        "step_count": state["step_count"],
        "extra": extra,
    }
    flat[_META] = io.BytesIO(json.dumps(meta).encode())
    return flat


def save_distributed(
    amp: AMPOptimizer, path: str | os.PathLike[str], extra: dict[str, Any] | None = None
) -> None:
    """Save ``amp``'s training state (master weights, optimizer state of every rank, loss
    scaler, step count) to the DCP checkpoint directory ``path``, on every rank of the
    default process group together (or in one process without one).

    ``extra``: the caller's JSON-serialisable values (e.g. the number of batches done),
    returned by :func:`load_distributed`. Call after :meth:`AMPOptimizer.step`.
    """
    flat = _flat(amp.state_dict(shard=True), _names(amp), extra or {})
    with _quiet_single_process():
        dcp_save(flat, checkpoint_id=os.fspath(path), no_dist=_no_dist())


def load_distributed(amp: AMPOptimizer, path: str | os.PathLike[str]) -> dict[str, Any]:
    """Load what :func:`save_distributed` wrote into ``amp`` (and its module), on any
    number of ranks; the next step continues the run as if it had not stopped. Returns
    the ``extra`` values saved with it.

    Raises:
        ValueError: ``path`` is not such a checkpoint of this model (a missing entry, or
            one of another shape).
        RuntimeError: another rank could not read it (the message names the rank).
    """
    mine, names = amp.state_dict(shard=True), _names(amp)
    flat = _flat(mine, names, {})
    # Every rank checks what it needs before the collective read, and the ranks agree
    # on the outcome: one that lacks its entries must not leave the others waiting.
    failure: ValueError | None = None
    try:
        saved = FileSystemReader(os.fspath(path)).read_metadata().state_dict_metadata
    except OSError as exc:
        failure = ValueError(f"{os.fspath(path)} is not a distributed checkpoint: {exc}")
    else:
        missing = sorted(k for k in flat if k not in saved)
        if missing:
            failure = ValueError(
                f"{os.fspath(path)} lacks {len(missing)} entries this model needs, e.g. "
                f"{missing[:3]}: load a checkpoint that save_distributed wrote for this model"
            )
    agree(failure, f"reading checkpoint {os.fspath(path)}")
    flat[_META] = io.BytesIO()
    try:
        with _quiet_single_process():
            dcp_load(flat, checkpoint_id=os.fspath(path), no_dist=_no_dist())
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"{os.fspath(path)} does not fit this model: {exc}") from exc
    meta = json.loads(flat[_META].getvalue())
    state = {
        i: {key: flat[f"{_STATE}{names[i]}.{key}"] for key in entry}
        for i, entry in mine["optimizer"]["state"].items()
    }
    amp.load_state_dict(
        {
            "module": {k: flat[f"module.{k}"] for k in mine["module"]},
            "optimizer": {"state": state, "param_groups": meta["param_groups"]},
            "scaler": meta["scaler"],
            "step_count": meta["step_count"],
        },
        shard=True,
    )
    return dict(meta["extra"])


__all__ = ["load_distributed", "save_distributed"]
