"""Single-pass host Adam kernels, compiled with numba (optional: ``offload-optim[single-pass]``).

[Note: single-pass host Adam]
torch's fused CPU Adam works in place. An exact undo of a speculative fp16 step (see
[Note: speculative steps] in hybrid_adam.py) therefore copies the master and moments
before each chunk's fused step: five parallel passes per chunk, 2.45x the plain step per
parameter on the H200 host (BENCHMARKS.md, session 11). The kernels here do it in one
pass: each element's master, gradient and moments are read once, and the step writes the
master in place, the old master into the backup and the new moments into the spare pair,
while it checks the gradient for non-finite values. The plain step gets a kernel of the
same arithmetic, so that a committed speculative step equals the plain step bit for bit.
The arithmetic is torch's fused AdamW/Adam formula in fp32 (decay or L2, lerp of the first
moment, the bias-corrected update); it differs from torch's kernel in rounding only (about
1e-7 of the update: FMA contraction and operation order). So a run steps every host
region with one family of kernels: ``HybridAdam(host_kernel="single_pass")``.

On the 2-core development machine (``benchmarks/single_pass_adam_bench.py --numel 64e6``)
the in-place kernel runs at torch's rate (0.98-1.01x) and the speculative one at 1.8-1.9x
it, against 3.4-3.5x for the copies route. Two details decide that: each kernel's loop is
written out over slices of one block (with a shared inlined helper returning a tuple, or
numba's default error model for division, the loop did not vectorize and ran at half
torch's rate), and the gradient check is an integer OR of ``g - g != 0``, which
vectorizes without reassociating floating-point sums.

Launches hold a module lock: numba's portable thread pool ("workqueue") must not be
entered from two threads at once, and the optimizer steps from the host worker and the
main thread. Each launch uses torch's intra-op thread count. The kernels compile on first
use (a few seconds, cached on disk by numba).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from functools import cache
from typing import Any

import torch

from offload_optim.kernels import AdamHyper

BLOCK_NUMEL = 1 << 16
"""Elements per parallel work item (256 KiB of fp32 per array: a core's L2 holds a block
of every array a kernel touches)."""

_launch_lock = threading.Lock()


def available() -> bool:
    """Whether numba can be imported (the kernels then compile on first use)."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return False
    return True


def require() -> None:
    """Raise ImportError, saying how to install it, when numba is missing."""
    if not available():
        raise ImportError(
            "host_kernel='single_pass' needs numba: pip install 'offload-optim[single-pass]' "
            "(or pip install numba)"
        )


@cache
def _kernels() -> tuple[Callable[..., None], Callable[..., None]]:
    from offload_optim import _numba_adam  # imports numba: only once it is needed

    return _numba_adam.in_place, _numba_adam.speculative


def _constants(hyper: AdamHyper, step: float, grad_scale: torch.Tensor | None) -> Any:
    import numpy as np

    bc1 = 1.0 - hyper.beta1**step
    bc2 = 1.0 - hyper.beta2**step
    decay = 1.0 - hyper.lr * hyper.weight_decay if hyper.adamw else 1.0
    l2 = 0.0 if hyper.adamw else hyper.weight_decay
    scale = 1.0 if grad_scale is None else float(grad_scale)
    return np.array(
        [
            decay,
            l2,
            1.0 - hyper.beta1,
            hyper.beta2,
            1.0 - hyper.beta2,
            hyper.lr / bc1,
            math.sqrt(bc2),
            hyper.eps,
            scale,
            0.0 if grad_scale is None else 1.0,
        ],
        dtype=np.float32,
    )


def _flat(t: torch.Tensor, what: str) -> Any:
    if t.device.type != "cpu" or t.dtype != torch.float32 or not t.is_contiguous():
        raise ValueError(
            f"single-pass Adam steps contiguous fp32 host tensors; {what} is "
            f"{t.dtype} on {t.device}{'' if t.is_contiguous() else ', not contiguous'}"
        )
    return t.view(-1).numpy()


def _launch(kernel: Callable[..., None], *args: Any) -> None:
    import numba

    with _launch_lock:
        most = int(getattr(numba.config, "NUMBA_NUM_THREADS", 1))
        numba.set_num_threads(max(1, min(torch.get_num_threads(), most)))
        kernel(*args)


def _check_numel(n: int, **tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.numel() != n:
            raise ValueError(f"single-pass Adam: {name} has {t.numel()} elements, not {n}")


@torch.no_grad()
def adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> None:
    """One Adam(W) step of an fp32 host tensor, in place, in one pass.

    ``step`` (0-dim) already counts this step. The gradient is divided by ``grad_scale``
    (0-dim fp32) when given and written back divided, as torch's fused kernel leaves it.
    """
    require()
    _check_numel(param.numel(), grad=grad, exp_avg=exp_avg, exp_avg_sq=exp_avg_sq)
    in_place, _ = _kernels()
    arrays = [
        _flat(param, "param"),
        _flat(grad, "grad"),
        _flat(exp_avg, "exp_avg"),
        _flat(exp_avg_sq, "exp_avg_sq"),
    ]
    _launch(in_place, *arrays, _constants(hyper, float(step), grad_scale))


@torch.no_grad()
def speculative_adam_(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    next_avg: torch.Tensor,
    next_avg_sq: torch.Tensor,
    backup: torch.Tensor,
    step: torch.Tensor,
    hyper: AdamHyper,
    grad_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`adam_` that keeps what an exact undo needs, in the same single pass.

    Writes the old master into ``backup``, steps ``param`` in place and writes the new
    moments into ``next_avg`` / ``next_avg_sq`` (``exp_avg`` / ``exp_avg_sq`` are only
    read). The values equal :func:`adam_`'s bit for bit. Returns the overflow partial:
    a 0-dim fp32 tensor, ``inf`` when an element of the gradient (before unscaling) is
    not finite, else 0 (the contract of ``kernels.speculative_adam_``'s sum).
    """
    require()
    n = param.numel()
    _check_numel(
        n,
        grad=grad,
        exp_avg=exp_avg,
        exp_avg_sq=exp_avg_sq,
        next_avg=next_avg,
        next_avg_sq=next_avg_sq,
        backup=backup,
    )
    import numpy as np

    _, speculative = _kernels()
    bad = np.zeros((n + BLOCK_NUMEL - 1) // BLOCK_NUMEL, dtype=np.uint8)
    named = (
        (param, "param"),
        (grad, "grad"),
        (exp_avg, "exp_avg"),
        (exp_avg_sq, "exp_avg_sq"),
        (backup, "backup"),
        (next_avg, "next_avg"),
        (next_avg_sq, "next_avg_sq"),
    )
    arrays = [_flat(t, name) for t, name in named]
    _launch(speculative, *arrays, bad, _constants(hyper, float(step), grad_scale))
    return torch.tensor(math.inf if bad.any() else 0.0, dtype=torch.float32)
